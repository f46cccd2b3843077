"""``yax.fit_memory``: choose a memory rewrite per module call to fit a budget.

A training step's memory is estimated as ``yax.memory_report``'s peak: ``4
x param bytes`` (params, gradients, Adam's two moments) plus the residuals the
backward pass keeps, plus the largest body a rematerialized call recomputes
while its own backward pass runs (``MemoryReport.recompute``: remat of a
whole model keeps almost nothing between the passes, but its peak is the
baseline's). The planner cuts the residuals, per module call, with
the memory rewrites (its *choices*):

* ``lean_norm``: a Linen LayerNorm/RMSNorm keeps its input and per-row
  statistics (exact gradients, no recompute);
* ``remat``: the call runs under ``jax.checkpoint``, keeping only its inputs
  (``remat``), also its matmul outputs (``remat(dots_saveable)``), or also
  a set of values inside it (``remat(save: query_proj,mlp/wo)``: the
  values its code tags with ``checkpoint_name`` and the outputs of module
  calls under it, ranked by the FLOPs a save spares per byte it keeps and
  offered as up to ``SAVE_SETS`` nested sets); exact gradients, its
  forward pass is recomputed but for what it keeps;
* ``fewbit``: the activations inside the call keep ``bits``-bit codes
  (approximate gradients, almost no added compute);
* ``randomized``: a linear call keeps a count sketch of ``ratio`` of its
  input rows (unbiased, stochastic kernel gradient; the tree then takes a
  ``sketch_key``).

Host offload is not among the choices: ``memory_report`` counts an
offloaded residual as kept, and on CPU there is no host memory to offload
to.

**How it chooses.** Each choice is measured on the traced tree alone:
the bytes it saves (``memory_report``'s total before and after) and the
FLOPs it adds to the gradient computation (``report/flops.py`` on the Jaxpr
of ``jax.grad``, which follows XLA's cost analysis conventions). Calls of
the same type and input types (the layers of a stack) are measured
together, once. At most one choice is made per module call, and two chosen
calls never change the same report row (a remat takes every row under its
call). The greedy loop then takes, while the
estimate is above the budget, the choice of the least added FLOPs per byte
saved (an exact one before an approximate one at equal cost; a choice
replaces those whose report rows it changes when it saves more than they
do), unless one choice meets the budget by itself with fewer added FLOPs
than that sequence (so a tight budget gets remat of each layer keeping
some projections rather than remat of the whole stack), and checks the rewritten tree with ``memory_report``; when the check
is over the budget, the loop goes on from the measured memory. When the
cheap choices run out, the choices that save the most bytes (taken
greedily by bytes) are checked the same way; a budget below every checked
memory is refused, naming the least.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Callable, Sequence

import jax

from yax._src.errors import SubstitutionError
from yax._src.ir import lower as _lower
from yax._src.ir.nodes import Literal, Mox, iter_nodes, leaf_equations
from yax._src.report import flops as _flops
from yax._src.report.memory import MemoryReport, step_memory
from yax._src.tools.fewbit import BITS, fewbit
from yax._src.tools.lean_norm import lean_norm
from yax._src.tools.randomized import KEY_NAME, randomized_linear
from yax._src.tools.remat import remat, resolve_policy
from yax._src.trace.eval import eval_mox

CHOICES = ('lean_norm', 'remat', 'fewbit', 'randomized')
# The measurements of the last tree planned: [tree, loss, (choices, bits,
# ratio, policies), (baseline report, baseline FLOPs, options)], matched
# by the identity of the tree and the loss (a tree is never changed in
# place), so that planning one tree at several budgets measures it once.
_MEASURED: list = []
# The exact choices (gradients equal the original's within float rounding).
EXACT = ('lean_norm', 'remat')
# At most this many nested save sets are measured per rematerialized call.
SAVE_SETS = 8


@dataclasses.dataclass(frozen=True)
class Saves:
  """What a rematerialized call keeps besides its inputs: the values its
  body tags with ``checkpoint_name`` (``names``) and the outputs of the
  module calls under it (``calls``: paths relative to the call)."""
  names: tuple[str, ...] = ()
  calls: tuple[tuple[str, ...], ...] = ()

  def __str__(self) -> str:
    return 'save: ' + ','.join([*self.names,
                                *('/'.join(c) for c in self.calls)])


@dataclasses.dataclass(frozen=True)
class PlanRow:
  """One chosen module call.

  Attributes:
    path: the call's path (``a/b``; ``<Type>`` for the call at the root).
    choice: ``lean_norm``, ``remat``, ``remat(dots_saveable)``,
      ``remat(save: query_proj,mlp/wo)`` (remat that also keeps these
      ``checkpoint_name`` tags and these module calls' outputs),
      ``fewbit(3 bits)`` or ``randomized(0.5)``.
    before: bytes the call and its submodules kept before the plan.
    after: bytes they keep in the planned tree.
    added_flops: FLOPs the choice adds to the gradient computation
      (measured alone; negative when it saves some).
    exact: whether the gradients stay exact.
  """
  path: str
  choice: str
  before: int
  after: int
  added_flops: int
  exact: bool


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """What ``yax.fit_memory`` returns; ``str()`` prints the table.

  Attributes:
    mox: the rewritten tree (evaluate it with ``sketch_key=`` when
      ``takes_sketch_key``).
    table: one :class:`PlanRow` per chosen call, in call order.
    memory: peak training memory of ``mox`` (bytes, ``4 x params + saved
      + recompute``: ``MemoryReport.peak``, measured by ``memory_report``).
    baseline: peak training memory of the input tree.
    budget: the budget in bytes.
    added_flops: FLOPs the plan adds to the gradient computation
      (measured on the planned tree).
    takes_sketch_key: True when a call is randomized.
    report: the ``memory_report`` of the planned tree.
    steps: the choices as ``(path, kind, argument)`` (kind ``lean_norm``,
      ``remat``, ``fewbit``, ``randomized``; argument the policy (or a
      :class:`Saves`), bits or ratio), in the order :meth:`apply` makes
      them.
  """
  mox: Mox
  table: tuple[PlanRow, ...]
  memory: int
  baseline: int
  budget: int
  added_flops: int
  takes_sketch_key: bool
  report: MemoryReport
  steps: tuple[tuple[tuple, str, object], ...] = ()

  def apply(self, mox: Mox) -> Mox:
    """The same choices made on another trace of the same model (another
    batch size or sequence length): the calls are found by path.

    Example::

        plan = yax.fit_memory(small_mox, loss, budget=0.5)
        big = plan.apply(yax.make_mox(model.apply)(variables, big_batch))
    """
    for path, kind, arg in self.steps:
      if not _calls_at(mox, path):
        raise SubstitutionError(
            f'MemoryPlan.apply: the plan chose {kind} for the module call at '
            f'{"/".join(path) or "the root path"}, which this tree does not '
            'have')
    return _apply_steps(mox, self.steps)

  def __str__(self) -> str:
    width = max([len(r.path) for r in self.table] + [12])
    wide = max([len(r.choice) for r in self.table] + [22])
    lines = [f'{"module call":<{width}}  {"choice":<{wide}}  '
             f'{"kept before":>12}  {"kept after":>12}  {"added FLOPs":>13}']
    for r in self.table:
      lines.append(f'{r.path:<{width}}  {r.choice:<{wide}}  {r.before:>12,}  '
                   f'{r.after:>12,}  {r.added_flops:>13,}')
    base = max(self.baseline, 1)
    lines.append(
        f'peak training memory {self.memory:,} bytes = '
        f'{self.memory / base:.3f} of the baseline {self.baseline:,} (budget {self.budget:,} = '
        f'{self.budget / base:.3f}); added FLOPs {self.added_flops:,}')
    return '\n'.join(lines)

  __repr__ = __str__


@dataclasses.dataclass(frozen=True)
class _Option:
  """A choice measured for one call path (``saved``/``flops`` per path);
  ``rows``: the report rows (paths) it changes; ``transient``: the
  recompute figure of the tree with this choice alone
  (``MemoryReport.recompute``). Two options conflict when
  their rows meet (or they are the same rewrite of nested calls:
  :func:`_meet`)."""
  path: tuple
  kind: str
  arg: object  # policy, bits or ratio
  saved: int
  flops: int
  rows: frozenset
  transient: int = 0

  @property
  def label(self) -> str:
    if self.kind == 'remat':
      return 'remat' if self.arg in (None, Saves()) else f'remat({self.arg})'
    if self.kind == 'fewbit':
      return f'fewbit({self.arg} bits)'
    if self.kind == 'randomized':
      return f'randomized({self.arg:g})'
    return self.kind

  @property
  def rank(self) -> float:
    """Gradient error, in order: exact choices, fewbit (more bits first),
    the stochastic sketch."""
    if self.kind in EXACT:
      return 0.0
    if self.kind == 'fewbit':
      return 1 + (8 - self.arg) / 8
    return 2.0


def _path_text(path: tuple, type_name: str) -> str:
  return '/'.join(path) or f'<{type_name or "root"}>'


def _calls_at(tree: Mox, path: tuple) -> list[Mox]:
  return [n for n in iter_nodes(tree)
          if isinstance(n, Mox) and not n.is_ephemeral and n.path == path]


def _apply(tree: Mox, kind: str, arg, paths) -> Mox:
  nodes = [n for p in paths for n in _calls_at(tree, p)]
  if kind == 'lean_norm':
    return lean_norm(tree, nodes)
  if kind == 'remat' and isinstance(arg, Saves):
    policy = (jax.checkpoint_policies.save_only_these_names(*arg.names)
              if arg.names else None)
    save = [n for p in paths for c in arg.calls
            for n in _calls_at(tree, p + c)]
    return remat(tree, nodes, policy=policy, save=save or None)
  if kind == 'remat':
    return remat(tree, nodes, policy=arg)
  if kind == 'fewbit':
    return fewbit(tree, nodes, bits=arg)
  return randomized_linear(tree, nodes, ratio=arg)


def _apply_steps(tree: Mox, steps) -> Mox:
  """``(path, kind, arg)`` steps in order; the sketched calls in one
  ``randomized_linear`` (the tree takes one ``sketch_key``), in place of
  the first."""
  sketched = [p for p, kind, _ in steps if kind == 'randomized']
  done = False
  for path, kind, arg in steps:
    if kind != 'randomized':
      tree = _apply(tree, kind, arg, [path])
    elif not done:
      tree, done = _apply(tree, kind, arg, sketched), True
  return tree


def _inside(p: tuple, q: tuple) -> bool:
  """``p`` is ``q`` or a call under it."""
  return p[:len(q)] == q


def _check_budget(budget) -> tuple[int | None, float | None]:
  """``(bytes, None)`` or ``(None, fraction)``."""
  if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
    raise SubstitutionError(
        f'fit_memory: budget must be bytes of training memory (an int) or a '
        f'fraction of the baseline in (0, 1), found {budget!r}')
  if isinstance(budget, numbers.Integral):
    if budget <= 0:
      raise SubstitutionError(
          f'fit_memory: a budget in bytes must be positive, found {budget}')
    return int(budget), None
  if not 0 < budget < 1:
    raise SubstitutionError(
        "fit_memory: a float budget is a fraction of the baseline's training "
        f'memory, in (0, 1); found {budget!r} (pass bytes as an int)')
  return None, float(budget)


def fit_memory(mox: Mox, loss: Callable, *, budget, args=None,
               choices: Sequence[str] = CHOICES,
               bits: Sequence[int] = (4, 2),
               ratio: float = 0.5,
               policies: Sequence = (None, 'dots_saveable')) -> MemoryPlan:
  """Rewrites module calls so that a training step fits a memory budget at
  the least added compute.

  **Arguments:**
  - ``mox``: the traced tree (left unchanged); its first argument is the
    params the step differentiates.
  - ``loss``: maps what the tree returns to a scalar.
  - ``budget``: bytes of training memory (an int), or a float in (0, 1): a
    fraction of the input tree's training memory. Training memory is
    ``memory_report``'s peak: ``4 x param bytes + saved residuals +
    recompute`` (what a rematerialized call's body keeps while its
    backward pass runs).
  - ``args``: ``(args, kwargs)`` to evaluate the tree on; by default
    ``jax.ShapeDtypeStruct`` s of the traced inputs (nothing is computed:
    every measurement traces or compiles only).
  - ``choices``: the rewrites to choose from, among ``'lean_norm'``,
    ``'remat'``, ``'fewbit'``, ``'randomized'``; ``('lean_norm',
    'remat')`` keeps gradients exact. Host offload is not offered (CPU has
    no host memory space to offload to, and the report counts an
    offloaded residual as kept).
  - ``bits``: the fewbit widths tried; ``ratio``: the randomized ratio
    (one for every sketched call: the tree takes one ``sketch_key``);
    ``policies``: the remat policies tried (``None`` keeps only the call's
    inputs). With ``'remat'`` the planner also tries remat keeping nested
    sets of the call's ``checkpoint_name`` tags and inner calls' outputs
    (see the module doc).

  **Returns:** a :class:`MemoryPlan`: ``.mox`` (the rewritten tree: it
  takes ``sketch_key=`` when ``.takes_sketch_key``), ``.table`` (per
  chosen call: path, choice, bytes kept before and after, added FLOPs),
  ``.memory`` (the peak training memory reached, checked by
  ``memory_report``)
  and ``.report``. ``str(plan)`` is a table.

  Raises ``SubstitutionError`` when ``budget`` is below the least training
  memory the choices reach (naming it in bytes and as a fraction of the
  baseline), or is not a positive int or a float in (0, 1).

  Example::

      mox = yax.make_mox(model.apply)(variables, x)
      plan = yax.fit_memory(mox, lambda y: (y ** 2).mean(), budget=0.5)
      print(plan)
      grads = jax.grad(lambda p: loss(yax.eval_mox(plan.mox, p, x)))(
          variables)
  """
  if not isinstance(mox, Mox):
    raise SubstitutionError(
        f'fit_memory expects a Mox as the tree, found {type(mox).__name__}')
  unknown = [c for c in choices if c not in CHOICES]
  if unknown or not choices:
    raise SubstitutionError(
        f'fit_memory: choices must be among {", ".join(CHOICES)}, found '
        f'{list(choices)!r}')
  in_bytes, fraction = _check_budget(budget)
  # Checked here: a tool's refusal while measuring means "does not apply".
  bad_bits = [b for b in bits if b not in BITS]
  bad_ratio = isinstance(ratio, bool) or not isinstance(
      ratio, numbers.Real) or not 0 < ratio <= 1
  if bad_bits or bad_ratio:
    raise SubstitutionError(
        f'fit_memory: bits must be among {BITS} and the ratio in (0, 1]; '
        f'found bits {list(bits)!r}, ratio {ratio!r}')
  for policy in policies:
    resolve_policy(policy)  # raises SubstitutionError naming the policies
  if args is None:
    leaves = [jax.ShapeDtypeStruct(tuple(s.aval.shape), s.aval.dtype)
              for s in mox.inputs]
    pos, kw = jax.tree_util.tree_unflatten(mox.in_tree, leaves)
  else:
    pos, kw = args
  if not pos:
    raise SubstitutionError(
        'fit_memory: the tree takes no positional argument; its first one '
        'must be the params')
  params, rest = pos[0], tuple(pos[1:])
  key = jax.random.key(0)

  def step(tree: Mox, sketched: bool):
    extra = {KEY_NAME: key} if sketched else {}
    return lambda p, a, k: loss(eval_mox(tree, p, *a, **k, **extra))

  def measure(tree: Mox, sketched: bool):
    return step_memory(step(tree, sketched), params, rest, dict(kw),
                       flops=True)

  asked = (tuple(choices), tuple(bits), ratio, tuple(policies))
  hit = args is None and _MEASURED and _MEASURED[0] is mox and \
      _MEASURED[1] is loss and _MEASURED[2] == asked
  if hit:
    base_report, base_flops, options = _MEASURED[3]
  else:
    base_report, base_flops = measure(mox, False)
    options = None
  baseline = base_report.peak
  limit = in_bytes if fraction is None else int(fraction * baseline)
  types = {n.path: n.type_name or '' for n in iter_nodes(mox)
           if isinstance(n, Mox) and not n.is_ephemeral}
  if base_report.peak <= limit:
    return MemoryPlan(mox, (), baseline, baseline, limit, 0, False,
                      base_report)

  if options is None:
    options = _options(mox, types, choices, bits, ratio, policies, measure,
                       base_report, base_flops)
    if args is None:
      _MEASURED[:] = [mox, loss, asked, (base_report, base_flops, options)]

  def build(chosen: dict) -> Mox:
    return _apply_steps(mox, [(o.path, o.kind, o.arg)
                              for o in _in_order(chosen)])

  def check(chosen: dict):
    sketched = any(o.kind == 'randomized' for o in chosen.values())
    tree = build(chosen)
    report, flops = measure(tree, sketched)
    return tree, report, flops

  # The recompute transient is a maximum, paid once: the choices are
  # made among those whose transient is at most a level, the level that
  # meets the estimate at the least added FLOPs.
  floor = _level(options, base_report, limit)
  usable = [o for o in options if o.transient <= floor]
  checked = []  # (memory, chosen, tree, report, flops) of each check
  chosen: dict = {}
  shift = 0
  for _ in range(len(options) + 1):
    if _estimate(base_report, chosen) + shift > limit:
      chosen = _fill(usable, chosen, base_report, limit - shift, floor)
    tree, report, flops = check(chosen)
    checked.append((report.peak, dict(chosen), tree, report, flops))
    if report.peak <= limit or \
        _next_option(usable, chosen, _cheapest, floor) is None:
      break
    shift = report.peak - _estimate(base_report, chosen)
  if checked[-1][0] > limit:
    # The cheap choices ran out: the choices that save the most bytes.
    least = _least(options, base_report)
    tree, report, flops = check(least)
    checked.append((report.peak, least, tree, report, flops))
  met = [c for c in checked if c[0] <= limit]
  if not met:
    least = min(c[0] for c in checked)
    raise SubstitutionError(
        f'fit_memory: the budget {limit:,} bytes ({limit / baseline:.3f} of '
        f"the baseline's peak training memory {baseline:,}) is below the "
        f'least peak training memory the choices {", ".join(choices)} reach: '
        f'{least:,} bytes ({least / baseline:.3f} of the baseline). The '
        'tree is unchanged.')
  memory, chosen, tree, report, flops = met[0]
  return _plan(mox, tree, chosen, base_report, report, baseline, limit,
               flops - base_flops, types)


def _in_order(chosen: dict) -> list[_Option]:
  """remat last: it moves a call's body into a checkpoint equation."""
  return sorted(chosen.values(), key=lambda o: (o.kind == 'remat', o.path))


def _estimate(base_report: MemoryReport, chosen: dict) -> int:
  return base_report.training - sum(o.saved for o in chosen.values()) + \
      _transient(chosen.values(), base_report.recompute)


def _transient(options, floor: int) -> int:
  """The recompute figure of a set of choices: the largest of theirs
  (measured alone) and the input tree's own (``floor``)."""
  return max([floor] + [o.transient for o in options])


def _levels(options, base_report: MemoryReport):
  """For each recompute level (the input tree's and each option's
  transient), the options whose transient is at most that level."""
  floor = base_report.recompute
  for level in sorted({floor} | {o.transient for o in options
                                 if o.transient > floor}):
    yield level, [o for o in options if o.transient <= level]


def _level(options, base_report: MemoryReport, limit: int) -> int:
  """The recompute level at which the cheapest choices (by
  :func:`_cheapest`, taken while the estimate is over ``limit``) meet
  ``limit`` at the least added FLOPs (the lowest such level), or else
  reach the least estimate."""
  best = None
  for level, usable in _levels(options, base_report):
    chosen: dict = {}
    while _estimate(base_report, chosen) > limit:
      pick = _next_option(usable, chosen, _cheapest, level)
      if pick is None:
        break
      _take(chosen, pick)
    estimate = _estimate(base_report, chosen)
    key = (estimate > limit, estimate if estimate > limit else
           sum(o.flops for o in chosen.values()))
    if best is None or key < best[0]:
      best = (key, level)
  return best[1]


def _least(options, base_report: MemoryReport) -> dict:
  """The choices that save the most bytes (taken greedily by bytes at
  each recompute level), at the level of the least estimate."""
  best = None
  for level, usable in _levels(options, base_report):
    chosen = _greedy(usable, {}, lambda cost, saved, opt: -saved, level)
    if best is None or _estimate(base_report, chosen) < _estimate(
        base_report, best):
      best = chosen
  return best


def _row_path(text: str) -> tuple:
  return () if text.startswith('<') else tuple(text.split('/'))


def _options(mox, types, choices, bits, ratio, policies, measure,
             base_report, base_flops) -> list[_Option]:
  """Every applicable choice for every call path, each measured once per
  group of calls of the same type and input types."""
  groups: dict = {}
  for path, nodes in _by_path(mox).items():
    sig = (types[path], tuple(
        tuple(str(s.aval) for s in n.inputs) for n in nodes))
    groups.setdefault(sig, []).append(path)
  # A group whose calls nest is measured path by path.
  split = []
  for paths in groups.values():
    nested = any(_inside(p, q) for p in paths for q in paths if p != q)
    split.extend([[p] for p in paths] if nested else [paths])
  tries = []
  for kind in choices:
    if kind == 'remat':
      tries += [('remat', p) for p in policies]
    elif kind == 'fewbit':
      tries += [('fewbit', b) for b in bits]
    elif kind == 'randomized':
      tries.append(('randomized', ratio))
    else:
      tries.append(('lean_norm', None))
  before = {_row_path(r.path): r.bytes for r in base_report.rows}
  calls = _by_path(mox)
  out = []
  for paths in split:

    def add(kind, arg) -> tuple[int, int] | None:
      """Measures one choice on ``paths``; adds its options and returns
      ``(saved, added)`` per path, or None when it does not apply."""
      if kind == 'lean_norm' and types[paths[0]] not in ('LayerNorm',
                                                         'RMSNorm'):
        return None
      if kind != 'randomized' and not any(
          b for r, b in before.items() if _inside(r, paths[0])):
        return None  # the call keeps nothing: only a sketch saves (its input)
      try:
        tree = _apply(mox, kind, arg, paths)
      except SubstitutionError:
        # The tool refuses these calls (no activation for fewbit, no
        # kernel contraction for randomized, an unsupported norm): the
        # choice does not apply to them.
        return None
      report, flops = measure(tree, kind == 'randomized')
      saved = (base_report.total - report.total) // len(paths)
      if saved <= 0:
        return None
      added = (flops - base_flops) // len(paths)
      after = {_row_path(r.path): r.bytes for r in report.rows}
      changed = {r for r, b in before.items() if after.get(r) != b}
      for p in paths:
        # remat takes the whole call; the others the rows they change.
        rows = {r for r in before if _inside(r, p)} if kind == 'remat' \
            else {r for r in changed if _inside(r, p)}
        out.append(_Option(p, kind, arg, saved, added, frozenset(rows | {p}),
                           report.recompute))
      return saved, added

    measured = {}  # remat policy -> (saved, added)
    for kind, arg in tries:
      got = add(kind, arg)
      if kind == 'remat':
        measured[arg] = got
    singles = _save_candidates(calls[paths[0]][0]) \
        if 'remat' in choices else []
    if not singles:
      continue
    # Each value kept alone, against remat keeping nothing: the FLOPs it
    # spares per byte it keeps ranks it; the nested sets are the best
    # ranked one, two, ... (at most SAVE_SETS of them).
    plain = measured[None] if None in measured else \
        add('remat', Saves()) if 'remat' in choices else None
    if plain is None:
      continue
    ranked = []
    for single in singles:
      got = add('remat', single)
      if got is not None and plain[0] > got[0] and plain[1] > got[1]:
        ranked.append(((plain[1] - got[1]) / (plain[0] - got[0]),
                       len(ranked), single))
    ranked.sort(key=lambda r: (-r[0], r[1]))
    n = len(ranked)
    sizes = sorted({max(2, round(k * n / SAVE_SETS))
                    for k in range(1, SAVE_SETS + 1)} - {1}) if n > 1 else []
    for size in sizes:
      top = [r[2] for r in ranked[:size]]
      add('remat', Saves(tuple(x for t in top for x in t.names),
                         tuple(x for t in top for x in t.calls)))
  return out


# Primitives whose output is their input's value seen another way.
_VIEWS = frozenset((
    'reshape', 'broadcast_in_dim', 'transpose', 'squeeze', 'expand_dims',
    'convert_element_type', 'copy', 'copy_p', 'name', 'sharding_constraint'))
# Primitives linear in each input: their backward pass reads no input.
_LINEAR = frozenset((
    'add', 'sub', 'neg', 'reduce_sum', 'concatenate', 'slice',
    'dynamic_slice', 'pad', 'rev', 'add_any'))


def _save_candidates(call: Mox) -> list[Saves]:
  """The values a rematerialized ``call`` may keep, one :class:`Saves`
  each: its ``checkpoint_name`` tags and the outputs of the module calls
  under it (no call together with a call under it), ordered by the FLOPs
  of what computes the value back to the call's inputs or the nearest
  matmul or convolution, per byte. A value that is an input or an output
  of the call, no float, computed by no FLOP, or read by no equation
  that is not linear in it (so no backward pass reads it), is left out.

  Example: a block tagging ``up_proj`` (a matmul's output) and calling
  ``ln`` gives ``[Saves(('up_proj',)), Saves(calls=(('ln',),))]``.
  """
  eqns = list(leaf_equations(call))
  producer = {o: e for e in eqns for o in e.outputs}
  ends = {s for s in (*call.inputs, *call.outputs)
          if not isinstance(s, Literal)}

  def cone_flops(values) -> int:
    seen, total, stack = set(), 0, list(values)
    while stack:
      e = producer.get(stack.pop())
      if e is None or id(e) in seen:
        continue
      seen.add(id(e))
      total += _flops.equation_flops(
          e.prim.name, [s.aval for s in e.inputs],
          [s.aval for s in e.outputs], _lower.equation_params(e))
      if e.prim.name not in ('dot_general', 'conv_general_dilated'):
        stack += [s for s in e.inputs if not isinstance(s, Literal)]
    return total

  readers: dict = {}
  for e in eqns:
    for s in e.inputs:
      if not isinstance(s, Literal):
        readers.setdefault(s, []).append(e)

  def read_back(values) -> bool:
    """Whether the backward pass may read a value: some equation
    reading it (or a view of it) is not linear in it."""
    seen, stack = set(), list(values)
    while stack:
      for e in readers.get(stack.pop(), ()):
        if e.prim.name in _VIEWS and id(e) not in seen:
          seen.add(id(e))
          stack += e.outputs
        elif e.prim.name not in _VIEWS and e.prim.name not in _LINEAR:
          return True
    return False

  tagged: dict = {}  # name -> the values it tags
  for e in eqns:
    name = e.params.get('name') if e.prim.name == 'name' else None
    if isinstance(name, str) and not name.startswith('yax.'):
      tagged.setdefault(name, []).append(e.inputs[0])
  covered = {s for values in tagged.values() for s in values}
  outputs: dict = {}  # relative path -> the outputs of the calls there
  for node in iter_nodes(call):
    if isinstance(node, Mox) and not node.is_ephemeral and \
        len(node.path) > len(call.path) and \
        node.path[:len(call.path)] == call.path:
      outputs.setdefault(node.path[len(call.path):], []).extend(
          s for s in node.outputs if not isinstance(s, Literal))
  found = {(name, None): tuple(dict.fromkeys(values))
           for name, values in tagged.items()}
  for rel, values in outputs.items():
    if not covered.issuperset(values):  # not a tagged value again
      found[None, rel] = tuple(dict.fromkeys(values))
  ranked = []
  for (name, rel), values in found.items():
    if not values or any(s in ends or s.aval is None or not jax.numpy.issubdtype(
        s.aval.dtype, jax.numpy.floating) for s in values):
      continue
    kept = sum(s.aval.size * s.aval.dtype.itemsize for s in values)
    spared = cone_flops(values)
    if spared > 0 and read_back(values):
      ranked.append((-spared / kept, len(ranked), name, rel))
  ranked.sort()
  # remat saves no call together with a call under it: the better ranked.
  out, rels = [], []
  for *_, name, rel in ranked:
    if rel is None:
      out.append(Saves(names=(name,)))
    elif not any(_inside(rel, r) or _inside(r, rel) for r in rels):
      rels.append(rel)
      out.append(Saves(calls=(rel,)))
  return out


def _by_path(mox: Mox) -> dict[tuple, list[Mox]]:
  out: dict = {}
  for n in iter_nodes(mox):
    if isinstance(n, Mox) and not n.is_ephemeral:
      out.setdefault(n.path, []).append(n)
  return out


def _cheapest(cost: int, saved: int, opt: _Option):
  """Least added FLOPs per byte saved (a cost below zero counts as zero,
  and costs within 0.01 FLOP per byte as equal), then the least gradient
  error, then the deeper call (a finer choice leaves its neighbours free),
  then the larger saving."""
  return (round(max(cost, 0) / saved, 2), opt.rank, -len(opt.path), -saved)


def _next_option(options, chosen: dict, key, floor: int = 0
                 ) -> _Option | None:
  """The best option by ``key(cost, saved, option)`` (lowest first), where
  ``saved`` and ``cost`` are what it saves and adds over the chosen options
  it replaces (those whose rows meet its rows), ``saved`` net of the
  recompute transient it adds (:func:`_transient`, ``floor`` the input
  tree's); None when no option saves more than what it replaces."""
  best, best_key = None, None
  for opt in options:
    if chosen.get(opt.path) is opt:
      continue
    replaced = [o for o in chosen.values() if _meet(o, opt)]
    kept = [o for o in chosen.values() if o not in replaced]
    saved = opt.saved - sum(o.saved for o in replaced) - (
        _transient(kept + [opt], floor) - _transient(chosen.values(), floor))
    if saved <= 0:
      continue
    cost = opt.flops - sum(o.flops for o in replaced)
    k = key(cost, saved, opt)
    if best_key is None or k < best_key:
      best, best_key = opt, k
  return best


def _meet(a: _Option, b: _Option) -> bool:
  """Two options conflict when the report rows they change meet, or when
  they are the same rewrite of nested calls (the outer one already
  rewrites the inner call: a residual a scan keeps for its body is the
  scan's row, not the body's)."""
  return bool(a.rows & b.rows) or a.kind == b.kind and (
      _inside(a.path, b.path) or _inside(b.path, a.path))


def _take(chosen: dict, pick: _Option) -> None:
  for p in [p for p, o in chosen.items() if _meet(o, pick)]:
    del chosen[p]
  chosen[pick.path] = pick


def _fill(options, chosen: dict, base_report: MemoryReport,
          target: int, floor: int = 0) -> dict:
  """Options added to ``chosen`` until the estimate is at most ``target``,
  at the least added FLOPs found: the cheapest per byte saved, one after
  the other, or any one option that reaches ``target`` by itself,
  whichever adds the fewest FLOPs, then the least gradient error, then
  the least memory. The cheapest per byte alone can overshoot: remat of
  a whole stack where remat of each layer keeping its projections would
  do. When nothing reaches ``target``, the cheapest per byte to the end."""

  def run(start: dict) -> dict:
    out = dict(start)
    while _estimate(base_report, out) > target:
      pick = _next_option(options, out, _cheapest, floor)
      if pick is None:
        break
      _take(out, pick)
    return out

  tries = [run(chosen)]
  for opt in options:
    if chosen.get(opt.path) is opt:
      continue
    start = dict(chosen)
    _take(start, opt)
    if _estimate(base_report, start) <= target:
      tries.append(start)
  met = [c for c in tries if _estimate(base_report, c) <= target]
  if not met:
    return tries[0]
  return min(met, key=lambda c: (
      sum(o.flops for o in c.values()),
      sum(o.rank for o in c.values()), _estimate(base_report, c)))


def _greedy(options, chosen: dict, key, floor: int = 0) -> dict:
  """Takes options by ``key`` until none saves more (the total saved
  grows at each step, so this ends)."""
  chosen = dict(chosen)
  while (pick := _next_option(options, chosen, key, floor)) is not None:
    _take(chosen, pick)
  return chosen


def _inclusive(report: MemoryReport, path: tuple) -> int:
  total = 0
  for row in report.rows:
    row_path = () if row.path.startswith('<') else tuple(row.path.split('/'))
    if _inside(row_path, path):
      total += row.bytes
  return total


def _plan(mox, tree, chosen, base_report, report, baseline, limit, added,
          types) -> MemoryPlan:
  order = {p: i for i, p in enumerate(_by_path(mox))}
  rows = tuple(
      PlanRow(_path_text(o.path, types[o.path]), o.label,
              _inclusive(base_report, o.path), _inclusive(report, o.path),
              o.flops, o.kind in EXACT)
      for o in sorted(chosen.values(), key=lambda o: order[o.path]))
  return MemoryPlan(
      mox=tree, table=rows, memory=report.peak, baseline=baseline,
      budget=limit, added_flops=added,
      takes_sketch_key=any(o.kind == 'randomized' for o in chosen.values()),
      report=report,
      steps=tuple((o.path, o.kind, o.arg) for o in _in_order(chosen)))
