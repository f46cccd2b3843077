"""Evaluation of module expressions.

``Interpreter`` is the one walker that runs a tree: one method per node kind
(``run_module``, ``run_equation``), an environment dict, read and write.
Subclass it to observe or change evaluation (e.g. record activations).
Values are dropped from the environment after their last use, as JAX's
``eval_jaxpr`` does, so eager evaluation does not hold every intermediate.
"""

from __future__ import annotations

import collections.abc
import contextlib
import contextvars
import weakref
from typing import Any, Sequence

import jax

from yax._src.errors import EvaluationError, SignatureError
from yax._src.ir import lower as _lower
from yax._src.ir import rules as _rules
from yax._src.ir.nodes import Equation, Expr, Literal, Mox, Symbol
from yax._src.ir.text import safe_getattr, safe_repr
from yax._src.trace import systems as _systems


# ---------------------------------------------------------- interpreter

# A function of a module call returning a context manager that every
# interpreter enters around the call's body while it is set (None: none).
# ``yax.memory_report`` opens a ``jax.named_scope`` per call with it, so the
# equations JAX traces carry the call they belong to, in ``eval_mox`` trees
# that a loss function evaluates as well.
MODULE_SCOPE: contextvars.ContextVar = contextvars.ContextVar(
    'yax_module_scope', default=None)


class Interpreter:
  """Runs a tree node by node. Override a ``run_*`` method to change a kind.

  Each equation is executed by JAX's own ``jax.core.eval_jaxpr`` on a
  one-equation Jaxpr, so primitives with sub-Jaxprs (``jit``, ``scan``,
  ``custom_jvp_call``) are bound exactly as JAX binds them. An equation whose
  body holds module calls (``nn.scan``, ``nn.remat``, ``nn.jit``) is bound
  through its own primitive with a body that is this interpreter again
  (traced by ``jax.make_jaxpr``, see ``_rules.RUN_RULES``), so a subclass
  sees every module call, inside bodies too.

  An exception raised while an equation runs is re-raised as
  ``yax.EvaluationError`` naming the module path and the equation.

  A value leaves ``env`` after its last use: after the last equation that
  reads it, or, for the inputs and outputs of a module call, once that
  call's ``run_module`` has returned (so an override of ``run_module`` can
  still read them after calling ``super().run_module``). The outputs of the
  tree being run stay until ``run`` has read them.
  """

  def __init__(self):
    self.env: dict[Symbol, Any] = {}
    self.modules: list[Mox] = []  # the module calls being run, outermost first
    # For each scope being run (the tree, the body of an equation), the
    # symbols that are dead after each of its nodes (see ``dead_after``).
    self._dead: list[dict[int, list[Symbol]]] = []

  def read(self, sym: Symbol):
    if isinstance(sym, Literal):
      return sym.value
    return self.env[sym]

  def write(self, sym: Symbol, value) -> None:
    if not isinstance(sym, Literal):
      self.env[sym] = value

  def run(self, mox: Mox, consts: Sequence[Any], inputs: Sequence[Any]) -> list:
    """Binds ``mox.constvars`` and ``mox.inputs``, runs, returns outputs."""
    _bind(self, mox.constvars, consts, 'constants')
    _bind(self, mox.inputs, inputs, 'inputs')
    self._dead.append(dead_after(mox))
    try:
      self.run_module(mox)
    finally:
      self._dead.pop()
    return [self.read(s) for s in mox.outputs]

  def run_body(self, body: Mox, args: Sequence[Any]) -> list:
    """Runs the body of an equation (called while JAX traces it)."""
    outs = self.run(body, body.consts, args)
    # The body's values are tracers of a trace that ends with this call.
    for s in (*body.constvars, *body.inputs, *body.outputs):
      self.env.pop(s, None)
    return outs

  def run_node(self, node: Expr) -> None:
    if isinstance(node, Mox):
      self.run_module(node)
    else:
      self.run_equation(node)

  def run_module(self, mox: Mox) -> None:
    self.modules.append(mox)
    dead = self._dead[-1] if self._dead else {}
    hook = MODULE_SCOPE.get()
    try:
      with hook(mox) if hook is not None else contextlib.nullcontext():
        for child in mox.children:
          self.run_node(child)
          for s in dead.get(id(child), ()):  # last used by ``child``
            self.env.pop(s, None)
    finally:
      self.modules.pop()

  def run_equation(self, eqn: Equation) -> None:
    try:
      if eqn.children:
        params, inputs = _rules.run_rule(eqn)(self, eqn)
        jaxpr = _lower.one_equation_jaxpr(eqn.replace(inputs=inputs), params)
      else:
        inputs, jaxpr = eqn.inputs, _lower.one_equation_jaxpr(eqn)
      args = [self.read(s) for s in inputs if not isinstance(s, Literal)]
      outs = jax.core.eval_jaxpr(jaxpr, [], *args)
    except EvaluationError:
      raise  # raised in a body, where the module path is known best
    except Exception as e:  # noqa: BLE001 - re-raised with where it happened
      raise EvaluationError(_failure(self, eqn, e)) from e
    for s, v in zip(eqn.outputs, outs, strict=True):
      self.write(s, v)
    if inputs is not eqn.inputs:  # constants a run rule added for this call
      own = set(eqn.inputs)
      for s in inputs:
        if s not in own:
          self.env.pop(s, None)


def dead_after(scope: Mox) -> dict[int, list[Symbol]]:
  """For each node of ``scope`` (by ``id``), the symbols no later node of
  the scope uses, the scope's outputs excepted: ``Interpreter`` drops them
  from its environment once the node has run. An equation uses its inputs
  and outputs; a module call uses its inputs and outputs when it ends,
  after its body. The bodies of equations are scopes of their own.

  Computed once per scope (trees are immutable) and cached.
  """
  dead = _DEAD_AFTER.get(scope)
  if dead is None:
    last: dict[Symbol, Expr] = {}

    def visit(node):
      if isinstance(node, Mox):  # a module call: its body runs first
        for child in node.children:
          visit(child)
      for s in (*node.inputs, *node.outputs):
        last[s] = node  # a later use replaces an earlier one

    for child in scope.children:
      visit(child)
    keep = set(scope.outputs)
    dead = {}
    for s, node in last.items():
      if not isinstance(s, Literal) and s not in keep:
        dead.setdefault(id(node), []).append(s)
    _DEAD_AFTER[scope] = dead
  return dead


_DEAD_AFTER: 'weakref.WeakKeyDictionary[Mox, dict[int, list[Symbol]]]' = (
    weakref.WeakKeyDictionary())


def _bind(interp: Interpreter, symbols, values, what: str) -> None:
  symbols, values = list(symbols), list(values)
  if len(symbols) != len(values):
    raise EvaluationError(f'the tree has {len(symbols)} {what} but '
                          f'{len(values)} values were given')
  for s, v in zip(symbols, values, strict=True):
    interp.write(s, v)


def _failure(interp: Interpreter, eqn: Equation, error: Exception) -> str:
  module = next((m for m in reversed(interp.modules) if not m.is_ephemeral),
                None)
  if module is None:
    where = 'at the top level (no module call)'
  else:
    where = (f"in module call {module.type_name}.{module.entrypoint} at path "
             f"'{'/'.join(module.path) or '<root>'}'")
  if isinstance(error, KeyError) and error.args and isinstance(
      error.args[0], Symbol):
    problem = (f'it reads {error.args[0]!r}, which is not defined in its '
               'scope (check the tree with yax.check_mox)')
  else:
    problem = f'{type(error).__name__}: {error}'
  if eqn.children:  # the header only; bodies can be long
    name = f'[name={eqn.name}]' if eqn.name else ''
    text = (f"{' '.join(s.type_str for s in eqn.outputs)} = {eqn.prim.name}"
            f"{name} {' '.join(s.type_str for s in eqn.inputs)}")
  else:
    text = str(eqn)
  text = text if len(text) <= 300 else text[:300] + ' ...'
  return (f'evaluating equation {eqn.prim.name} {where} failed: {problem}\n'
          f'  equation: {text}')


# ------------------------------------------------------------- eval_mox

def _given_type(x) -> str:
  if isinstance(x, jax.ShapeDtypeStruct):
    return f'ShapeDtypeStruct {_short_type(x)}'
  try:
    return jax.typeof(x).str_short(short_dtypes=True)
  except Exception:  # noqa: BLE001 - not a JAX value: shown by class and repr
    return f'{type(x).__name__} {safe_repr(x, 200)}'


def _short_type(x) -> str:
  try:
    return jax.typeof(x).str_short(short_dtypes=True)
  except Exception:  # noqa: BLE001 - only shown in a message
    return f'{safe_getattr(x, "dtype")}{safe_getattr(x, "shape")}'


def check_arguments(mox: Mox, args, kwargs) -> list:
  """Flattens ``(args, kwargs)`` and checks them against ``mox.in_tree``.

  Containers may differ in type where the key paths are the same (a
  ``FrozenDict`` where a dict was traced, or the reverse): only the leaves
  reach the tree. Raises ``SignatureError`` naming the first argument path
  that differs (missing, unexpected, or expected vs given type).
  """
  leaves, tree = _systems.flatten_arguments(args, kwargs)  # NNX nodes split
  paths = None
  if mox.in_tree is not None and tree != mox.in_tree:
    # The arguments as the trace saw them (NNX nodes split), for key paths.
    leaves, paths = _match_tree(mox, jax.tree_util.tree_unflatten(tree, leaves))
  # Not strict: without an ``in_tree`` the counts may differ, which
  # ``Interpreter.run`` reports.
  leaves = [_typed_key(sym, x) for sym, x in zip(mox.inputs, leaves)] + \
      list(leaves[len(mox.inputs):])
  for i, (sym, x) in enumerate(zip(mox.inputs, leaves, strict=False)):
    problem = _leaf_problem(sym, x)
    if problem:
      if paths is None:
        paths = _tree_paths(mox.in_tree, jax.tree_util.tree_unflatten(
            tree, leaves))
      raise SignatureError(
          f'eval_mox: argument {paths[i]} does not match the trace.\n'
          f'  expected: {problem[0]}\n  given:    {problem[1]}')
  return leaves


def _typed_key(sym: Symbol, x):
  """``x`` as a typed PRNG key where the trace has one and ``x`` is a raw
  key (``jax.random.PRNGKey``'s ``uint32`` data) of the default
  implementation with the same key shape; else ``x`` unchanged (checked
  by :func:`_leaf_problem`). Any JAX key is accepted where a key is taken."""
  dtype = getattr(sym.aval, 'dtype', None)
  if (isinstance(sym, Literal) or dtype is None
      or not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
      or isinstance(x, jax.ShapeDtypeStruct)):
    return x
  try:
    aval = jax.typeof(x)
  except Exception:  # noqa: BLE001 - not a JAX value: reported by _leaf_problem
    return x
  if getattr(aval, 'dtype', None) != jax.numpy.uint32:
    return x
  data = jax.eval_shape(jax.random.key_data,
                        jax.ShapeDtypeStruct(tuple(sym.aval.shape), dtype))
  if tuple(aval.shape) != tuple(data.shape):
    return x
  key = jax.random.wrap_key_data(x)  # the default implementation's
  return key if key.dtype == dtype else x


def _leaf_problem(sym: Symbol, x) -> tuple[str, str] | None:
  """(expected, given) when the argument leaf ``x`` cannot stand for ``sym``."""
  if isinstance(sym, Literal) and sym.is_static:
    same = sym.value is x
    if not same:
      try:
        same = bool(sym.value == x) and type(sym.value) is type(x)
      except Exception:  # noqa: BLE001 - objects that cannot be compared differ
        same = False
    if not same:
      return (f'static value {safe_repr(sym.value, 200)} (it was baked into '
              'the trace)', f'{safe_repr(x, 200)}; trace again with make_mox '
              'to use another value')
    return None
  if isinstance(x, jax.ShapeDtypeStruct):
    return (sym.type_str,
            f'an abstract value, ShapeDtypeStruct {_short_type(x)}. eval_mox '
            'computes on arrays; for output shapes call it under '
            'jax.eval_shape(lambda *a, **k: yax.eval_mox(mox, *a, **k), ...)')
  try:
    aval = jax.typeof(x)
  except Exception:  # noqa: BLE001 - not a JAX value: reported below
    aval = None
  if aval is None or not hasattr(aval, 'shape'):
    return (sym.type_str, f'{type(x).__name__} {safe_repr(x, 200)}')
  if (tuple(aval.shape) != tuple(sym.aval.shape)
      or aval.dtype != sym.aval.dtype):
    if not all(isinstance(d, int) for d in sym.aval.shape):
      return (f'{sym.type_str}, a symbolic shape (traced with '
              'jax.export.symbolic_shape)', f'{_given_type(x)}. eval_mox '
              'runs a tree at the shapes it was traced with; to run a '
              'rewritten model at any shape, record the rewrite and call '
              'yax.keep(fn, res.recipe)(...), which traces and rewrites per '
              'shape, or jax.export the tree at symbolic shapes and call '
              'the export')
    return (sym.type_str, _given_type(x))
  return None


def _keystrs(tree) -> list[str]:
  """``args[0]['params']``-style paths of the leaves of ``(args, kwargs)``."""
  return [_argument_position(jax.tree_util.keystr(p))
          for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _tree_paths(treedef, given) -> list[str]:
  """The leaf paths of the traced argument tree ``treedef``."""
  if treedef is None:
    return _keystrs(given)
  try:
    traced = jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves))
  except Exception as e:  # noqa: BLE001 - reported with both treedefs
    raise SignatureError(
        'eval_mox: the argument tree differs from the traced one, whose '
        f'custom pytree nodes cannot be rebuilt to name paths ({e}).\n'
        f'  expected: {safe_repr(treedef, 600)}\n'
        f'  given:    {safe_repr(jax.tree_util.tree_structure(given), 600)}'
    ) from None
  return _keystrs(traced)


def _match_tree(mox: Mox, given) -> tuple[list, list[str]]:
  """Leaves of ``given`` in the traced order, when its leaf paths are the
  traced ones (containers of another type); else ``SignatureError`` naming
  the first path that differs."""
  expected = _tree_paths(mox.in_tree, given)
  flat = jax.tree_util.tree_flatten_with_path(given)[0]
  found = [_argument_position(jax.tree_util.keystr(p)) for p, _ in flat]
  by_path = dict(zip(found, (x for _, x in flat), strict=True))
  if len(by_path) == len(found) and set(found) == set(expected):
    traced = jax.tree_util.tree_unflatten(
        mox.in_tree, range(mox.in_tree.num_leaves))
    if (jax.tree_util.tree_structure(_plain_mappings(traced))
        == jax.tree_util.tree_structure(_plain_mappings(given))):
      return [by_path[p] for p in expected], expected
    raise SignatureError(
        'eval_mox: the argument tree differs from the traced one in its '
        'static structure (the leaves are the same).\n'
        f'  expected: {safe_repr(mox.in_tree, 600)}\n'
        f'  given:    {safe_repr(jax.tree_util.tree_structure(given), 600)}')
  raise SignatureError(
      'eval_mox: the argument tree differs from the traced one at '
      + _first_difference(mox, expected, found, by_path) +
      '\nPass arguments with the same structure as when the function was '
      'traced (same positional/keyword arguments, same dict keys).')


def _plain_mappings(tree):
  """``tree`` with every Mapping that is not a dict (a ``FrozenDict``) made a
  dict: containers that differ only so are accepted."""
  def is_other_mapping(x):
    return isinstance(x, collections.abc.Mapping) and not isinstance(x, dict)
  return jax.tree_util.tree_map(
      lambda x: {k: _plain_mappings(v) for k, v in x.items()}
      if is_other_mapping(x) else x, tree, is_leaf=is_other_mapping)


def _first_difference(mox: Mox, expected, found, by_path) -> str:
  types = dict(zip(expected, (s.type_str for s in mox.inputs),
                   strict=True))
  missing, unexpected = set(expected) - set(found), set(found) - set(expected)
  for i in range(max(len(expected), len(found))):
    e = expected[i] if i < len(expected) else None
    g = found[i] if i < len(found) else None
    if e in missing:
      inside = [p for p in found if _extends(p, e)]
      if inside:
        return (f'{e}: expected {types[e]}, given a container (holding '
                f'{inside[0]})')
      return f'{e}: missing\n  expected: {types[e]}\n  given:    nothing'
    if g in unexpected:
      inside = [p for p in expected if _extends(p, g)]
      if inside:
        return (f'{g}: expected a container (holding {inside[0]}), given '
                f'{_given_type(by_path[g])}')
      return (f'{g}: unexpected\n  expected: nothing\n  given:    '
              f'{_given_type(by_path[g])}')
  return 'a repeated path'  # only custom pytrees give two leaves one path


def _extends(path: str, prefix: str) -> bool:
  return path.startswith(prefix) and path[len(prefix):len(prefix) + 1] in '[.'


def _argument_position(keystr: str) -> str:
  """``[0][1]['params']`` -> ``args[1]['params']``; ``[1]['x']`` -> ``x=``."""
  if keystr.startswith('[0]'):
    rest = keystr[3:]
    return f'args{rest}' if rest else 'args'
  if keystr.startswith('[1]'):
    return f'kwargs{keystr[3:]}'
  return keystr


def eval_mox(mox: Mox, /, *args, **kwargs):
  """Evaluates a module expression on new arguments.

  **Arguments:**
  - ``mox``: a tree returned by ``make_mox`` (or a rewrite of one);
    positional-only, so the traced function may take a keyword ``mox``.
  - ``*args, **kwargs``: arguments with the structure, shapes and dtypes of
    the traced call (``mox.in_tree``); static values must be equal.
    Containers may be of another Mapping/sequence type with the same keys
    (a ``FrozenDict`` where a dict was traced). Concrete values or tracers:
    an abstract ``jax.ShapeDtypeStruct`` is refused (wrap the call in
    ``jax.eval_shape`` for shapes).

  **Returns:** the same pytree that the traced function returns.

  Works eagerly and under ``jax.jit``, ``vmap``, ``grad`` and ``lax.scan``.
  Raises ``yax.SignatureError`` when the arguments do not match, naming the
  first argument path that differs
  (``args[0]['params']['Dense_1']['bias']: missing``).
  """
  if not isinstance(mox, Mox):
    raise SignatureError(f'eval_mox expects a Mox as first argument, found '
                         f'{type(mox).__name__}')
  leaves = check_arguments(mox, args, kwargs)
  outs = Interpreter().run(mox, mox.consts, leaves)
  if mox.out_tree is None:
    return outs
  result = jax.tree_util.tree_unflatten(mox.out_tree, outs)
  return _systems.apply_updates(result, args, kwargs)  # NNX state updates
