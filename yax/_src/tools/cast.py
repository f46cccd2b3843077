"""``yax.cast``: selected module calls compute in another dtype.

Flax computes in the dtype that promotion gives a module's inputs and
parameters, and a lower compute dtype exists only where a model's author
plumbed ``dtype=`` through. ``cast`` chooses it per module call, on a model
someone else wrote: each selected Linen module call is rebuilt from the
fields the trace recorded, with its ``dtype`` field (where it has one) set
to the compute dtype, and traced again on its floating inputs and variables
cast to that dtype at the call's boundary. The body therefore rounds as the
same module built with ``dtype=compute`` would, and what the module's code
casts explicitly (an upcast before a softmax or a norm) keeps its dtype. A
call that cannot be rebuilt (an NNX module) has its traced body run again
on the cast inputs and variables instead, float operands that now differ
in dtype (a float32 constant next to a bfloat16 value) taken as ``jnp``
promotion would.
The call's outputs are cast back to their traced dtypes (what the rest of
the tree reads); stored params do not change, and the call keeps its type,
path and variables, so selections written for the float tree still work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import tree_util as jtu
from jax.extend import core as jex

from yax._src.errors import EvaluationError, SubstitutionError
from yax._src.ir import lower as _lower
from yax._src.ir.nodes import Equation, Literal, Mox, Var, iter_nodes
from yax._src.rewrite.engine import (defined_in, describe, inline,
                                     leave_out_hint, non_literals,
                                     read_outside, read_symbols,
                                     reads_from_enclosing, select, substitute)
from yax._src.trace import eval as _eval
from yax._src.trace import systems as _systems
from yax._src.trace.make import make_mox


def _float_dtype(value, what: str):
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise SubstitutionError(
        f'cast: {what} must be a floating dtype (bfloat16, float16, '
        f'float32 ...), found {value!r}')
  return dtype


class _Refused(Exception):
  """Why one selected call cannot be cast (collected, then raised once)."""


def _is_float(x) -> bool:
  dtype = getattr(x, 'dtype', None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _rebuilt(node: Mox, dtype):
  cls = node.rebuild_ty
  if not _systems.is_rebuilt_module(cls):
    raise _Refused(f'internal: {node.type_name} is not a Linen module')
  try:
    module, changed = _systems.rebuilt_module(cls, node.params, dtype=dtype)
  except Exception as e:  # noqa: BLE001 - reported with the module's name
    raise _Refused(f'rebuilding {cls.__name__} from its recorded fields '
                   f'raised {type(e).__name__}: {e}') from None
  return module, 'dtype' in changed


def _prefixed(expr, prefix: tuple):
  """``expr`` with every module call's path under ``prefix``."""
  children = [_prefixed(c, prefix) for c in expr.children]
  if isinstance(expr, Mox) and not expr.is_ephemeral:
    return expr.replace(path=(*prefix, *expr.path), children=children)
  return expr.replace(children=children)


def _out_dtypes(node: Mox, output) -> list:
  """The dtype each output of the new call returns: ``output`` for a
  floating one where given, else its traced dtype."""
  return [None if s.aval is None else output
          if output is not None and _is_float(s.aval) else s.aval.dtype
          for s in node.outputs]


# Contractions whose ``preferred_element_type`` ``jnp`` sets to their
# operands' dtype where the code asks for none: ``w @ x`` traced in float32
# records float32, the same code run in bfloat16 records bfloat16.
_ACCUMULATING = ('dot_general', 'conv_general_dilated', 'ragged_dot_general')


def _accumulation(eqn: Equation, floats: list, dtype) -> dict:
  """``eqn``'s params for float operands now at ``dtype``: a
  ``preferred_element_type`` that was the traced operands' own dtype (the
  default) becomes ``dtype``, as the module's code run at ``dtype`` would
  record; one the code chose (float32 on bfloat16 operands) stays."""
  preferred = eqn.params.get('preferred_element_type')
  if eqn.prim.name not in _ACCUMULATING or preferred is None:
    return eqn.params
  traced = {jnp.dtype(s.aval.dtype) for _, s in floats}
  if traced != {jnp.dtype(preferred)} or jnp.dtype(preferred) == dtype:
    return eqn.params
  return {**eqn.params, 'preferred_element_type': dtype}


class _Promoting(_eval.Interpreter):
  """Runs a traced body on inputs of other float dtypes: an equation whose
  float operands now differ in dtype (a constant traced in float32 next to
  a bfloat16 value) gets them as ``jnp`` promotion would, constants taking
  the dtype of the values beside them (weakly typed, as Python scalars
  are). A contraction that accumulated in its operands' traced dtype
  accumulates in their new one. An equation with a body of its own that
  calls no module (a ``shard_map``, a ``jit``) gets them at the dtypes its
  body was traced for, and computes as traced."""

  def run_equation(self, eqn: Equation) -> None:
    floats = [(i, s) for i, s in enumerate(eqn.inputs)
              if s.aval is not None and jnp.issubdtype(s.aval.dtype,
                                                       jnp.floating)]
    if eqn.children or not floats:
      return super().run_equation(eqn)
    values = {i: (s.value if isinstance(s, Literal) else self.read(s))
              for i, s in floats}
    if any(isinstance(p, (jex.Jaxpr, jex.ClosedJaxpr))
           for p in eqn.params.values()):
      if all(jnp.dtype(values[i].dtype) == jnp.dtype(s.aval.dtype)
             for i, s in floats):
        return super().run_equation(eqn)
      target = 'the dtypes its body was traced for'
      args = [values[i].astype(s.aval.dtype) if i in values else self.read(s)
              for i, s in enumerate(eqn.inputs)
              if not isinstance(s, Literal)]
      run = lambda: jax.core.eval_jaxpr(_lower.one_equation_jaxpr(eqn), [],
                                        *args)
    else:
      if len(floats) < 2:
        return super().run_equation(eqn)
      computed = [values[i] for i, s in floats if not isinstance(s, Literal)]
      dtype = (jnp.result_type(*computed) if computed
               else jnp.dtype(values[floats[0][0]].dtype))
      params = _accumulation(eqn, floats, dtype)
      if (len({jnp.dtype(v.dtype) for v in values.values()}) < 2
          and params is eqn.params):
        return super().run_equation(eqn)
      target = dtype.name
      args = [self.read(s) for s in eqn.inputs]
      for i, _ in floats:
        args[i] = jnp.asarray(values[i]).astype(dtype)

      def run():
        outs = eqn.prim.bind(*args, **params)
        return outs if eqn.prim.multiple_results else [outs]
    try:
      outs = run()
    except Exception as e:  # noqa: BLE001 - re-raised with where it happened
      raise EvaluationError(
          f'{describe(eqn)} of {describe(self.modules[-1])} at {target} '
          f'failed: {type(e).__name__}: {e}') from e
    for sym, value in zip(eqn.outputs, outs, strict=True):
      self.write(sym, value)


def _replayed(node: Mox, dtype, output=None, read_elsewhere=frozenset(),
              why: str | None = None) -> Mox:
  """A replacement for a call that cannot be rebuilt (an NNX module): its
  traced body run again on inputs and variables cast to ``dtype``, every
  equation at the dtype promotion gives it, a contraction accumulating at
  it where it accumulated at its operands' traced dtype (an explicit cast
  in the body, an accumulation type the code chose, keep theirs); outputs
  cast back. ``why``: why a Linen module was
  not traced again instead, kept as the new call's ``cast_replayed``.

  What the body reads from the enclosing body (a constant, a PRNG key)
  and the values it computes that the tree reads elsewhere
  (``read_elsewhere``: state the call updates) keep their symbols, so the
  replacement reads and defines them where the call did."""
  outside = reads_from_enclosing(node)
  shown = set(node.outputs)
  escaping = [s for s in defined_in(node)
              if s in read_elsewhere and s not in shown]
  full = node.replace(inputs=[*node.inputs, *outside],
                      outputs=[*node.outputs, *escaping])
  spec = lambda s: jax.ShapeDtypeStruct(s.aval.shape, s.aval.dtype)
  values = [s.value if isinstance(s, Literal) else spec(s)
            for s in full.inputs]
  traced_out = _out_dtypes(node, output) + [s.aval.dtype for s in escaping]

  def run(values):
    low = [v.astype(dtype) if _is_float(v) else v for v in values]
    outs = _Promoting().run(full, [], low)
    return [o.astype(t) if _is_float(o) and t else o
            for o, t in zip(outs, traced_out, strict=True)]

  try:
    root = make_mox(run)(values)
  except Exception as e:  # noqa: BLE001 - reported with the module's name
    raise _Refused(f'running its body again at {dtype.name} raised '
                   f'{_first_line(e)}') from None
  # The copy reads the enclosing values and defines the escaping ones as
  # the same symbols as the call did.
  n_in, n_out = len(root.inputs) - len(outside), len(node.outputs)
  own_in = root.inputs[:n_in]
  own_out = [Var(s.aval) if not isinstance(s, Literal) else s
             for s in root.outputs[:n_out]]
  if outside or escaping:
    children = inline(root, [*non_literals(own_in), *outside],
                      [*own_out, *escaping])
  else:
    children, own_out = root.children, root.outputs
  params = {**node.params, 'compute_dtype': dtype.name}
  if why is not None:
    params['cast_replayed'] = why
  if 'dtype' in params:
    params['dtype'] = dtype
  call = Mox(own_in, own_out, params,
             children=[_prefixed(c, node.path) for c in children],
             module_ty=node.module_ty, rewritten=node.rewritten,
             entrypoint=node.entrypoint,
             path=node.path, in_tree=node.in_tree, out_tree=node.out_tree,
             var_tree=node.var_tree)
  return Mox(own_in, own_out, {}, children=[call],
             constvars=root.constvars, consts=root.consts)


def _first_line(e: BaseException) -> str:
  """``Type: first line of the message`` (or just the type when the
  exception has no message, as a bare ``assert``)."""
  lines = str(e).splitlines()
  return f'{type(e).__name__}: {lines[0][:200]}' if lines else \
      type(e).__name__


def _recast(node: Mox, dtype, output, read_elsewhere=frozenset()) -> Mox:
  """A replacement for ``node``: the module traced again at ``dtype``.
  ``read_elsewhere``: the symbols the tree reads outside ``node``."""
  lean = [n for n in iter_nodes(node)
          if isinstance(n, Mox) and n.params.get('lean') == 'norm']
  if lean:
    # Its body is a custom_vjp at the traced dtype, not its class's code:
    # neither re-tracing the class nor replaying the body keeps it lean.
    raise _Refused(
        f'it holds the lean_norm call(s) at '
        f'{", ".join(repr("/".join(n.path)) for n in lean)} (lean="norm"), '
        'which cast cannot run at another dtype; cast the plain tree first '
        '(leaving its norms as they compute), then apply lean_norm')
  cls = node.rebuild_ty
  shown = set(node.outputs)
  updates_state = any(s in read_elsewhere and s not in shown
                      for s in defined_in(node))
  if not _systems.is_rebuilt_module(cls) or updates_state:
    # An NNX module; or a call that updates state the tree reads (a
    # BatchNorm's statistics under ``mutable``), which an ``apply`` of
    # the rebuilt module would not give back: its body is run again.
    return _replayed(node, dtype, output, read_elsewhere)
  module, has_dtype = _rebuilt(node, dtype)
  method = getattr(type(module), node.entrypoint or '__call__', None)
  if not callable(method):
    raise _Refused(f'its class has no method {node.entrypoint!r}')
  spec = lambda s: jax.ShapeDtypeStruct(s.aval.shape, s.aval.dtype)
  variables = (jtu.tree_unflatten(node.var_tree,
                                  [spec(s) for s in node.var_inputs])
               if node.num_vars else {})
  # Only the traced arguments are arguments of the new trace: a Python
  # number or a NumPy array the call received stays the value it was (as
  # under plain Flax), closed over, not a new input of the tree.
  dyn_args = [spec(s) for s in node.arg_inputs if not isinstance(s, Literal)]
  traced_out = _out_dtypes(node, output)

  def low(x):
    return x.astype(dtype) if _is_float(x) else x

  def run(variables, dyn_args):
    given = iter(dyn_args)
    leaves = [s.value if isinstance(s, Literal) else next(given)
              for s in node.arg_inputs]
    args, kwargs = jtu.tree_unflatten(node.in_tree, leaves)
    out = _systems.apply_module(
        module, jtu.tree_map(low, variables), node.entrypoint or '__call__',
        *[low(a) if not _is_host(a) else a for a in args],
        **{k: low(v) if not _is_host(v) else v for k, v in kwargs.items()})
    out_leaves, tree = jtu.tree_flatten(out)
    back = [x.astype(traced) if _is_float(x) and traced else x
            for x, traced in zip(out_leaves, traced_out, strict=True)]
    return jtu.tree_unflatten(tree, back)

  try:
    root = make_mox(run)(variables, dyn_args)
  except Exception as e:  # noqa: BLE001 - named case below, else refused
    # Named case: the module, rebuilt and applied at the call's shapes,
    # cannot be traced; a call traced under a batching transform (nn.vmap)
    # holds its variables and inputs stacked, which the module's own code
    # does not take. Its traced (batched) body is run again instead, and
    # the new call says so (``cast_replayed``: why it was not re-traced).
    retraced = (f'tracing it again at {dtype.name} raised '
                f'{_first_line(e)}')
    try:
      return _replayed(node, dtype, output, read_elsewhere, why=retraced)
    except _Refused as again:
      raise _Refused(f'{retraced}, and {again}') from None
  n_dyn = node.num_vars + len(dyn_args)
  if len(root.inputs) != n_dyn or len(root.outputs) != len(node.outputs):
    raise _Refused(
        f'traced again at {dtype.name} it takes {len(root.inputs)} inputs and '
        f'returns {len(root.outputs)} values, where the traced call had '
        f'{n_dyn} traced inputs and {len(node.outputs)} outputs')
  # The call's inputs as the node has them: its static arguments in place.
  given = iter(root.inputs[node.num_vars:])
  call_inputs = root.inputs[:node.num_vars] + [
      s if isinstance(s, Literal) else next(given) for s in node.arg_inputs]
  children = []
  for child in root.children:  # the apply's own module call is dissolved
    if isinstance(child, Mox) and not child.is_ephemeral and not child.path:
      children.extend(_prefixed(c, node.path) for c in child.children)
    else:
      children.append(_prefixed(child, node.path))
  params = dict(node.params)
  if has_dtype:
    params['dtype'] = dtype
  params['compute_dtype'] = dtype.name
  call = Mox(call_inputs, root.outputs, params, children=children,
             module_ty=node.module_ty, rewritten=node.rewritten,
             entrypoint=node.entrypoint,
             path=node.path, in_tree=node.in_tree, out_tree=node.out_tree,
             var_tree=node.var_tree)
  return Mox(root.inputs, root.outputs, {}, children=[call],
             in_tree=root.in_tree, out_tree=root.out_tree,
             constvars=root.constvars, consts=root.consts)


def _is_host(x) -> bool:
  """A value a module call receives as it is (a NumPy array or scalar, a
  Python number): it keeps its dtype, as under plain Flax."""
  return not isinstance(x, (jax.Array, jax.ShapeDtypeStruct,
                            jax.core.Tracer))


def cast(mox: Mox, selection, compute='bfloat16', *, output=None) -> Mox:
  """Returns a tree where each selected module call computes in ``compute``.

  **Arguments:**
  - ``mox``: the traced tree (left unchanged).
  - ``selection``: XPath (or node list) of module calls (Linen or NNX), e.g.
    ``'//module_call[@type="Dense"]'``.
  - ``compute``: the floating dtype the selected calls compute in.
  - ``output``: the dtype of their floating outputs (default: cast back to
    the traced dtypes, which the rest of the tree reads). Another dtype is
    for outputs nothing in the tree reads (the model's own outputs, from
    its last module); for an output read further on it raises
    ``SubstitutionError``.

  **Returns:** the new tree. Its params are the original ones (stored in
  their own dtype). Each cast call keeps its type, path and variables; its
  ``dtype`` field (where the class has one) and ``compute_dtype`` say what
  it computes in. Raises ``yax.SubstitutionError`` (changing nothing)
  listing every selected call it cannot cast.

  Example::

      low = yax.cast(mox, '//module_call[@type="Dense"]', 'bfloat16')
      y = yax.eval_mox(low, variables, x)   # LayerNorm, softmax stay float32
  """
  if not isinstance(mox, Mox):
    raise SubstitutionError(f'cast expects a Mox, found {type(mox).__name__}')
  dtype = _float_dtype(compute, 'compute')
  chosen = select(selection, mox)
  templates, problems = {}, []
  if output is not None:
    output = _float_dtype(output, 'output')
    problems = _output_read(mox, chosen, output)
  for node in chosen.targets:
    if isinstance(node, Equation) or node.is_ephemeral:
      raise SubstitutionError(
          f'cast selects module calls, but {chosen.description} matched '
          f'{describe(node)}')
    if any(node is n for n, _ in problems):
      continue
    try:
      templates[id(node)] = _recast(node, dtype, output,
                                    read_outside(mox, node))
    except _Refused as why:
      problems.append((node, str(why)))
  if problems:
    raise SubstitutionError(
        f'cast cannot make {len(problems)} of the {len(chosen.targets)} '
        f'module calls selected by {chosen.description} compute in '
        f'{dtype.name}:\n' + '\n'.join(
            f'  - {describe(n)}: {why}' for n, why in problems) + '\n' +
        leave_out_hint([(n, False) for n, _ in problems], selection,
                       chosen.targets))
  return substitute(chosen, lambda path, node: templates[id(node)], mox,
                    retype=output is not None).mox


def _output_read(mox: Mox, chosen, output) -> list:
  """``(call, why)`` for each selected call whose floating output of
  another dtype than ``output`` is read further on (or inside a lifted
  transform's body), where its type cannot change."""
  read = read_symbols(mox)
  problems = []
  for node in chosen.targets:
    if not isinstance(node, Mox):
      continue
    changed = [s for s in node.outputs if s.aval is not None and
               _is_float(s.aval) and s.aval.dtype != output]
    ancestors = chosen.ancestors[id(node)]
    if any(not _only_returned(s, ancestors, read) for s in changed):
      problems.append((node, (
          f'output={output.name}: its output {changed[0].type_str} is read '
          'further on in the tree, traced to read that dtype (only outputs '
          "nothing reads, the model's own, may change dtype; leave output= "
          'out to cast them back)')))
  return problems


# Equations whose one body's outputs are their outputs, in order, run once:
# a body output that nothing reads leaves as the equation's output, which
# may then change dtype as the body's does (the engine retypes it).
_PASSING = ('jit', 'pjit', 'closed_call', 'core_call', 'checkpoint', 'remat2')


def _only_returned(sym, ancestors: list, read: set) -> bool:
  """Whether nothing in the tree reads ``sym`` (an output of a call under
  ``ancestors``, outermost first): followed out of every body it is
  returned from (an ``nn.jit``/``nnx.jit`` body: the equation's output at
  the same position), it is never an input of an equation or call. A body
  that is not run once as it is (a scan's carry, a loop, a vmap) refuses."""
  k = len(ancestors) - 1
  while k >= 0:
    if sym in read:
      return False
    scope = ancestors[k]
    outer = ancestors[k - 1] if k > 0 else None
    if isinstance(outer, Equation):  # scope is one of its bodies
      if sym not in scope.outputs:
        return True  # dropped by the body: nothing reads it
      if outer.prim.name not in _PASSING or len(outer.children) != 1 or \
          len(scope.outputs) != len(outer.outputs):
        return False
      sym = outer.outputs[list(scope.outputs).index(sym)]
      k -= 2
    else:
      k -= 1
  return sym not in read
