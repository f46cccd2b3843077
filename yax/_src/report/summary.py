"""A module summary of a MoX: one row per module call, like ``nn.tabulate``.

Everything is computed from the tree itself, without running the model:

* **inputs / outputs** carry names: arguments are bound to the parameters of
  the module method (``inspect.signature`` of ``module_ty.<entrypoint>``),
  arrays show as ``x: f32[2,8]``, static Python values as
  ``deterministic=True``; dict and dataclass outputs show their keys or
  fields (``last_hidden_state: f32[1,8,32]``).
* **variables**: the module's *own* variables (not its submodules') with
  their types, ``kernel: f32[64,64]``; collections other than ``params`` are
  prefixed (``batch_stats/mean: f32[3]``).
* **params**: total (every ``params`` leaf the call reads, its submodules'
  and those of modules it reaches through its arguments included: see
  :class:`ParamReads`) and own (those no row below it reads: the module's
  own, and a never-called submodule's that it reads straight from it), so
  each parameter is the own parameter of one row. A Linen param whose
  value is a dict counts as the module's own (shown ``p/a: f32[3]``).
  Params of the traced arguments that no call reads (a tied head's own
  kernel) are the own params of the row of the module owning them, marked
  ``(unread)``: see :func:`unread_params`.
* **FLOPs**: every equation of the call (submodules included), by the rule
  table of :mod:`yax._src.report.flops`: matmuls, convolutions and element-wise work.
* A call of another method of the *same* module instance from inside one of
  its methods (a helper such as ``_split_heads``) is folded into the calling
  row: no row of its own; its work is already counted in the caller's.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
import shutil
import sys
from typing import Iterator

import jax
import numpy as np
from jax.extend import core as jex

from yax._src.errors import YaxError
from yax._src.ir import lower as _lower
from yax._src.ir import rules as _rules
from yax._src.ir.lower import dynamic, to_jaxpr
from yax._src.ir.nodes import (Equation, Expr, Literal, Mox, Symbol,
                               leaf_equations)
from yax._src.ir.variables import placeholder_parts, var_entries
from yax._src.report import flops as _flops

PARAMS = 'params'


# --------------------------------------------------------------- FLOPs

def flops(expr: Expr) -> int:
  """FLOPs of a node and everything under it (:mod:`yax._src.report.flops` rules)."""
  eqns = [expr] if isinstance(expr, Equation) else leaf_equations(expr)
  return sum(
      _flops.equation_flops(e.prim.name, [s.aval for s in e.inputs],
                            [s.aval for s in e.outputs],
                            _lower.equation_params(e))  # bodies included
      for e in eqns)


def xla_cost(mox: Mox) -> dict[str, float] | None:
  """XLA's cost analysis of the whole tree (compiles it once): a dict with
  ``flops`` and ``transcendentals``; ``None`` when the backend gives none."""
  closed = to_jaxpr(mox)
  specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
           for v in closed.jaxpr.invars]
  compiled = jax.jit(jex.jaxpr_as_fun(closed)).lower(*specs).compile()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost or 'flops' not in cost:
    return None
  return {'flops': float(cost['flops']),
          'transcendentals': float(cost.get('transcendentals', 0.0))}


def xla_flops(mox: Mox) -> float | None:
  """``flops + transcendentals`` of :func:`xla_cost` (the convention of
  :func:`flops`, which counts a transcendental as one FLOP)."""
  cost = xla_cost(mox)
  return None if cost is None else cost['flops'] + cost['transcendentals']


# ----------------------------------------------------------- variables

def _var_tree(mox: Mox):
  if not isinstance(mox, Mox) or mox.num_vars == 0:
    return None
  try:
    tree = jax.tree_util.tree_unflatten(mox.var_tree, mox.var_inputs)
  except Exception as e:  # noqa: BLE001 - re-raised as a YaxError
    # A container whose own unflatten checks its leaves (it does not take
    # the tree's symbols): the collections are unknown, so every count
    # would be a guess.
    where = '/'.join(mox.path) or '<root>'
    raise YaxError(
        f'the summary groups the variables of the {mox.type_name} call at '
        f"'{where}' by collection, but rebuilding its variable tree "
        f'{mox.var_tree} from its {mox.num_vars} variable inputs raised '
        f'{type(e).__name__}: {e}') from e
  # Not a mapping of collections (no collection names): one group, named
  # 'variables' (see ``variable_groups``).
  return tree if isinstance(tree, dict) or hasattr(tree, 'items') else None


def variable_groups(mox: Mox) -> dict[str, list[Symbol]]:
  """The module call's variable inputs grouped by collection name."""
  if not isinstance(mox, Mox) or mox.num_vars == 0:
    return {}
  from yax._src.trace import systems as _systems
  typed = _systems.typed_variable_groups(mox)  # NNX, Equinox: by kind
  if typed is not None:
    return typed
  tree = _var_tree(mox)
  if tree is None:
    return {'variables': list(mox.var_inputs)}
  groups = {}
  for collection, sub in tree.items():
    leaves = [s for s in jax.tree_util.tree_leaves(sub) if isinstance(s, Symbol)]
    if leaves:
      groups[str(collection)] = leaves
  return groups


def own_variables(mox: Mox) -> dict[str, dict[str, Symbol]]:
  """``{collection: {name: symbol}}`` of the module's own variables: the
  leaves directly under each collection, and the leaves of a variable whose
  value is a dict (``'p/a'``); sub-dicts where a module call inside sits
  are its submodules'."""
  from yax._src.trace import systems as _systems
  typed = (_systems.typed_own_variables(mox) if isinstance(mox, Mox)
           else None)
  if typed is not None:  # NNX, Equinox: by kind, as nnx.state shows them
    return typed
  if not isinstance(mox, Mox) or mox.num_vars == 0:
    return {}
  n = len(mox.path)
  inner = {tuple(c.path[n:n + 1]) for c in module_calls(mox)
           if c is not mox and tuple(c.path[:n]) == tuple(mox.path)}
  out: dict[str, dict[str, Symbol]] = {}
  for entry in var_entries(mox):
    if len(entry.rel_path) > 1 and entry.rel_path[:1] in inner:
      continue  # a submodule's
    out.setdefault(entry.group, {})['/'.join(entry.rel_path)] = entry.symbol
  return out


def count(symbols) -> tuple[int, int]:
  """(number of scalars, bytes) of the given symbols."""
  n = nbytes = 0
  for s in symbols:
    size = int(math.prod(getattr(s.aval, 'shape', ()) or ())) \
        if getattr(s.aval, 'shape', None) is not None else 0
    n += size
    dtype = getattr(s.aval, 'dtype', None)
    if dtype is not None:
      try:
        nbytes += size * np.dtype(dtype).itemsize
      except TypeError:  # an extended dtype (PRNG keys)
        nbytes += size * getattr(dtype, 'itemsize', 0)
  return n, nbytes


def param_count(mox: Mox) -> int:
  """Total ``params`` of a module call, its submodules' included."""
  return count(variable_groups(mox).get(PARAMS, ()))[0]


def total_params(mox: Mox) -> tuple[int, int]:
  """(count, bytes) of the ``params`` read by the outermost module calls
  (see :class:`ParamReads`), each variable once (a module called twice
  shares them), and of those in the traced arguments that no call reads
  (:func:`unread_params`). A tree without module calls has none."""
  reads = ParamReads(mox)
  seen: dict[int, Symbol] = {}
  for node in outermost_calls(mox):
    seen.update(reads.of(node))
  if seen:
    seen.update((id(s), s) for s in unread_params(mox, reads))
  return count(seen.values())


def unread_params(mox: Mox, reads: ParamReads | None = None
                  ) -> dict[Symbol, tuple[str, ...]]:
  """The ``params`` of the traced arguments of the root ``mox`` that no
  module call reads, with their paths (module path, then name:
  ``('lm_head', 'kernel')``).

  A model may hold parameters its forward never reads: a head tied to
  the embedding that still owns a kernel, a submodule called only in
  another mode. They are no input of any call (a call's inputs are what
  its body reads), yet they are the model's: the summary shows them in
  the row of the module that owns them. Empty for a node that is not a
  root (its arguments are not the model's)."""
  if not isinstance(mox, Mox) or mox.num_vars or mox.in_tree is None:
    return {}
  from yax._src.rewrite import engine as _engine
  from yax._src.trace import systems as _systems
  reads = reads if reads is not None else ParamReads(mox)
  read: dict[int, Symbol] = {}
  for node in outermost_calls(mox):
    read.update(reads.of(node))
  if mox.in_tree.num_leaves != len(mox.inputs):
    raise YaxError(
        f'summary: the root takes {len(mox.inputs)} inputs but its in_tree '
        f'has {mox.in_tree.num_leaves} leaves, so its params cannot be '
        'told apart from its other inputs; the tree was built '
        'inconsistently (yax.check_mox says where)')
  located = _engine.locate(mox)
  # The traced arguments with each leaf's index in place of its value (in
  # parts, where a pytree node of the user's refuses such placeholders).
  arguments = [sub for _, sub in placeholder_parts(mox.in_tree)]
  in_variables = _systems.param_leaves(arguments)
  linen = located.collections.get(PARAMS)
  prefixes = sorted(located.collections.values(), key=len, reverse=True)
  out = {}
  for i, sym in enumerate(mox.inputs):
    keypath = located.keypaths.get(sym)
    if id(sym) in read or keypath is None or isinstance(sym, Literal):
      continue
    if i in in_variables:  # an nnx.Param: under its model's prefix
      prefix = next((p for p in prefixes
                     if tuple(keypath[:len(p)]) == tuple(p)), ())
    elif linen is not None and tuple(keypath[:len(linen)]) == tuple(linen):
      prefix = linen
    else:
      continue  # not a parameter (an input, RNG state, a cache)
    out[sym] = tuple(str(k) for k in keypath[len(prefix):])
  return out


class ParamReads:
  """The ``params`` each module call reads: those it lists among its
  variable inputs, and those of every module call in its body.

  A module call lists what its body reads, but a call inside it can read
  variables it does not list: an NNX module passed as an argument to
  another module's method (MaxText's ``self.decoder(shared_embedding=
  self.token_embedder, ...)``) is called inside the caller, its variables
  reached through the argument, not the caller's own graph. Counting the
  calls inside puts them in the caller's total and the model's.

  A lifted transform's body (``nn.scan``, ``nn.jit``, ``nn.remat``) has
  symbols of its own: the calls inside read the body's inputs (a scan's
  one layer of a stacked kernel), the call around it the equation's. Each
  body input stands for the equation input it receives (see
  :func:`yax._src.ir.rules.body_input_sources`), and a value that only lays a
  param out anew (MaxText's ``nnx.scan`` moves the layer axis of its
  stacked kernels first with a ``transpose``) for that param, so every
  read is named by the root-scope param it is: a param read inside and
  outside a body is one param, and a scanned call counts the whole stack.
  """

  _NONE: dict = {}

  def __init__(self, root: Expr):
    self._memo: dict[int, dict[int, Symbol]] = {}
    self._source: dict[int, Symbol] = {}  # body input -> equation input
    self._layout: dict[int, Symbol] = {}  # re-laid-out value -> its operand
    stack = [root]
    while stack:
      node = stack.pop()
      if isinstance(node, Equation):
        operand = _laid_out(node)
        if operand is not None:
          self._layout[id(node.outputs[0])] = operand
        for i, body in enumerate(node.children):
          try:
            sources = _rules.body_input_sources(node, i)
          except YaxError:  # no rule for this primitive: its own symbols
            continue
          for inner, source in zip(body.inputs, sources, strict=True):
            self._source[id(inner)] = source
      stack.extend(node.children)

  def _root_symbol(self, s: Symbol) -> Symbol:
    while True:
      up = self._source.get(id(s)) or self._layout.get(id(s))
      if up is None:
        return s
      s = up

  def of(self, node: Expr) -> dict[int, Symbol]:
    """``{id: symbol}`` of the params read by ``node`` and the calls in it
    (in the order first read), as symbols of the root's scope. Do not
    change the dict returned."""
    got = self._memo.get(id(node))
    if got is not None:
      return got
    got = {}
    if isinstance(node, Mox):
      for s in variable_groups(node).get(PARAMS, ()):
        s = self._root_symbol(s)
        got[id(s)] = s
    for child in node.children:
      got.update(self.of(child))
    self._memo[id(node)] = got = got or self._NONE
    return got


# Primitives whose result holds its one array operand's values, laid out
# anew (or cast): the same parameter when the operand is one.
_LAYOUT = frozenset({'transpose', 'reshape', 'squeeze', 'expand_dims', 'copy',
                     'copy_p', 'sharding_constraint', 'convert_element_type'})


def _laid_out(eqn: Equation) -> Symbol | None:
  """The operand of a :data:`_LAYOUT` equation whose one output has as many
  values as its one array operand; else ``None``."""
  if eqn.prim.name not in _LAYOUT or len(eqn.outputs) != 1:
    return None
  operands = [s for s in eqn.inputs if not isinstance(s, Literal)]
  if len(operands) != 1:
    return None
  same = count(operands)[0] == count(eqn.outputs)[0]
  return operands[0] if same else None


def outermost_calls(mox: Expr) -> Iterator[Mox]:
  """Module calls with no module call above them (``mox`` itself if it is
  one)."""
  stack = [mox]
  while stack:
    node = stack.pop()
    if isinstance(node, Mox) and not node.is_ephemeral:
      yield node
      continue
    stack.extend(reversed(node.children))


def module_calls(mox: Expr) -> Iterator[Mox]:
  """Non-ephemeral module calls, pre-order (also inside scan/remat bodies)."""
  stack = [mox]
  while stack:
    node = stack.pop()
    if isinstance(node, Mox) and not node.is_ephemeral:
      yield node
    stack.extend(reversed(node.children))


# ------------------------------------------------------- names and types

_STATIC_LIMIT = 24


def type_text(sym: Symbol) -> str:
  """``f32[2,8]`` for arrays; the value for static Python inputs."""
  if isinstance(sym, Literal) and sym.is_static:
    text = repr(sym.value)
    return text if len(text) <= _STATIC_LIMIT else text[:_STATIC_LIMIT - 3] + '...'
  return sym.type_str


def _is_static(value) -> bool:
  return value is None or (isinstance(value, Literal) and value.is_static)


def _static_text(value) -> str:
  return 'None' if value is None else type_text(value)


_MAX_LEAVES = 6


def value_text(value) -> str:
  """A pytree of symbols as text: a type, ``{k: type, ...}``, ``(type, ...)``;
  more than a few arrays as ``N arrays (M values)``."""
  if isinstance(value, Symbol) or value is None:
    return _static_text(value) if _is_static(value) else value.type_str
  leaves = [s for s in jax.tree_util.tree_leaves(value) if isinstance(s, Symbol)]
  arrays = [s for s in leaves if not _is_static(s)]
  if len(leaves) > _MAX_LEAVES:
    n = count(arrays)[0]
    return f'{len(arrays)} arrays ({n:,} values)'

  def fmt(v):
    if isinstance(v, Symbol) or v is None:
      return _static_text(v) if _is_static(v) else v.type_str
    if hasattr(v, 'items'):
      return '{' + ', '.join(f'{k}: {fmt(x)}' for k, x in v.items()) + '}'
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
      return '{' + ', '.join(f'{f.name}: {fmt(getattr(v, f.name))}'
                             for f in dataclasses.fields(v)) + '}'
    if isinstance(v, (tuple, list)):
      return '(' + ', '.join(fmt(x) for x in v) + ')'
    return type(v).__name__
  return fmt(value)


def _named(name: str | None, value) -> str:
  if name is None:
    return value_text(value)
  if _is_static(value):
    return f'{name}={_static_text(value)}'
  return f'{name}: {value_text(value)}'


def _signature(mox: Mox):
  fn = getattr(mox.module_ty, mox.entrypoint or '__call__', None)
  if fn is None:
    return None
  try:
    return inspect.signature(fn)
  except (TypeError, ValueError):
    return None


def input_texts(mox: Mox) -> list[str]:
  """The call's arguments with their parameter names (see module doc)."""
  leaves = mox.arg_inputs
  try:
    args, kwargs = jax.tree_util.tree_unflatten(mox.in_tree, leaves)
  except Exception:  # noqa: BLE001 - no usable in_tree: types only
    return [type_text(s) for s in leaves]
  sig = _signature(mox)
  bound = None
  if sig is not None:
    try:
      bound = sig.bind(None, *args, **kwargs)  # None stands for self
    except TypeError:
      bound = None
  if bound is None:
    return ([_named(None, a) for a in args] +
            [_named(k, v) for k, v in kwargs.items()])
  out = []
  for i, (name, value) in enumerate(bound.arguments.items()):
    if i == 0:
      continue  # self
    kind = sig.parameters[name].kind
    if kind is inspect.Parameter.VAR_POSITIONAL:
      out.extend(_named(None, v) for v in value)
    elif kind is inspect.Parameter.VAR_KEYWORD:
      out.extend(_named(k, v) for k, v in value.items())
    else:
      out.append(_named(name, value))
  return out


def output_texts(mox: Mox) -> list[str]:
  """The results; dict keys and dataclass fields name them."""
  try:
    tree = jax.tree_util.tree_unflatten(mox.out_tree, mox.outputs)
  except Exception:  # noqa: BLE001 - no usable out_tree: types only
    return [type_text(s) for s in mox.outputs]
  if isinstance(tree, Symbol):
    return [type_text(tree)]
  if hasattr(tree, 'items'):  # dict, FrozenDict, HF ModelOutput
    return [_named(str(k), v) for k, v in tree.items()]
  if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
    return [_named(f.name, getattr(tree, f.name))
            for f in dataclasses.fields(tree)]
  if isinstance(tree, (tuple, list)):
    fields = getattr(tree, '_fields', None)  # namedtuple
    if fields:
      return [_named(k, v) for k, v in zip(fields, tree, strict=True)]
    return [value_text(v) for v in tree]
  return [value_text(tree)]


def variable_texts(mox: Mox) -> list[str]:
  """The module's own variables, ``kernel: f32[64,64]``."""
  out = []
  for collection, own in own_variables(mox).items():
    prefix = '' if collection == PARAMS else collection + '/'
    out.extend(f'{prefix}{k}: {s.type_str}' for k, s in own.items())
  return out


# ------------------------------------------------------------------ rows

@dataclasses.dataclass(frozen=True)
class SummaryRow:
  """One module call of :func:`summary`.

  ``path`` is the Flax scope path joined with ``/`` (``''`` for the
  outermost module); ``method`` the entrypoint; ``inputs``, ``outputs`` and
  ``variables`` are display strings (``x: f32[2,8]``,
  ``deterministic=True``, ``kernel: f32[64,64]``); ``own_params`` counts the
  module's own ``params``, ``params`` also its submodules' (with
  ``param_bytes`` bytes); ``other_vars`` counts other collections
  (``{'batch_stats': 6}``); ``flops`` counts the whole call (see
  :mod:`yax._src.report.flops`); ``node`` is the :class:`~yax.Mox` itself.
  """
  path: str
  module: str
  method: str
  depth: int
  inputs: tuple[str, ...]
  outputs: tuple[str, ...]
  variables: tuple[str, ...]
  own_params: int
  params: int
  param_bytes: int
  other_vars: dict[str, int]
  flops: int
  node: Mox = dataclasses.field(repr=False, compare=False)
  # The dtype the call computes in: what yax.cast set, else the dtype of
  # its first floating output (or of its first contraction's result); a
  # kernel quantized by yax.quantize adds its format: 'float32 (int8)'.
  dtype: str = ''
  # Of ``own_params``, those no module call reads (see unread_params):
  # the model holds them, its forward does not use them. They are in
  # ``variables`` too, marked ``(unread)``, and in ``params`` here and in
  # the rows above.
  unread_params: int = 0
  # Of ``params``, the LoRA adapters (``yax.lora``'s ``lora_a``, ``lora_b``,
  # DoRA's ``lora_magnitude``, named after a kernel or method too): what
  # trains (params ``lora(train=...)`` unfreezes are not marked in the tree).
  trainable: int = 0
  # Bytes the call itself keeps for the backward pass (exclusive of its
  # submodules, ``yax.memory_report``'s row), when ``summary`` was given
  # a report; None otherwise or when the report has no row for the call.
  saved: int | None = None

  @property
  def type(self) -> str:
    """``Dense``, or ``Type.method`` for a method other than ``__call__``."""
    if self.method in ('', '__call__'):
      return self.module
    return f'{self.module}.{self.method}'


def _is_helper(node: Mox, owner: Mox | None) -> bool:
  return (owner is not None and node.path == owner.path
          and node.module_ty is owner.module_ty
          and node.entrypoint not in (None, '__call__'))


def _is_group(node: Mox) -> bool:
  """A node made by ``yax.group`` (ephemeral, named, no method)."""
  return node.is_ephemeral and node.entrypoint is None and node.name is not None


def summary(mox: Expr, *, depth: int | None = None,
            memory=None) -> list[SummaryRow]:
  """The module table of ``mox``: one :class:`SummaryRow` per module call.

  **Arguments:**
  - ``mox``: a tree from :func:`yax.make_mox` (or any node of it).
  - ``depth``: keep module calls nested at most this deep (0: only the
    outermost ones); ``None`` keeps all.
  - ``memory``: a ``yax.memory_report`` of a training step of this tree
    (given the same loss and arguments); each row's ``saved`` is then the
    bytes its call keeps for the backward pass (the report's row, found
    by path: ``<Type>`` for the call at the root path).

  **Returns:** rows in call order (pre-order). Helper-method calls of a
  module from inside itself are folded into the caller's row (see the
  module doc).
  """
  out: list[SummaryRow] = []
  parents: list[int | None] = []  # the row each row sits in
  reads = ParamReads(mox)
  adapters = adapter_params(mox, reads)

  def visit(node: Expr, level: int, owner: Mox | None, parent: int | None):
    if isinstance(node, Mox) and (not node.is_ephemeral or _is_group(node)):
      if _is_helper(node, owner):
        for child in node.children:
          visit(child, level, owner, parent)
        return
      if depth is not None and level > depth:
        return
      groups = variable_groups(node)
      groups.pop(PARAMS, None)
      read = reads.of(node)
      n, nbytes = count(read.values())
      # Own: the params no row below reads (a submodule's kernel read
      # straight from it, as MoE experts inside a shard_map, is the
      # reader's own when the submodule is never called).
      below: dict[int, Symbol] = {}
      for row in _rows_below(node):
        below.update(reads.of(row))
      own_params = count(s for k, s in read.items() if k not in below)[0]
      texts = variable_texts(node)
      out.append(SummaryRow(
          path='/'.join(node.path), module=node.type_name or '',
          method=node.entrypoint or '__call__', depth=level,
          inputs=tuple(input_texts(node)), outputs=tuple(output_texts(node)),
          variables=tuple(texts),
          own_params=own_params, params=n, param_bytes=nbytes,
          other_vars={k: count(v)[0] for k, v in groups.items()},
          flops=flops(node), node=node, dtype=compute_dtype(node),
          trainable=count(s for k, s in read.items() if k in adapters)[0]))
      parents.append(parent)
      level, owner, parent = level + 1, node, len(out) - 1
    for child in node.children:
      visit(child, level, owner, parent)

  visit(mox, 0, None, None)
  rows = _with_unread(out, parents, unread_params(mox, reads))
  if memory is None:
    return rows
  kept = memory.by_path()
  return [dataclasses.replace(r, saved=kept.get(r.path or f'<{r.module}>'))
          for r in rows]


ADAPTER_NAMES = ('lora_a', 'lora_b', 'lora_magnitude')


def adapter_params(mox: Expr, reads: ParamReads | None = None
                   ) -> dict[int, Symbol]:
  """``{id: symbol}`` (root scope) of the LoRA adapter params the calls of
  ``mox`` read: variables named ``lora_a``, ``lora_b``, ``lora_magnitude``
  (or ending so: ``attend_lora_a``, ``wi_0_lora_b``)."""
  reads = ParamReads(mox) if reads is None else reads
  found = {}
  for node in module_calls(mox):
    for entry in var_entries(node):
      name = entry.rel_path[-1] if entry.rel_path else ''
      if entry.is_param and name.endswith(ADAPTER_NAMES):
        s = reads._root_symbol(entry.symbol)
        found[id(s)] = s
  return found


def _with_unread(rows: list[SummaryRow], parents: list[int | None],
                 unread: dict[Symbol, tuple[str, ...]]) -> list[SummaryRow]:
  """``rows`` with each unread param in the row of the module that owns
  it: the first row whose path is the longest prefix of the param's
  module path, else the first outermost row; counted in that row's own
  params and in the params of it and every row above it."""
  if not rows or not unread:
    return rows
  paths = [tuple(r.path.split('/')) if r.path else () for r in rows]
  own: dict[int, list[tuple[str, Symbol]]] = {}
  for sym, path in unread.items():
    best = None
    for i, p in enumerate(paths):
      if (len(p) < len(path) and path[:len(p)] == p
          and (best is None or len(p) > len(paths[best]))):
        best = i
    name = '/'.join(path if best is None else path[len(paths[best]):])
    own.setdefault(best or 0, []).append((name, sym))
  extra: dict[int, list[Symbol]] = {}
  for i, named in own.items():
    k: int | None = i
    while k is not None:
      extra.setdefault(k, []).extend(s for _, s in named)
      k = parents[k]
  out = []
  for i, row in enumerate(rows):
    named = own.get(i, [])
    n_own = count(s for _, s in named)[0]
    n, nbytes = count(extra.get(i, ()))
    out.append(dataclasses.replace(
        row, params=row.params + n, param_bytes=row.param_bytes + nbytes,
        own_params=row.own_params + n_own, unread_params=n_own,
        variables=row.variables + tuple(
            f'{name}: {s.type_str} (unread)' for name, s in named)))
  return out


def _rows_below(node: Mox) -> list[Mox]:
  """The module calls in ``node``'s body that have rows of their own (the
  nearest ones; helper calls of ``node`` are folded into its row)."""
  rows, stack = [], list(node.children)
  while stack:
    child = stack.pop()
    if (isinstance(child, Mox) and (not child.is_ephemeral or _is_group(child))
        and not _is_helper(child, node)):
      rows.append(child)
    else:
      stack.extend(child.children)
  return rows


def compute_dtype(node: Mox) -> str:
  """See :attr:`SummaryRow.dtype`."""
  text = node.params.get('compute_dtype')
  if not isinstance(text, str):
    floats = [s.aval.dtype for s in node.outputs if s.aval is not None
              and np.issubdtype(s.aval.dtype, np.floating)]
    text = str(floats[0]) if floats else next(
        (str(e.outputs[0].aval.dtype) for e in leaf_equations(node)
         if e.prim.name in ('dot_general', 'conv_general_dilated')), '')
  quant = node.params.get('quant')
  return f'{text} ({quant})' if isinstance(quant, str) and text else text


# ------------------------------------------------------------ rendering

def human_bytes(n: float) -> str:
  """Decimal units, as ``nn.tabulate`` shows them (``83.9 KB``)."""
  for unit in ('B', 'KB', 'MB', 'GB'):
    if n < 1000 or unit == 'GB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1000
  return f'{n:.1f} GB'  # pragma: no cover


def _tokens(line: str) -> list[str]:
  """Pieces a line may be broken between: after a space, a ``", "``, a
  ``/`` or a ``=`` (the separator stays with the piece before it). ``f32[2,8]`` has no
  break point."""
  return [t for t in re.findall(r'.*?(?:, | |/|=|$)', line) if t]


def _wrap(line: str, width: int) -> list[str]:
  """Greedy wrapping at spaces and after commas; never inside a word (a
  word longer than ``width`` gets a line of its own)."""
  out, cur = [], ''
  for tok in _tokens(line):
    if cur and len((cur + tok).rstrip()) > width:
      out.append(cur.rstrip())
      cur = tok.lstrip()
    else:
      cur += tok
  if cur.strip() or not out:
    out.append(cur.rstrip())
  return out


def _min_width(cell: str) -> int:
  return max((len(t.rstrip()) for line in cell.split('\n')
              for t in _tokens(line)), default=0)


def _natural_width(cell: str) -> int:
  return max((len(line) for line in cell.split('\n')), default=0)


@dataclasses.dataclass
class _Column:
  header: str
  right: bool = False
  wrap: bool = True  # False: never wrapped (numbers)


def render_table(columns: list[_Column], cells: list[list[str]],
                 width: int | None) -> list[str]:
  """A box-drawn table whose cells wrap at spaces/commas to fit ``width``
  (``None``: as wide as needed). Lines carry no trailing spaces."""
  n = len(columns)
  all_rows = [[c.header for c in columns]] + cells
  natural = [max(_natural_width(r[i]) for r in all_rows) for i in range(n)]
  for i, c in enumerate(columns):
    if not c.wrap:  # the header may wrap, the numbers may not
      natural[i] = max([_min_width(c.header)] +
                       [_natural_width(r[i]) for r in cells])
  minimal = [max(_min_width(r[i]) for r in all_rows) if columns[i].wrap
             else natural[i] for i in range(n)]
  widths = list(natural)
  if width is not None:
    budget = width - (3 * n + 1)
    while sum(widths) > budget:
      # Shrink the column with the most room above its minimum.
      slack = [w - m for w, m in zip(widths, minimal, strict=True)]
      i = max(range(n), key=lambda k: (slack[k], widths[k]))
      if slack[i] <= 0:
        break  # cannot fit without breaking words: let it overflow
      widths[i] -= 1

  def layout(row: list[str]) -> list[str]:
    blocks = []
    for i, cell in enumerate(row):
      lines = []
      for line in cell.split('\n'):
        lines.extend(_wrap(line, widths[i]))
      blocks.append(lines)
    height = max(len(b) for b in blocks)
    out = []
    for k in range(height):
      parts = []
      for i, b in enumerate(blocks):
        text = b[k] if k < len(b) else ''
        parts.append(text.rjust(widths[i]) if columns[i].right
                     else text.ljust(widths[i]))
      out.append('│ ' + ' │ '.join(parts) + ' │')
    return out

  def rule(left, mid, right, fill='─'):
    return left + mid.join(fill * (w + 2) for w in widths) + right

  lines = [rule('┌', '┬', '┐')]
  lines += layout([c.header for c in columns])
  lines.append(rule('╞', '╪', '╡', '═'))
  for k, row in enumerate(cells):
    if k:
      lines.append(rule('├', '┼', '┤'))
    lines += layout(row)
  lines.append(rule('└', '┴', '┘'))
  return lines


def _params_cell(row: SummaryRow) -> str:
  if not row.params:
    text = ''
  else:
    text = f'{row.params:,}\n({human_bytes(row.param_bytes)})'
  for k, v in row.other_vars.items():
    text += f'\n{k}: {v:,}'
  return text.lstrip('\n')


def _count(n: int) -> str:
  return f'{n:,}' if n else ''


def _si(n: int) -> str:
  """``22.4G``, ``886.5K``: three significant digits, for the most compact
  layout."""
  if not n:
    return ''
  for unit, scale in (('T', 1e12), ('G', 1e9), ('M', 1e6), ('K', 1e3)):
    if n >= scale:
      return f'{n / scale:.1f}{unit}'
  return str(n)


def _params_si(row: SummaryRow) -> str:
  text = f'{_si(row.params)}\n({human_bytes(row.param_bytes)})' if row.params else ''
  for k, v in row.other_vars.items():
    text += f'\n{k}: {_si(v)}'
  return text.lstrip('\n')


def _in_out(r: SummaryRow) -> str:
  return '\n'.join(list(r.inputs) + ['\u2192 ' + o for o in r.outputs])


def _vars_and_own(r: SummaryRow) -> str:
  own = [f'own: {r.own_params:,}'] if r.own_params and r.own_params != r.params else []
  return '\n'.join(list(r.variables) + own)


# Layouts from the widest to the most compact: the first whose unbreakable
# words fit the width is used. Each column: (header, cell(row), right, wrap).
_LAYOUTS = [
    [('path', lambda r: r.path or '(top)', False, True),
     ('module', lambda r: r.type, False, True),
     ('inputs', lambda r: '\n'.join(r.inputs), False, True),
     ('outputs', lambda r: '\n'.join(r.outputs), False, True),
     ('variables', lambda r: '\n'.join(r.variables), False, True),
     ('own params', lambda r: _count(r.own_params), True, False),
     ('params', _params_cell, True, False),
     ('FLOPs', lambda r: _count(r.flops), True, False)],
    [('path / module', lambda r: (r.path or '(top)') + '\n' + r.type, False, True),
     ('inputs', lambda r: '\n'.join(r.inputs), False, True),
     ('outputs', lambda r: '\n'.join(r.outputs), False, True),
     ('variables', lambda r: '\n'.join(r.variables), False, True),
     ('own params', lambda r: _count(r.own_params), True, False),
     ('params', _params_cell, True, False),
     ('FLOPs', lambda r: _count(r.flops), True, False)],
    [('path / module', lambda r: (r.path or '(top)') + '\n' + r.type, False, True),
     ('inputs \u2192 outputs', _in_out, False, True),
     ('variables', _vars_and_own, False, True),
     ('params', _params_cell, True, False),
     ('FLOPs', lambda r: _count(r.flops), True, False)],
    # Last resort: counts in K/M/G (exact figures are in yax.summary).
    [('path / module', lambda r: (r.path or '(top)') + '\n' + r.type, False, True),
     ('inputs \u2192 outputs', _in_out, False, True),
     ('variables', _vars_and_own, False, True),
     ('params', _params_si, True, False),
     ('FLOPs', lambda r: _si(r.flops), True, False)],
]


def _min_table_width(columns: list[_Column], cells: list[list[str]]) -> int:
  n = len(columns)
  total = 3 * n + 1
  for i, c in enumerate(columns):
    rows = [r[i] for r in cells]
    total += max([_min_width(c.header)] + [
        _min_width(x) if c.wrap else _natural_width(x) for x in rows])
  return total


def format_summary(mox: Mox, *, depth: int | None = None,
                   title: str | None = None, width: int | None = None,
                   xla: bool = False, dtypes: bool = False,
                   memory=None) -> str:
  """The summary as text (``yax.format_summary``): a title line, the
  table (see :func:`render_table`) and totals.

  When the table does not fit ``width`` without breaking a word, columns
  are merged (path with module; then inputs with outputs and own params
  with variables); if even that does not fit, it is wider than ``width``.

  **Arguments:**
  - ``mox``: the tree.
  - ``depth``: rows down to this many levels of module calls (``None``: all).
  - ``title``: a first line.
  - ``width``: the width to fit; ``None`` does not limit it.
  - ``xla``: add XLA's compiled cost analysis of the whole model.
  - ``dtypes``: show the compute dtype column (shown anyway after ``cast``
    or ``quantize``).
  - ``memory``: a ``yax.memory_report`` of a training step of this tree:
    adds a ``saved`` column (bytes each call keeps for the backward pass,
    exclusive of its submodules) and its totals.

  **Returns:** the text, one line per row and total, ending in a newline.

  Example::

      print(yax.format_summary(mox, depth=2, width=100))
  """
  rows = summary(mox, depth=depth, memory=memory)
  # The compute dtype column: asked for, or where a call was cast or
  # quantized (plain trees print as before).
  show = dtypes or any(isinstance(r.node.params.get(k), str) for r in rows
                       for k in ('compute_dtype', 'quant'))
  adapted = any(r.trainable for r in rows)
  for layout in _LAYOUTS:
    if adapted:  # after lora: the adapters' count, before the params
      at = next(i for i, c in enumerate(layout) if c[0] == 'params')
      layout = [*layout[:at], ('trainable', lambda r: _count(r.trainable),
                               True, False), *layout[at:]]
    if show:
      layout = [*layout[:-3], ('dtype', lambda r: r.dtype, False, True),
                *layout[-3:]] if len(layout) > 5 else [
                    *layout[:1], ('dtype', lambda r: r.dtype, False, True),
                    *layout[1:]]
    if memory is not None:  # bytes kept for the backward pass, before FLOPs
      layout = [*layout[:-1], ('saved', lambda r: '' if r.saved is None
                               else _count(r.saved), True, False), layout[-1]]
    columns = [_Column(h, right=right, wrap=wrap) for h, _, right, wrap in layout]
    cells = [[cell(row) for _, cell, _, _ in layout] for row in rows]
    if width is None or _min_table_width(columns, cells) <= width:
      break
  lines = [title] if title else []
  n, nbytes = total_params(mox)
  calls = sum(1 for _ in module_calls(mox))
  eqns = list(leaf_equations(mox))
  unread = sum(r.unread_params for r in rows)
  lines.append(f'Total params: {n:,} ({human_bytes(nbytes)})' + (
      f', {unread:,} of them read by no module call (unread)'
      if unread else ''))
  if adapted:
    n_train = count(adapter_params(mox).values())[0]
    lines.append(f'Trainable params (LoRA adapters): {n_train:,} of {n:,} '
                 f'({100 * n_train / max(n, 1):.4f}%)')
  lines.append(f'FLOPs: {flops(mox):,} (matmul, convolution and element-wise '
               'work; a transcendental counts as one)')
  missing = _flops.uncounted_primitives(eqns)
  if missing:
    lines.append('Not counted (no FLOP rule): ' + ', '.join(sorted(missing)))
  if xla:
    cost = xla_cost(mox)
    lines.append('XLA cost analysis (compiled, whole model): ' + (
        f"{cost['flops'] + cost['transcendentals']:,.0f} FLOPs "
        f"({cost['flops']:,.0f} flops + {cost['transcendentals']:,.0f} "
        'transcendentals)' if cost is not None else 'not available'))
  if memory is not None:
    lines.append(
        f'Saved for the backward pass: {memory.total:,} bytes '
        f'({memory.unattributed:,} outside module calls); training memory '
        f'(4 x params + saved): {memory.training:,} bytes')
  lines.append(f'{calls} module calls, {len(eqns)} equations, '
               f'{len(dynamic(mox.inputs))} inputs')

  def wrapped(texts):  # the title and the totals wrap too, at spaces
    out = []
    for line in texts:
      out.extend(_wrap(line, width) if width and len(line) > width else [line])
    return out
  head = wrapped(lines[:1]) if title else []
  out = head + render_table(columns, cells, width) + wrapped(
      lines[1:] if title else lines)
  return '\n'.join(line.rstrip() for line in out) + '\n'


def print_table(mox: Mox, *, file=None, width: int | None = None, **kwargs):
  """Prints :func:`format_summary` (``yax.print_summary``) fitted to
  ``width``; by default the width ``shutil.get_terminal_size`` reads:
  ``COLUMNS`` when it is set (also when the output is piped), else the
  terminal's when writing to one. Piped output without ``COLUMNS`` is as
  wide as needed.

  **Arguments:**
  - ``mox``: the tree.
  - ``file``: where to write (default ``sys.stdout``).
  - ``width``: the width to fit (default: see above).
  - ``**kwargs``: :func:`format_summary`'s (``depth``, ``title``, ``xla``,
    ``dtypes``, ``memory``).

  Example::

      yax.print_summary(mox, depth=2)
  """
  file = file if file is not None else sys.stdout
  if width is None and (_isatty(file) or _columns_set()):
    width = shutil.get_terminal_size().columns
  file.write(format_summary(mox, width=width, **kwargs))


def _columns_set() -> bool:
  """Whether ``COLUMNS`` holds a width ``shutil.get_terminal_size`` uses
  (a positive integer)."""
  try:
    return int(os.environ.get('COLUMNS', '')) > 0
  except ValueError:
    return False


def _isatty(file) -> bool:
  try:
    return file.isatty()
  except (AttributeError, ValueError):
    return False
