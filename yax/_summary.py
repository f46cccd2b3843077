"""A module summary of a MoX: one row per module call, like ``nn.tabulate``.

Everything is computed from the tree itself, without running the model:

* **params**: the size of the ``params`` collection among the module call's
  variable inputs (``Mox.var_inputs`` read through ``Mox.var_tree``). A
  module's variables include those of its submodules, as in Flax. Other
  collections (``batch_stats``, ...) are reported separately.
* **FLOPs**: ``2 * M * N * K`` for every ``dot_general`` and the same count
  for every ``conv_general_dilated`` among the call's equations, including
  equations inside ``jit``/``custom_jvp_call`` bodies (``scan`` bodies count
  ``length`` times, ``cond`` its costliest branch, ``while`` its body once).
  Element-wise work is not counted; for a whole-model figure that includes
  it, :func:`xla_flops` asks XLA's cost analysis.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import jax
import numpy as np
from jax.extend import core as jex

from yax._eval import dynamic, to_jaxpr
from yax._ir import Equation, Expr, Literal, Mox, Symbol, leaf_equations

PARAMS = 'params'


# --------------------------------------------------------------- FLOPs

def _size(aval) -> int:
  shape = getattr(aval, 'shape', None)
  return int(math.prod(shape)) if shape is not None else 0


def _sub_jaxprs(params: dict) -> Iterator[jex.Jaxpr]:
  for value in params.values():
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
      if isinstance(item, jex.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jex.Jaxpr):
        yield item


def equation_flops(prim: str, in_avals, out_avals, params: dict) -> int:
  """Multiply-add FLOPs (2 per multiply-accumulate) of one equation."""
  if prim == 'dot_general':
    (lhs_contract, _), _ = params['dimension_numbers']
    k = math.prod(in_avals[0].shape[d] for d in lhs_contract)
    return 2 * _size(out_avals[0]) * k
  if prim == 'conv_general_dilated':
    rhs = in_avals[1].shape
    out_feature_dim = params['dimension_numbers'].rhs_spec[0]
    per_output = math.prod(rhs) // max(rhs[out_feature_dim], 1)
    return 2 * _size(out_avals[0]) * per_output
  bodies = [jaxpr_flops(j) for j in _sub_jaxprs(params)]
  if not bodies:
    return 0
  if prim == 'cond':
    return max(bodies)
  total = sum(bodies)
  if prim == 'scan':
    total *= int(params.get('length', 1))
  return total


def jaxpr_flops(jaxpr: jex.Jaxpr) -> int:
  return sum(
      equation_flops(e.primitive.name, [v.aval for v in e.invars],
                     [v.aval for v in e.outvars], e.params)
      for e in jaxpr.eqns)


def flops(expr: Expr) -> int:
  """Matmul and convolution FLOPs of a node (see the module docstring)."""
  eqns = [expr] if isinstance(expr, Equation) else leaf_equations(expr)
  return sum(
      equation_flops(e.prim.name, [s.aval for s in e.inputs],
                     [s.aval for s in e.outputs], e.params)
      for e in eqns)


def xla_flops(mox: Mox) -> float | None:
  """FLOPs of the whole tree by XLA's cost analysis (compiles it once).

  Returns ``None`` when the backend gives no estimate.
  """
  closed = to_jaxpr(mox)
  specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
           for v in closed.jaxpr.invars]
  compiled = jax.jit(jex.jaxpr_as_fun(closed)).lower(*specs).compile()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost or 'flops' not in cost:
    return None
  return float(cost['flops'])


# ----------------------------------------------------------- variables

def variable_groups(mox: Mox) -> dict[str, list[Symbol]]:
  """The module call's variable inputs grouped by collection name."""
  if not isinstance(mox, Mox) or mox.num_vars == 0:
    return {}
  try:
    tree = jax.tree_util.tree_unflatten(mox.var_tree, mox.var_inputs)
  except Exception:  # noqa: BLE001 - a rewritten node with an odd var_tree
    return {'variables': list(mox.var_inputs)}
  if not isinstance(tree, dict):
    return {'variables': list(mox.var_inputs)}
  groups = {}
  for collection, sub in tree.items():
    leaves = [s for s in jax.tree_util.tree_leaves(sub) if isinstance(s, Symbol)]
    if leaves:
      groups[str(collection)] = leaves
  return groups


def count(symbols) -> tuple[int, int]:
  """(number of scalars, bytes) of the given symbols."""
  n = nbytes = 0
  for s in symbols:
    size = _size(s.aval)
    n += size
    dtype = getattr(s.aval, 'dtype', None)
    if dtype is not None:
      nbytes += size * np.dtype(dtype).itemsize
  return n, nbytes


def param_count(mox: Mox) -> int:
  return count(variable_groups(mox).get(PARAMS, ()))[0]


def total_params(mox: Mox) -> tuple[int, int]:
  """(count, bytes) of the ``params`` read by the outermost module calls.

  A module's variables include its submodules', so only module calls that
  are not inside another module call are counted, and each variable once
  (a module called twice shares them). A tree without module calls has none.
  """
  seen: dict[int, Symbol] = {}
  for node in outermost_calls(mox):
    for s in variable_groups(node).get(PARAMS, ()):
      seen[id(s)] = s
  return count(seen.values())


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


# ------------------------------------------------------------------ rows

def module_calls(mox: Expr) -> Iterator[Mox]:
  """Non-ephemeral module calls, pre-order (also inside scan/remat bodies)."""
  stack = [mox]
  while stack:
    node = stack.pop()
    if isinstance(node, Mox) and not node.is_ephemeral:
      yield node
    stack.extend(reversed(node.children))


def type_text(sym: Symbol) -> str:
  """``f32[2,8]`` for arrays; the value for static Python inputs."""
  if isinstance(sym, Literal) and sym.is_static:
    text = repr(sym.value)
    return text if len(text) <= 24 else text[:21] + '...'
  return sym.type_str


@dataclasses.dataclass
class Row:
  node: Mox
  depth: int
  path: str
  module: str
  inputs: list[str]
  outputs: list[str]
  params: int
  param_bytes: int
  other_vars: dict[str, int]
  flops: int


def rows(mox: Mox, max_depth: int | None = None) -> list[Row]:
  """One :class:`Row` per module call, pre-order; ``max_depth`` counts module
  nesting from 0 (the outermost module calls)."""
  out: list[Row] = []

  def visit(node: Expr, depth: int):
    if isinstance(node, Mox) and not node.is_ephemeral:
      if max_depth is not None and depth > max_depth:
        return
      groups = variable_groups(node)
      n, nbytes = count(groups.pop(PARAMS, ()))
      module = node.type_name
      if node.entrypoint not in (None, '__call__'):
        module = f'{module}.{node.entrypoint}'
      out.append(Row(
          node=node, depth=depth, path='/'.join(node.path), module=module,
          inputs=[type_text(s) for s in node.arg_inputs],
          outputs=[type_text(s) for s in node.outputs],
          params=n, param_bytes=nbytes,
          other_vars={k: count(v)[0] for k, v in groups.items()},
          flops=flops(node)))
      depth += 1
    for child in node.children:
      visit(child, depth)

  visit(mox, 0)
  return out


# ------------------------------------------------------------ rendering

def human_bytes(n: float) -> str:
  """Decimal units, as ``nn.tabulate`` shows them (``83.9 KB``)."""
  for unit in ('B', 'KB', 'MB', 'GB'):
    if n < 1000 or unit == 'GB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1000
  return f'{n:.1f} GB'  # pragma: no cover


def _shapes(items: list[str], limit: int = 4) -> str:
  if len(items) > limit:
    items = items[:limit] + [f'... (+{len(items) - limit})']
  return '\n'.join(items)


def make_table(mox: Mox, *, max_depth: int | None = None, title: str | None = None,
               xla: bool = False):
  """The summary as a ``rich.table.Table``."""
  from rich.table import Table

  table = Table(title=title, title_justify='left', caption_justify='left')
  table.add_column('path', style='cyan', overflow='fold')
  table.add_column('module', style='bold', no_wrap=True)
  table.add_column('inputs', overflow='fold')
  table.add_column('outputs', overflow='fold')
  table.add_column('params', justify='right', no_wrap=True)
  table.add_column('FLOPs (dot/conv)', justify='right', no_wrap=True)
  for row in rows(mox, max_depth):
    path = row.path or "(top)"
    params = ''
    if row.params:
      params = f'{row.params:,} [dim]({human_bytes(row.param_bytes)})[/dim]'
    for k, v in row.other_vars.items():
      params += f'\n[dim]{k}: {v:,}[/dim]'
    table.add_row(path, row.module, _shapes(row.inputs), _shapes(row.outputs),
                  params.lstrip('\n'), f'{row.flops:,}' if row.flops else '')
  n, nbytes = total_params(mox)
  calls = sum(1 for _ in module_calls(mox))
  eqns = sum(1 for _ in leaf_equations(mox))
  caption = [f'Total params: {n:,} ({human_bytes(nbytes)})',
             f'FLOPs (dot_general + conv): {flops(mox):,}']
  if xla:
    estimate = xla_flops(mox)
    caption.append('FLOPs (XLA cost analysis, whole model): ' + (
        f'{estimate:,.0f}' if estimate is not None else 'not available'))
  caption.append(f'{calls} module calls, {eqns} equations, '
                 f'{len(dynamic(mox.inputs))} inputs')
  table.caption = '\n'.join(caption)
  return table


def print_table(mox: Mox, *, file=None, **kwargs):
  """Prints :func:`make_table`; when not writing to a terminal the table gets
  the width it needs instead of being folded to 80 columns."""
  from rich.console import Console
  table = make_table(mox, **kwargs)
  console = Console(file=file, soft_wrap=False)
  if not console.is_terminal:
    wide = Console(file=file, width=100_000)
    width = wide.measure(table, options=wide.options).maximum
    console = Console(file=file, width=max(width, 80), soft_wrap=False)
  console.print(table)
