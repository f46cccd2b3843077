"""A module expression as a ``jax.export.Exported``: StableHLO that runs
without YAX, each op located at its module path.

``export(mox, *args)`` evaluates the tree under ``jax.jit`` and exports it
with :func:`jax.export.export`. While it evaluates, every module call runs
inside a :func:`jax.named_scope` named after its path relative to the
enclosing call, so the name stack JAX puts into each op's location reads
``jit(model)/encoder/layer/0/attention/self/query/dot_general``. Google
Model Explorer's built-in MLIR adapter (``.mlir`` text or ``.mlirbc``
bytecode) nests its graph by these names, so it shows the module hierarchy.
"""

from __future__ import annotations

import contextlib

import jax
from jax import export as jex

from yax._src import compat as _compat
from yax._src.errors import SignatureError
from yax._src.ir.nodes import Equation, Literal, Mox
from yax._src.trace import systems as _systems
from yax._src.trace.eval import Interpreter, check_arguments


class _Scoped(Interpreter):
  """The evaluation interpreter, each module call inside a named scope
  (its path below the innermost enclosing call's path); the scopes an
  equation recorded when it was traced (Flax's own) are dropped, so a
  location is the module path in this tree."""

  def __init__(self):
    super().__init__()
    self._active: list[tuple] = [()]

  def run_module(self, mox: Mox) -> None:
    if mox.is_ephemeral:
      return super().run_module(mox)
    outer = self._active[-1]
    path = tuple(map(str, mox.path))
    rel = path[len(outer):] if path[:len(outer)] == outer else path
    scope = (jax.named_scope('/'.join(rel)) if rel
             else contextlib.nullcontext())
    self._active.append(path)
    try:
      with scope:
        super().run_module(mox)
    finally:
      self._active.pop()

  def run_equation(self, eqn: Equation) -> None:
    super().run_equation(eqn.replace(
        source_info=_compat.without_name_stack(eqn.source_info)))


def _traced_specs(mox: Mox):
  """``(args, kwargs)`` as the trace saw them: a ``ShapeDtypeStruct`` per
  array input (symbolic dimensions kept), the static values as traced."""
  if mox.in_tree is None:
    raise SignatureError(
        'yax.export: this tree has no argument structure (in_tree); pass '
        'the arguments to export it with')
  leaves = [s.value if isinstance(s, Literal) and s.is_static
            else jax.ShapeDtypeStruct(s.aval.shape, s.aval.dtype)
            for s in mox.inputs]
  return jax.tree_util.tree_unflatten(mox.in_tree, leaves)


def export(mox: Mox, /, *args, platforms=None, **kwargs) -> jex.Exported:
  """Exports a (rewritten) tree with :func:`jax.export.export`.

  **Arguments:**
  - ``mox``: a tree from ``make_mox`` or a rewrite (left unchanged).
  - ``*args, **kwargs``: the arguments to export for, as ``eval_mox`` takes
    them: arrays or ``jax.ShapeDtypeStruct`` (shapes may hold symbolic
    dimensions from ``jax.export.symbolic_shape`` where the tree was traced
    with them). With none, the shapes the tree was traced at.
  - ``platforms``: passed to ``jax.export.export`` (default: the backend
    in use).

  **Returns:** a ``jax.export.Exported``; ``.serialize()`` gives bytes that
  ``jax.export.deserialize`` reloads and ``.call`` runs in a process that
  does not import YAX. It takes the array arguments with the structure
  given here; every other leaf (a static ``bool`` or string, a Python
  number) is baked in and given as ``None`` to ``.call``. Each op's location names its module path
  (``.mlir_module()`` shows ``loc("jit(model)/encoder/layer/0/...")``),
  which Model Explorer reads as the hierarchy.

  Raises ``yax.SignatureError`` when the arguments do not match the trace.

  Example::

      exp = yax.export(merged_mox, params, x)
      blob = exp.serialize()            # bytes
      y = jax.export.deserialize(blob).call(params, x)
  """
  if not isinstance(mox, Mox):
    raise SignatureError(f'yax.export expects a Mox as first argument, found '
                         f'{type(mox).__name__}')
  if not args and not kwargs:
    args, kwargs = _traced_specs(mox)
  is_none = lambda x: x is None
  flat, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_none)
  dynamic = [_is_array(x) for x in flat]
  specs = [(x if isinstance(x, jax.ShapeDtypeStruct)
            else jax.ShapeDtypeStruct(x.shape, x.dtype)) if d else None
           for x, d in zip(flat, dynamic, strict=True)]
  spec_args, spec_kwargs = jax.tree_util.tree_unflatten(tree, specs)

  def model(*args, **kwargs):  # its argument names show in the locations
    given = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_none)[0]
    leaves = [g if d else x
              for g, x, d in zip(given, flat, dynamic, strict=True)]
    args, kwargs = jax.tree_util.tree_unflatten(tree, leaves)
    inputs = check_arguments(mox, args, kwargs)
    outs = _Scoped().run(mox, mox.consts, inputs)
    if mox.out_tree is None:
      return outs
    result = jax.tree_util.tree_unflatten(mox.out_tree, outs)
    return _systems.apply_updates(result, args, kwargs)

  kw = {} if platforms is None else {'platforms': platforms}
  return jex.export(jax.jit(model), **kw)(*spec_args, **spec_kwargs)


def _is_array(x) -> bool:
  """An argument the export takes as an input (not baked in)."""
  if isinstance(x, (jax.ShapeDtypeStruct, jax.Array)):
    return True
  return (hasattr(x, 'shape') and hasattr(x, 'dtype')
          and not isinstance(x, (bool, int, float, complex, str)))
