"""Recipes: a rewrite recorded so that it can be replayed on a new trace.

A tree is traced at fixed shapes and static values. To run a rewritten
model at other shapes (another batch size, sequence length, KV-cache
length) or in another mode (``train=False``), the model is traced again and
the same rewrite applied to the new tree. A :class:`Recipe` is that rewrite,
recorded: a list of steps, each a function ``(mox, params) -> result``,
where ``result`` is a ``Mox`` (the params unchanged) or a tool result with
``.mox`` and ``.params`` (``yax.lora``, ``yax.quantize``).

Tools that change the params record their call: ``yax.lora(...)`` returns a
result whose ``.recipe`` replays ``lora`` with the same arguments, and
knows the params it was given (their shapes and dtypes, and where they sit
among the traced function's arguments), so that ``yax.keep`` can trace the
base model again without the user keeping the base weights at hand.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import jax

from yax._src.errors import SubstitutionError
from yax._src.ir.nodes import Mox
from yax._src.rewrite.engine import collections_of


@dataclasses.dataclass(frozen=True)
class Base:
  """The params a recipe was first applied to, as abstract values.

  Attributes:
    where: the traced argument that holds them: ``(0, i)`` for the i-th
      positional argument, ``(1, name)`` for a keyword argument.
    params: the params tree with ``jax.ShapeDtypeStruct`` leaves.
  """
  where: tuple
  params: Any


@dataclasses.dataclass(frozen=True)
class Step:
  """One rewrite of a recipe: ``fn(mox, params)`` returns a ``Mox`` or a
  result with ``.mox`` and ``.params``; ``name`` is shown in messages;
  ``reads_params``: the step needs the params (a tool that adds or changes
  them), so replaying it needs the recipe's ``base``."""
  name: str
  fn: Callable[[Mox, Any], Any]
  reads_params: bool = False


@dataclasses.dataclass(frozen=True)
class Applied:
  """What :meth:`Recipe.apply` returns.

  Attributes:
    mox: the rewritten tree.
    params: the params to pass with it (the last step's ``.params``).
    results: what each step returned, in order (``LoraResult`` s ...).
    recipe: the recipe, knowing the params it was applied to (for
      ``yax.keep``).
  """
  mox: Mox
  params: Any
  results: tuple
  recipe: 'Recipe'


class Recipe:
  """A rewrite recorded as steps, replayed by ``apply`` on any trace.

  Build one with :func:`recipe` from a function, or take ``.recipe`` from
  a tool result (``yax.lora``, ``yax.quantize``). ``a + b`` runs ``a``'s
  steps, then ``b``'s.

  Example::

      res = yax.lora(mox, variables, '//module_call[@type="Dense"]')
      both = res.recipe + yax.recipe(lambda m: yax.remat(m, '//...'))
      out = both.apply(mox, variables)           # out.mox, out.params
  """

  __slots__ = ('steps', 'base', 'unbound')

  def __init__(self, steps=(), base: Base | None = None,
               unbound: str | None = None):
    self.steps = tuple(steps)
    self.base = base
    self.unbound = unbound  # why ``base`` could not be recorded
    for step in self.steps:
      if not isinstance(step, Step):
        raise SubstitutionError(
            f'Recipe: each step must be a yax Step, found '
            f'{type(step).__name__} {step!r}'[:300])

  def __add__(self, other: 'Recipe') -> 'Recipe':
    if not isinstance(other, Recipe):
      return NotImplemented
    return Recipe(self.steps + other.steps, self.base or other.base,
                  self.unbound or other.unbound)

  def __repr__(self) -> str:
    names = ', '.join(s.name for s in self.steps)
    bound = '' if self.base is None else f', params at {where_str(self.base.where)}'
    return f'Recipe([{names}]{bound})'

  def apply(self, mox: Mox, params=None) -> Applied:
    """Runs the steps on ``mox`` and ``params``.

    **Arguments:**
    - ``mox``: a traced tree.
    - ``params``: the argument that holds its parameters (what
      ``yax.lora`` takes); may be left out when no step reads it.

    **Returns:** an :class:`Applied` (``.mox``, ``.params``, ``.results``,
    and ``.recipe``, this recipe knowing the params it was applied to).
    """
    results = []
    original, first = mox, params
    for step in self.steps:
      mox, params, result = run_step(step, mox, params)
      results.append(result)
    base = self.base
    if base is None and first is not None:
      base = base_of(original, first)
    return Applied(mox, params, tuple(results),
                   Recipe(self.steps, base, None if base else self.unbound))


def run_step(step: Step, mox: Mox, params):
  """``(mox, params, result)`` after ``step``; a ``SubstitutionError``
  naming the step if it returned something else than a tree or a result
  with ``.mox`` and ``.params``."""
  result = step.fn(mox, params)
  if isinstance(result, Mox):
    return result, params, result
  new_mox = getattr(result, 'mox', None)
  if not isinstance(new_mox, Mox) or not hasattr(result, 'params'):
    raise SubstitutionError(
        f'recipe step {step.name}: expected a Mox or a result with .mox and '
        f'.params (what yax.lora returns), found {type(result).__name__}')
  return new_mox, result.params, result


def recipe(fn: Callable) -> Recipe:
  """A one-step recipe from a function.

  **Arguments:**
  - ``fn``: ``fn(mox) -> Mox`` (a rewrite that adds no params: ``yax.sub``,
    ``yax.remat``, ``yax.cast``...) or ``fn(mox, params)`` returning a
    ``Mox`` or a tool result with ``.mox`` and ``.params``.

  **Returns:** a :class:`Recipe`. Apply it once to a traced tree
  (``recipe.apply(mox, params)``) and pass ``.recipe`` of the result to
  ``yax.keep`` when a step changes the params.

  Example::

      swap = yax.recipe(lambda m: yax.sub(yax.match(nn.gelu, m),
                                          yax.trace_like(jax.nn.silu), m))
  """
  if not callable(fn):
    raise SubstitutionError(
        f'recipe expects a function of (mox) or (mox, params), found '
        f'{type(fn).__name__}')
  name = getattr(fn, '__name__', type(fn).__name__)
  if _positional_count(fn) == 1:
    return Recipe([Step(name, lambda mox, params: fn(mox))])
  return Recipe([Step(name, fn, reads_params=True)])


def _positional_count(fn) -> int | None:
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):  # a builtin without a signature: (mox, params)
    return None
  return sum(1 for p in sig.parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
             and p.default is p.empty)


def abstract(tree):
  """``tree`` with each array leaf a ``jax.ShapeDtypeStruct`` (named
  shardings kept, so that a replay places new variables the same way)."""
  def leaf(x):
    aval = jax.typeof(x)
    sharding = getattr(x, 'sharding', None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
      sharding = None
    return jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype,
                                sharding=sharding)
  return jax.tree.map(leaf, tree)


def base_of(mox: Mox, params) -> Base:
  """Where ``params`` sits among ``mox``'s root arguments, and its abstract
  value. ``SubstitutionError`` when no argument holding a variable
  collection has ``params``' structure."""
  root = jax.tree_util.tree_unflatten(mox.in_tree, mox.inputs)
  want = jax.tree_util.tree_structure(params)
  seen = []
  for prefix in collections_of(mox).values():
    if len(prefix) < 2:
      continue
    where = tuple(prefix[:2])
    try:
      arg = root[where[0]][where[1]]
    except (KeyError, IndexError, TypeError):
      continue
    seen.append(where)
    if jax.tree_util.tree_structure(arg) == want:
      return Base(where, abstract(params))
  raise SubstitutionError(
      'recipe: the params given have the structure of no traced argument '
      'that holds variables (' + (', '.join(where_str(w) for w in seen)
                                  or 'none found') + '); pass the argument '
      'that holds the parameters, as to yax.lora')


def where_str(where: tuple) -> str:
  return f'args[{where[1]}]' if where[0] == 0 else f'kwargs[{where[1]!r}]'


def recorded(tool: Callable) -> Callable:
  """Decorates a tool ``tool(mox, params, *args, **kwargs) -> result`` so
  that its result's ``.recipe`` replays the call (same arguments) and knows
  the params it was given."""
  @functools.wraps(tool)
  def wrapper(mox, params, *args, **kwargs):
    result = tool(mox, params, *args, **kwargs)
    step = Step(tool.__name__,
                functools.partial(_replay_tool, tool, args, kwargs),
                reads_params=True)
    try:
      base, unbound = base_of(mox, params), None
    except SubstitutionError as e:
      # The tool's own result stands; only yax.keep needs the base, and
      # says why it is missing when asked to replay this recipe.
      base, unbound = None, str(e)
    return dataclasses.replace(result, recipe=Recipe([step], base, unbound))
  return wrapper


def _replay_tool(tool, args, kwargs, mox, params):
  return tool(mox, params, *args, **kwargs)
