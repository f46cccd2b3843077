"""A rewritten model kept as a function: any shape, any mode.

A tree is traced at fixed shapes and static values; ``eval_mox`` runs it at
those only. ``yax.keep(fn, recipe)`` returns a function that, called with
new arguments, traces ``fn`` at their shapes (with the base params as
abstract values: nothing is computed), replays the recipe on that trace and
evaluates the rewritten tree on the arguments. The rewritten tree is cached
per abstract signature (tree structure, shapes and dtypes, static values),
as ``jax.jit`` caches its traces: a decoding loop traces once for the
prompt and once for the one-token steps.

The params passed in are the rewritten model's (the base weights and the
trained adapters): the new variables keep one set of values across shapes.
Each replay checks that the recipe, at the new shapes, makes the params the
caller passes (same paths, shapes and dtypes), and raises
``yax.SignatureError`` naming the first one that differs.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from yax._src.errors import SignatureError, SubstitutionError
from yax._src.ir.nodes import Mox
from yax._src.rewrite.recipe import Base, Recipe, run_step, where_str
from yax._src.trace.eval import eval_mox
from yax._src.trace.make import is_dynamic_arg, make_mox


class Kept:
  """A rewritten model: ``fn`` traced per signature, the recipe replayed.

  Call it as ``fn`` is called, with the rewritten params where ``fn``
  takes its params. Works eagerly and under ``jax.jit``, ``grad`` and
  ``vmap`` (under ``vmap`` it traces at the per-example shapes).

  Attributes:
    fn: the traced function.
    recipe: the rewrite replayed on each new trace.
    cache_size: how many signatures have been traced and rewritten.
  """

  def __init__(self, fn: Callable, recipe: Recipe, static_argnums=(),
               static_argnames=()):
    self.fn = fn
    self.recipe = recipe
    self.static_argnums = tuple(sorted(static_argnums))
    self.static_argnames = tuple(static_argnames)
    self._cache: dict = {}
    functools.update_wrapper(self, fn, updated=())

  @property
  def cache_size(self) -> int:
    return len(self._cache)

  def __repr__(self) -> str:
    name = getattr(self.fn, '__qualname__', type(self.fn).__name__)
    return (f'Kept({name}, {self.recipe!r}, {self.cache_size} signatures '
            'traced)')

  def __call__(self, *args, **kwargs):
    dyn_args, dyn_kwargs, statics = self._split(args, kwargs)
    mox = self._lookup(dyn_args, dyn_kwargs, statics)
    return eval_mox(mox, *dyn_args, **dyn_kwargs)

  def mox(self, *args, **kwargs) -> Mox:
    """The rewritten tree for these arguments (traced and rewritten if no
    call had their signature yet); static arguments are baked in, so
    ``eval_mox`` takes the others."""
    return self._lookup(*self._split(args, kwargs))

  # ------------------------------------------------------------ internals

  def _split(self, args, kwargs):
    for i in self.static_argnums:
      if i >= len(args):
        raise SignatureError(
            f'keep: static_argnums names position {i}, but the call passes '
            f'{len(args)} positional arguments')
    statics = tuple((i, args[i]) for i in self.static_argnums) + tuple(
        sorted((k, kwargs[k]) for k in self.static_argnames if k in kwargs))
    dyn_args = tuple(a for i, a in enumerate(args)
                     if i not in self.static_argnums)
    dyn_kwargs = {k: v for k, v in kwargs.items()
                  if k not in self.static_argnames}
    return dyn_args, dyn_kwargs, statics

  def _where(self, base: Base) -> tuple:
    """``base.where`` among the arguments left once statics are taken out."""
    kind, at = base.where
    if kind == 0:
      if at in self.static_argnums:
        raise SignatureError(
            f'keep: the params are the positional argument {at}, which '
            'static_argnums makes static')
      return (0, at - sum(1 for i in self.static_argnums if i < at))
    if at in self.static_argnames:
      raise SignatureError(
          f'keep: the params are the keyword argument {at!r}, which '
          'static_argnames makes static')
    return base.where

  def _lookup(self, dyn_args, dyn_kwargs, statics) -> Mox:
    leaves, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
    try:
      key = (treedef, tuple(_leaf_key(x) for x in leaves), statics)
      hash(key)
    except TypeError as e:
      raise SignatureError(
          f'keep: a static argument is not hashable ({e}); static values '
          'key the cache of traces, as for jax.jit: pass arrays, numbers, '
          'bools, strings or other hashable values') from None
    found = self._cache.get(key)
    if found is None:
      found = self._cache[key] = self._trace(dyn_args, dyn_kwargs, statics)
    return found

  def _trace(self, dyn_args, dyn_kwargs, statics) -> Mox:
    base = self.recipe.base
    where = self._where(base) if base is not None else None
    spec_args, spec_kwargs = jax.tree.map(_spec, (dyn_args, dyn_kwargs))
    given = None
    if where is not None:
      given = _argument(dyn_args, dyn_kwargs, where)
      spec_args, spec_kwargs = _with_argument(spec_args, spec_kwargs, where,
                                             base.params)
    traced = make_mox(functools.partial(_with_statics, self.fn, statics))(
        *spec_args, **spec_kwargs)
    if where is None:
      mox = traced
      for step in self.recipe.steps:
        mox, _, _ = run_step(step, mox, None)
      return mox
    made = {}

    def replay(params):
      mox = traced
      # Values that do not depend on the params (a PRNG key, initial
      # adapters drawn on the host) stay concrete: only the params are
      # abstract here.
      with jax.ensure_compile_time_eval():
        for step in self.recipe.steps:
          mox, params, _ = run_step(step, mox, params)
      made['mox'] = mox
      return params

    expected = jax.eval_shape(replay, base.params)
    mox = made['mox']
    if any(isinstance(c, jax.core.Tracer) for c in mox.consts):
      raise SubstitutionError(
          f'keep: replaying {self.recipe!r} baked values computed from the '
          'params into the tree as constants; a recipe step must read the '
          'params through the tree\'s inputs')
    _check_params(expected, given, where_str(base.where))
    return mox


def _with_statics(fn, statics, *args, **kwargs):
  args = list(args)
  for at, value in statics:
    if isinstance(at, int):
      args.insert(at, value)
    else:
      kwargs[at] = value
  return fn(*args, **kwargs)


def _leaf_key(x):
  """What a leaf contributes to the cache key: shape, dtype and weak type
  for an array (or tracer), the type for a Python number (traced, weakly
  typed), the value itself for a static value."""
  if isinstance(x, (bool, str)) or not is_dynamic_arg(x):
    return ('static', type(x), x)
  if isinstance(x, (int, float, complex)):
    return ('number', type(x))
  aval = jax.typeof(x)  # the trace sees shape and dtype (see ``_spec``)
  return (tuple(aval.shape), aval.dtype, getattr(aval, 'weak_type', False))


def _spec(x):
  """The argument the trace sees: arrays and tracers abstract, Python
  numbers as they are (traced weakly typed, as ``make_mox`` does)."""
  if isinstance(x, (bool, str, int, float, complex)) or not is_dynamic_arg(x):
    return x
  aval = jax.typeof(x)
  return jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype,
                              weak_type=getattr(aval, 'weak_type', False))


def _argument(args, kwargs, where):
  kind, at = where
  try:
    return args[at] if kind == 0 else kwargs[at]
  except (IndexError, KeyError):
    raise SignatureError(
        f'keep: the recipe was recorded with the params at '
        f'{where_str(where)}, but the call passes {len(args)} positional '
        f'arguments and the keywords {sorted(kwargs)}') from None


def _with_argument(args, kwargs, where, value):
  kind, at = where
  if kind == 0:
    args = list(args)
    args[at] = value
    return tuple(args), kwargs
  return args, {**kwargs, at: value}


def _type_str(x) -> str:
  try:
    return jax.typeof(x).str_short(short_dtypes=True)
  except TypeError:
    return f'{type(x).__name__} {x!r}'[:200]


def _check_params(expected, given, where: str) -> None:
  """``SignatureError`` naming the first path where ``given`` (the params
  of the call) differs from ``expected`` (what the recipe makes, replayed
  at these shapes)."""
  want = {jax.tree_util.keystr(p): x
          for p, x in jax.tree_util.tree_flatten_with_path(expected)[0]}
  have = {jax.tree_util.keystr(p): x
          for p, x in jax.tree_util.tree_flatten_with_path(given)[0]}
  intro = (f'keep: the params at {where} do not match what the recipe makes '
           'when replayed at these shapes')
  for path, x in want.items():
    if path not in have:
      raise SignatureError(
          f'{intro}: {where}{path} is missing\n  expected: {_type_str(x)}\n'
          '  given:    nothing')
    got = have[path]
    if (tuple(_shape(got)) != tuple(x.shape)
        or _dtype(got) != x.dtype):
      raise SignatureError(
          f'{intro}: {where}{path} differs\n  expected: {_type_str(x)}\n'
          f'  given:    {_type_str(got)}')
  for path, got in have.items():
    if path not in want:
      raise SignatureError(
          f'{intro}: {where}{path} is unexpected (the recipe makes no '
          f'variable there)\n  expected: nothing\n  given:    '
          f'{_type_str(got)}')


def _shape(x):
  return jax.typeof(x).shape


def _dtype(x):
  return jax.typeof(x).dtype


def keep(fn: Callable, recipe: Recipe, *, static_argnums=(),
         static_argnames=()) -> Kept:
  """The rewritten model as a function of any shape and mode.

  **Arguments:**
  - ``fn``: the function that was traced (``model.apply``, a Hugging Face
    model called as ``model(ids, params=p)``, a decode step ...). It is
    traced again for each new signature.
  - ``recipe``: the rewrite, e.g. ``res.recipe`` of ``yax.lora``; several
    composed with ``+``. A recipe whose steps add or change params must
    know the params it was first applied to (a tool result's ``.recipe``
    does; for :func:`yax.recipe` use ``.recipe`` of its ``apply``).
  - ``static_argnums``, ``static_argnames``: arguments baked into the
    trace (a cache length given as an int, a mode string), as in
    ``jax.jit``; they must be hashable. ``bool`` and string arguments
    are static anyway.

  **Returns:** a :class:`Kept`, called as ``fn`` with the rewritten params
  (base weights and the new variables, trained or not). It traces ``fn``
  at the arguments' shapes with the base params abstract, replays the
  recipe, checks that the params given are the ones the recipe makes
  (``SignatureError`` naming the first differing path) and evaluates;
  the rewritten tree is cached per signature.

  Example::

      res = yax.lora(yax.make_mox(model.apply)(variables, x), variables,
                     rank=8)
      model_lora = yax.keep(model.apply, res.recipe)
      y = model_lora(trained, x_of_another_batch_size, train=False)
  """
  if not callable(fn):
    raise SubstitutionError(f'keep expects a callable, found '
                            f'{type(fn).__name__}')
  if not isinstance(recipe, Recipe):
    raise SubstitutionError(
        f'keep expects a yax.Recipe (e.g. res.recipe of yax.lora), found '
        f'{type(recipe).__name__}')
  readers = [s.name for s in recipe.steps if s.reads_params]
  if readers and recipe.base is None:
    raise SubstitutionError(
        f'keep: the recipe step {readers[0]} reads the params, but the '
        'recipe does not know the params it was first applied to' + (
            f' ({recipe.unbound})' if recipe.unbound else '; apply it to a '
            'traced tree first (out = recipe.apply(mox, params)) and keep '
            'out.recipe'))
  for i in static_argnums:
    if isinstance(i, bool) or not isinstance(i, int) or i < 0:
      raise SubstitutionError(
          f'keep: static_argnums must be non-negative ints, found {i!r}')
  return Kept(fn, recipe, static_argnums, static_argnames)

