"""yax.fit_memory on a small Linen stack of pre-norm MLP blocks: each plan's
training memory checked by JAX's own saved_residuals (independently of
memory_report), gradients against jax.grad of the plain model, refusal
below the least reachable memory, and less recompute than the same model
written with nn.remat on every block at the same memory (XLA's cost
analysis)."""

from __future__ import annotations

import contextlib
import io
import math
import re

import flax.linen as nn
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from helpers import assert_trees_close, check_rewrite


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name='ln')(x)
    h = jax.nn.gelu(nn.Dense(32, name='up')(h))
    return x + nn.Dense(8, name='down')(h)


class Net(nn.Module):
  block: type = Block
  depth: int = 2

  @nn.compact
  def __call__(self, x):
    for i in range(self.depth):
      x = self.block(name=f'b{i}')(x)
    return x


X = jax.random.normal(jax.random.key(1), (16, 8))
NET = Net()
VARS = NET.init(jax.random.key(0), X)
PARAM_BYTES = sum(a.nbytes for a in jax.tree_util.tree_leaves(VARS))
EXACT = ('lean_norm', 'remat')


def out_loss(y):
  return jnp.sum(jnp.sin(y))


def plain_loss(p):
  return out_loss(NET.apply(p, X))


ITEMSIZE = {'key<fry>': 8, 'f32': 4, 'f16': 2, 'bf16': 2, 'i32': 4,
            'u32': 4, 'u8': 1, 'i8': 1, 'bool': 1}


def training_memory(fn, params) -> int:
  """4 x param bytes + what JAX's print_saved_residuals lists (arguments,
  constants and literals excluded: they take no memory of their own)."""
  return 4 * PARAM_BYTES + kept_bytes(fn, params)


def kept_bytes(fn, params) -> int:
  """What JAX's print_saved_residuals of ``fn`` lists (arguments,
  constants and literals excluded)."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    jax.ad_checkpoint.print_saved_residuals(fn, params)
  kept = 0
  for line in buf.getvalue().splitlines():
    kind, _, src = line.partition(' ')
    if not line or src.startswith(('from the argument', 'from a constant',
                                   'from a literal')):
      continue
    # A typed PRNG key (the sketch's): threefry's two uint32 words.
    dtype, dims = re.fullmatch(r'(\w+|key<fry>)\[([\d,]*)\]', kind).groups()
    kept += math.prod(int(d) for d in dims.split(',') if d) * ITEMSIZE[dtype]
  return kept


def remat_transient(variables, i, policy=None, block=Block) -> int:
  """What block ``b{i}`` under jax.checkpoint keeps while its own backward
  pass recomputes it: its residuals without the checkpoint minus with
  (differentiated with respect to its params and, past the first block,
  its input, which then depends on the params)."""
  params = variables['params']
  h = X
  for j in range(i):
    h = block().apply({'params': params[f'b{j}']}, h)

  def body(p, h):
    return block().apply({'params': p}, h)

  kept = jax.checkpoint(body, policy=policy)
  if i == 0:
    return kept_bytes(lambda p: body(p, X), params['b0']) - \
        kept_bytes(lambda p: kept(p, X), params['b0'])
  args = (params[f'b{i}'], h)
  return kept_bytes(lambda a: body(*a), args) - \
      kept_bytes(lambda a: kept(*a), args)


POLICIES = {'remat': None,
            'remat(dots_saveable)': jax.checkpoint_policies.dots_saveable}


class TaggedBlock(nn.Module):
  """Block with each call's output named after the call, to write by hand
  a remat that keeps some of them."""

  @nn.compact
  def __call__(self, x):
    tag = jax.ad_checkpoint.checkpoint_name
    h = tag(nn.LayerNorm(name='ln')(x), 'ln')
    h = jax.nn.gelu(tag(nn.Dense(32, name='up')(h), 'up'))
    return x + tag(nn.Dense(8, name='down')(h), 'down')


def choice_transient(variables, i, choice) -> int:
  """remat_transient of block ``b{i}`` for a plan's choice: a policy, or
  ``remat(save: up,ln)`` (keeping those calls' outputs)."""
  if choice.startswith('remat(save: '):
    names = choice[len('remat(save: '):-1].split(',')
    return remat_transient(
        variables, i, jax.checkpoint_policies.save_only_these_names(*names),
        block=TaggedBlock)
  return remat_transient(variables, i, POLICIES[choice])


def xla_flops(fn, params) -> float:
  cost = jax.jit(jax.grad(fn)).lower(params).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return cost['flops']


@pytest.fixture(scope='module')
def mox():
  return yax.make_mox(NET.apply)(VARS, X)


BASELINE = training_memory(plain_loss, VARS)


def test_exact_plan_meets_the_budget_with_less_recompute_than_remat(mox):
  # The reference: the same model written with nn.remat on every block.
  remat_net = Net(block=nn.remat(Block))

  def remat_loss(p):
    return out_loss(remat_net.apply(p, X))

  # Its peak: while a block's backward pass runs, its body's residuals
  # are live again.
  remat_memory = training_memory(remat_loss, VARS) + max(
      remat_transient(VARS, i) for i in range(2))
  assert remat_memory < BASELINE
  budget = (remat_memory + BASELINE) // 2
  plan = yax.fit_memory(mox, out_loss, budget=budget, choices=EXACT)
  check_rewrite(plan.mox)
  assert plan.baseline == BASELINE and plan.budget == budget

  def planned(p):
    return out_loss(yax.eval_mox(plan.mox, p, X))

  # JAX's own residuals say the same memory as the plan, within budget:
  # what the step keeps, and the largest rematerialized block's body.
  assert all(r.path in ('b0', 'b1') for r in plan.table
             if r.choice.startswith('remat'))
  transient = max([choice_transient(VARS, int(r.path[1:]), r.choice)
                   for r in plan.table if r.choice.startswith('remat')],
                  default=0)
  assert training_memory(planned, VARS) + transient == plan.memory <= budget
  assert plan.memory == plan.report.peak
  assert plan.table and all(r.exact for r in plan.table)
  assert not plan.takes_sketch_key
  np.testing.assert_allclose(yax.eval_mox(plan.mox, VARS, X),
                             NET.apply(VARS, X), rtol=1e-5, atol=1e-5)
  assert_trees_close(jax.grad(planned)(VARS), jax.grad(plain_loss)(VARS),
                     rtol=1e-5, atol=1e-5)
  # Remat of every block meets the budget too, recomputing more (XLA's
  # cost analysis of the compiled gradients).
  plain = xla_flops(plain_loss, VARS)
  assert plain < xla_flops(planned, VARS) < xla_flops(remat_loss, VARS)
  text = str(plan)
  for row in plan.table:
    assert row.path in text and row.choice in text
    assert row.after < row.before
  assert f'{plan.memory:,}' in text
  # The same choices on a trace at another batch size.
  x2 = jax.random.normal(jax.random.key(2), (5, 8))
  other = check_rewrite(plan.apply(yax.make_mox(NET.apply)(VARS, x2)))
  assert_trees_close(
      jax.grad(lambda p: out_loss(yax.eval_mox(other, p, x2)))(VARS),
      jax.grad(lambda p: out_loss(NET.apply(p, x2)))(VARS),
      rtol=1e-5, atol=1e-5)


def test_tight_budget_remats_each_block_not_the_whole_stack():
  # Remat of the whole stack keeps almost nothing between the passes,
  # but its backward pass recomputes every block at once: its peak is
  # the baseline's. At the peak of remat on each block (by hand), the
  # plan is remat on each block.
  net, per_block = Net(depth=4), Net(block=nn.remat(Block), depth=4)
  variables = net.init(jax.random.key(0), X)
  params = sum(a.nbytes for a in jax.tree_util.tree_leaves(variables))
  budget = 4 * params + kept_bytes(
      lambda p: out_loss(per_block.apply(p, X)), variables) + max(
          remat_transient(variables, i) for i in range(4))
  plan = yax.fit_memory(yax.make_mox(net.apply)(variables, X), out_loss,
                        budget=budget, choices=('remat',), policies=(None,))
  check_rewrite(plan.mox)
  assert [(r.path, r.choice) for r in plan.table] == [
      (f'b{i}', 'remat') for i in range(4)]
  assert plan.memory == budget
  assert_trees_close(
      jax.grad(lambda p: out_loss(yax.eval_mox(plan.mox, p, X)))(variables),
      jax.grad(lambda p: out_loss(net.apply(p, X)))(variables),
      rtol=1e-5, atol=1e-5)


def test_plan_with_approximate_choices_meets_the_budget(mox):
  # 0.5 is below the peak these choices reach (a rematerialized block
  # recomputes its body: ~0.54 of the baseline at best).
  plan = yax.fit_memory(mox, out_loss, budget=0.65)
  check_rewrite(plan.mox)
  key = jax.random.key(3)
  extra = {'sketch_key': key} if plan.takes_sketch_key else {}

  def planned(p):
    return out_loss(yax.eval_mox(plan.mox, p, X, **extra))

  assert training_memory(planned, VARS) == plan.memory <= plan.budget
  assert any(not r.exact for r in plan.table)
  # Every rewrite keeps the forward pass; the gradient is approximate
  # (few-bit activations, a sketched kernel gradient) but close.
  np.testing.assert_allclose(yax.eval_mox(plan.mox, VARS, X, **extra),
                             NET.apply(VARS, X), rtol=1e-5, atol=1e-5)
  # A sketched kernel gradient is unbiased, not close for one key on rows
  # this few: the mean over 8 keys is what tends to the (few-bit) gradient.
  keys = range(8) if plan.takes_sketch_key else range(1)

  def grad_with(seed):
    extra = ({'sketch_key': jax.random.key(seed)} if plan.takes_sketch_key
             else {})
    return jax.grad(lambda p: out_loss(
        yax.eval_mox(plan.mox, p, X, **extra)))(VARS)

  got = sum(jnp.concatenate([g.ravel() for g in jax.tree_util.tree_leaves(
      grad_with(seed))]) for seed in keys) / len(keys)
  want = jnp.concatenate([g.ravel() for g in jax.tree_util.tree_leaves(
      jax.grad(plain_loss)(VARS))])
  cosine = got @ want / (jnp.linalg.norm(got) * jnp.linalg.norm(want))
  assert cosine > 0.9


def test_refuses_below_the_least_memory_and_leaves_the_tree(mox):
  before = io.StringIO()
  yax.dump_xml(mox, before)
  with pytest.raises(yax.SubstitutionError) as info:
    yax.fit_memory(mox, out_loss, budget=0.2, choices=EXACT)
  message = str(info.value)
  assert f'budget {int(0.2 * BASELINE):,} bytes (0.200 of' in message
  least, fraction = re.search(
      r'reach: ([\d,]+) bytes \(([\d.]+) of the baseline\)', message).groups()
  least = int(least.replace(',', ''))
  assert fraction == f'{least / BASELINE:.3f}'
  after = io.StringIO()
  yax.dump_xml(mox, after)
  assert after.getvalue() == before.getvalue()
  # The memory it names is reached.
  plan = yax.fit_memory(mox, out_loss, budget=least, choices=EXACT)
  check_rewrite(plan.mox)
  assert training_memory(
      lambda p: out_loss(yax.eval_mox(plan.mox, p, X)), VARS) <= least
  with pytest.raises(yax.SubstitutionError, match=f'{least - 1:,} bytes'):
    yax.fit_memory(mox, out_loss, budget=least - 1, choices=EXACT)


def test_budget_at_or_above_the_baseline_changes_nothing(mox):
  plan = yax.fit_memory(mox, out_loss, budget=BASELINE)
  assert plan.mox is mox and plan.table == () and plan.memory == BASELINE


@pytest.mark.parametrize('budget', [0.0, 1.0, 1.5, -3, True, '0.5'])
def test_refuses_a_budget_that_is_no_bytes_or_fraction(mox, budget):
  with pytest.raises(yax.SubstitutionError, match='budget'):
    yax.fit_memory(mox, out_loss, budget=budget)


def test_refuses_unknown_choices(mox):
  with pytest.raises(yax.SubstitutionError, match='offload'):
    yax.fit_memory(mox, out_loss, budget=0.5, choices=('offload',))
  with pytest.raises(yax.SubstitutionError, match=r'bits \[5\]'):
    yax.fit_memory(mox, out_loss, budget=0.5, bits=(5,))
  with pytest.raises(yax.SubstitutionError, match='ratio 1.5'):
    yax.fit_memory(mox, out_loss, budget=0.5, ratio=1.5)
  with pytest.raises(yax.SubstitutionError, match='unknown policy'):
    yax.fit_memory(mox, out_loss, budget=0.5, policies=('no_such',))


def test_several_sketched_calls_share_one_key(mox):
  # Sketching each down projection saves about 1 KB here: a budget that
  # needs more than one sketched call (each randomized_linear adds the
  # sketch_key argument, so they are made in one rewrite).
  plan = yax.fit_memory(mox, out_loss, budget=BASELINE - 1500,
                        choices=('randomized',))
  check_rewrite(plan.mox)
  assert len(plan.table) >= 2 and plan.takes_sketch_key
  key = jax.random.key(0)
  assert training_memory(
      lambda p: out_loss(yax.eval_mox(plan.mox, p, X, sketch_key=key)),
      VARS) == plan.memory <= plan.budget


class ScanCell(nn.Module):
  """A scanned layer: its GELU input is kept by the scan (the enclosing
  call's row); the loop-invariant ``cos(pos)`` is the cell's own row."""

  @nn.compact
  def __call__(self, x, pos):
    h = jax.nn.gelu(nn.Dense(32, name='up')(x) * jnp.cos(pos))
    return x + nn.Dense(8, name='down')(h), None


class ScanStack(nn.Module):
  @nn.compact
  def __call__(self, x):
    pos = jnp.arange(x.shape[0], dtype=x.dtype)[:, None]
    x, _ = nn.scan(ScanCell, variable_axes={'params': 0},
                   split_rngs={'params': True}, in_axes=nn.broadcast,
                   length=3)(name='cells')(x, pos)
    return x


def test_same_rewrite_of_nested_calls_is_chosen_once():
  # Before: fewbit of 'stack' (the scan's owner) and of 'stack/cells'
  # were both chosen (their report rows do not meet) and applying the
  # second raised fewbit's "found no supported activation" instead of a
  # plan or the budget's refusal.
  class Top(nn.Module):
    @nn.compact
    def __call__(self, x):
      return ScanStack(name='stack')(x)

  x = jax.random.normal(jax.random.key(1), (64, 8))
  top = Top()
  variables = top.init(jax.random.key(0), x)
  param_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(variables))
  scan_mox = yax.make_mox(top.apply)(variables, x)

  def kept(fn) -> int:  # JAX's own residuals, as training_memory counts
    return training_memory(fn, variables) - 4 * PARAM_BYTES + \
        4 * param_bytes

  baseline = kept(lambda p: out_loss(top.apply(p, x)))
  with pytest.raises(yax.SubstitutionError,
                     match='below the least peak training memory') as info:
    yax.fit_memory(scan_mox, out_loss, budget=0.3, choices=('fewbit',))
  least = int(re.search(r'reach: ([\d,]+) bytes', str(info.value))
              .group(1).replace(',', ''))
  plan = yax.fit_memory(scan_mox, out_loss, budget=least,
                        choices=('fewbit',))
  check_rewrite(plan.mox)
  assert len(plan.table) == 1 and plan.baseline == baseline
  assert kept(lambda p: out_loss(yax.eval_mox(plan.mox, p, x))) == \
      plan.memory <= least < baseline
  np.testing.assert_allclose(yax.eval_mox(plan.mox, variables, x),
                             top.apply(variables, x), rtol=1e-5, atol=1e-5)


class NamedBlock(nn.Module):
  """Block with its up projection tagged, as MaxText tags its projections."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name='ln')(x)
    h = jax.ad_checkpoint.checkpoint_name(nn.Dense(32, name='up')(h),
                                          'up_proj')
    return x + nn.Dense(8, name='down')(jax.nn.gelu(h))


def test_tight_budget_keeps_a_named_value_with_less_recompute_than_remat():
  # Before: remat offered only whole-call policies, so a budget below
  # "keep the up projection" ended at remat of every block (or of the
  # whole net), recomputing the projections too.
  net = Net(block=NamedBlock)
  plain = lambda p: out_loss(net.apply(p, X))
  # The references, written by hand: every block under nn.remat, keeping
  # nothing, or keeping the tagged value.
  every = Net(block=nn.remat(NamedBlock))
  keep_up = Net(block=nn.remat(
      NamedBlock,
      policy=jax.checkpoint_policies.save_only_these_names('up_proj')))
  every_loss = lambda p: out_loss(every.apply(p, X))
  keep_up_loss = lambda p: out_loss(keep_up.apply(p, X))
  only_up = jax.checkpoint_policies.save_only_these_names('up_proj')
  # Peaks: what the step keeps, and the largest block's body while its
  # backward pass recomputes it.
  baseline = training_memory(plain, VARS)
  every_memory = training_memory(every_loss, VARS) + max(
      remat_transient(VARS, i, block=NamedBlock) for i in range(2))
  budget = training_memory(keep_up_loss, VARS) + max(
      remat_transient(VARS, i, only_up, block=NamedBlock) for i in range(2))
  assert every_memory < budget < baseline

  mox = yax.make_mox(net.apply)(VARS, X)
  plan = yax.fit_memory(mox, out_loss, budget=budget, choices=('remat',),
                        policies=(None,))
  check_rewrite(plan.mox)
  planned = lambda p: out_loss(yax.eval_mox(plan.mox, p, X))
  assert training_memory(planned, VARS) <= plan.memory <= budget
  assert plan.memory == plan.report.peak
  assert any('save: up_proj' in r.choice for r in plan.table), str(plan)
  assert_trees_close(jax.grad(planned)(VARS), jax.grad(plain)(VARS),
                     rtol=1e-5, atol=1e-5)
  # Less recompute than remat of every block, which fits the budget too.
  assert xla_flops(planned, VARS) < xla_flops(every_loss, VARS)
