"""yax.summary and `yax summary`: names, variables, params and FLOPs compared
with Flax's own nn.tabulate and XLA's cost analysis on the same models."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from yax._src.report import flops as _flops
from yax._src.report import summary as _summary

from helpers import flops as xla_cost_flops

ANSI = re.compile(r'\x1b\[[0-9;]*m')


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    h = nn.Dense(16, name='fc')(x)
    h = nn.relu(h)
    h = nn.LayerNorm(name='ln')(h)
    return {'out': nn.Dense(4, name='proj')(h), 'hidden': h}


class Heads(nn.Module):
  """A module whose __call__ uses a helper method, as HF's attention does."""
  num_heads: int = 2

  def _split(self, x):
    return x.reshape(x.shape[:-1] + (self.num_heads, -1)) * 2.0

  @nn.compact
  def __call__(self, x):
    q = self._split(nn.Dense(8, name='q')(x))
    return q.sum(-1)


def _count(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


def _tabulate_flops(module, x) -> dict[str, int]:
  """{path: flops} parsed from nn.tabulate(..., compute_flops=True)."""
  text = nn.tabulate(module, jax.random.key(0), compute_flops=True,
                     console_kwargs={'width': 400})(x)
  out = {}
  for line in ANSI.sub('', text).splitlines():
    cells = [c.strip() for c in line.split('│')]
    if len(cells) >= 6 and cells[2] and cells[5].isdigit():
      out[cells[1]] = int(cells[5])
  return out


@pytest.fixture(scope='module')
def block():
  m = Block()
  x = jnp.ones((2, 8))
  variables = m.init(jax.random.key(0), x)
  mox = yax.make_mox(m.apply)(variables, x, deterministic=True)
  return m, x, variables, mox


def test_rows_name_inputs_outputs_and_variables(block):
  _, x, variables, mox = block
  rows = {r.path: r for r in yax.summary(mox)}
  assert list(rows) == ['', 'fc', 'ln', 'proj']
  top = rows['']
  assert top.module == 'Block' and top.method == '__call__'
  assert top.inputs == ('x: f32[2,8]', 'deterministic=True')
  # A dict output shows its keys (Flax returns dicts with sorted keys).
  assert top.outputs == ('hidden: f32[2,16]', 'out: f32[2,4]')
  assert rows['fc'].inputs == ('inputs: f32[2,8]',)  # Dense.__call__(inputs)
  assert rows['ln'].inputs == ('x: f32[2,16]',)      # LayerNorm.__call__(x, ...)
  params = variables['params']
  for path in ('fc', 'ln', 'proj'):
    want = tuple(f'{k}: f32[{",".join(map(str, v.shape))}]'
                 for k, v in sorted(params[path].items()))  # pytree order
    assert rows[path].variables == want
    assert rows[path].own_params == rows[path].params == _count(params[path])
  assert top.variables == () and top.own_params == 0
  assert top.params == _count(params)


def test_flops_match_tabulate_and_xla(block):
  m, x, _, mox = block
  rows = {r.path: r for r in yax.summary(mox)}
  tab = _tabulate_flops(m, x)
  assert set(tab) == {'', 'fc', 'ln', 'proj'}, tab
  # Dense: 2*M*N*K for the matmul plus one add per output for the bias; no
  # transcendental, so yax and Flax's XLA-based figure agree exactly.
  assert rows['fc'].flops == tab['fc'] == 2 * 2 * 8 * 16 + 2 * 16
  assert rows['proj'].flops == tab['proj'] == 2 * 2 * 16 * 4 + 2 * 4
  # LayerNorm computes one rsqrt per normalized row (2 rows). XLA counts it
  # under `transcendentals`, not `flops`; yax counts it as one FLOP each.
  assert rows['ln'].flops == tab['ln'] + 2
  assert rows[''].flops == tab[''] + 2
  # The whole model against XLA with the same convention (flops +
  # transcendentals). Before optimization the HLO is the Jaxpr one to one:
  # exact. The compiled module fuses element-wise work and recomputes some
  # of it inside fusions (here the LayerNorm statistics), which XLA counts
  # again: allow 15% above, nothing below.
  lowered = jax.jit(m.apply).lower(block[2], x)
  assert _summary.flops(mox) == _xla(lowered.cost_analysis())
  compiled = _xla(lowered.compile().cost_analysis())
  assert _summary.flops(mox) <= compiled <= 1.15 * _summary.flops(mox)
  assert _summary.xla_flops(mox) == compiled


def _xla(cost) -> float:
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return cost.get('flops', 0) + cost.get('transcendentals', 0)


class DictParam(nn.Module):
  """A param whose value is a dict of arrays."""

  @nn.compact
  def __call__(self, x):
    p = self.param('p', lambda k: {'a': jnp.ones((3,)),
                                   'b': jnp.ones((2, 3))})
    return x * p['a'] + p['b'].sum(0)


class WithDictParam(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = DictParam(name='inner')(x)
    q = self.param('q', lambda k: {'w': jnp.ones((3, 3))})
    return nn.Dense(3, name='fc')(h @ q['w'])


@pytest.mark.parametrize('hf_style', [False, True])
def test_a_param_whose_value_is_a_dict_is_counted(hf_style):
  model = WithDictParam()
  x = jnp.ones((2, 3))
  variables = model.init(jax.random.key(0), x)
  if hf_style:
    mox = yax.make_mox(lambda p, x: model.apply({'params': p}, x))(
        variables['params'], x)
  else:
    mox = yax.make_mox(model.apply)(variables, x)
  params = variables['params']
  rows = {r.path: r for r in yax.summary(mox)}
  assert rows[''].params == _count(params) == 3 + 6 + 9 + 12
  assert rows[''].own_params == _count(params['q']) == 9
  assert rows[''].variables == ('q/w: f32[3,3]',)
  assert rows['inner'].params == rows['inner'].own_params == \
      _count(params['inner']) == 9
  assert rows['inner'].variables == ('p/a: f32[3]', 'p/b: f32[2,3]')
  assert rows['fc'].params == _count(params['fc'])
  assert _summary.total_params(mox) == (_count(params), 4 * _count(params))
  assert 'Total params: 30 (120 B)' in _summary.format_summary(mox)


def test_helper_methods_are_folded_into_their_module():
  m = Heads()
  x = jnp.ones((3, 4))
  variables = m.init(jax.random.key(0), x)
  mox = yax.make_mox(m.apply)(variables, x)
  # The helper is a module call in the tree...
  helpers = [n for n in _summary.module_calls(mox) if n.entrypoint == '_split']
  assert len(helpers) == 1
  rows = yax.summary(mox)
  # ...but not a row: Heads and its Dense only.
  assert [(r.path, r.type) for r in rows] == [('', 'Heads'), ('q', 'Dense')]
  # Its work (a multiply per element) stays in the caller's count.
  compiled = jax.jit(m.apply).lower(variables, x).compile()
  assert rows[0].flops == round(xla_cost_flops(compiled))
  assert rows[0].flops == rows[1].flops + 3 * 8 + (3 * 8 - 3 * 2)


def test_method_other_than_call_shows_in_type():
  class Enc(nn.Module):
    @nn.compact
    def encode(self, x):
      return nn.Dense(3)(x)
  m = Enc()
  x = jnp.ones((1, 2))
  variables = m.init(jax.random.key(0), x, method=Enc.encode)
  mox = yax.make_mox(lambda v, x: m.apply(v, x, method=Enc.encode))(variables, x)
  (top, dense) = yax.summary(mox)
  assert top.type == 'Enc.encode' and top.inputs == ('x: f32[1,2]',)
  assert dense.type == 'Dense'


def test_other_collections_and_shared_modules():
  m = nn.BatchNorm(use_running_average=True)
  x = jnp.ones((2, 3))
  variables = m.init(jax.random.key(0), x)
  (row,) = yax.summary(yax.make_mox(m.apply)(variables, x))
  assert row.params == 6 and row.other_vars == {'batch_stats': 6}
  assert set(row.variables) == {'bias: f32[3]', 'scale: f32[3]',
                               'batch_stats/mean: f32[3]', 'batch_stats/var: f32[3]'}

  class Shared(nn.Module):
    @nn.compact
    def __call__(self, x):
      dense = nn.Dense(4)
      return dense(dense(x))
  s = Shared()
  x = jnp.ones((1, 4))
  variables = s.init(jax.random.key(0), x)
  mox = yax.make_mox(s.apply)(variables, x)
  assert [r.type for r in yax.summary(mox)] == ['Shared', 'Dense', 'Dense']
  assert _summary.total_params(mox)[0] == _count(variables['params']) == 20


def test_hf_bert_rows(tiny_bert_mox):
  rows = yax.summary(tiny_bert_mox)
  # No helper-method rows (FlaxBertSelfAttention._split_heads is folded).
  assert all(r.method == '__call__' for r in rows)
  top = rows[0]
  assert 'deterministic=True' in top.inputs
  assert top.outputs[0].startswith('last_hidden_state: f32[1,8,32]')
  (query,) = [r for r in rows if r.path == 'encoder/layer/0/attention/self/query']
  assert query.variables == ('bias: f32[32]', 'kernel: f32[32,32]')
  (self_attn,) = [r for r in rows if r.path == 'encoder/layer/0/attention/self']
  assert self_attn.own_params == 0 and self_attn.params == 3 * (32 * 32 + 32)  # q, k, v
  assert [r.path for r in yax.summary(tiny_bert_mox, depth=0)] == ['']


# ------------------------------------------------------------- FLOP rules

@pytest.mark.parametrize('name,f', [
    ('add', lambda x, y: x + y), ('div', lambda x, y: x / y),
    ('max', jnp.maximum), ('where', lambda x, y: jnp.where(x > y, x, y)),
    ('exp', lambda x, y: jnp.exp(x)), ('tanh', lambda x, y: jnp.tanh(x)),
    ('pow3', lambda x, y: x ** 3), ('sum', lambda x, y: x.sum(-1)),
    ('mean', lambda x, y: x.mean(0)), ('softmax', lambda x, y: jax.nn.softmax(x)),
    ('gelu', lambda x, y: jax.nn.gelu(x)), ('silu', lambda x, y: jax.nn.silu(x)),
    ('relu', lambda x, y: jax.nn.relu(x)), ('matmul', lambda x, y: x @ y.T),
    ('rsqrt', lambda x, y: jax.lax.rsqrt(x)), ('sigmoid', lambda x, y: jax.nn.sigmoid(x)),
])
def test_flop_rules_match_xla(name, f):
  x, y = jnp.ones((4, 8)), jnp.ones((4, 8))
  mox = yax.make_mox(f)(x, y)
  lowered = jax.jit(f).lower(x, y)
  # Exact against the unoptimized HLO: these primitives map one to one onto
  # XLA operations. The compiled figure differs by what XLA's optimizer does,
  # which depends on its version (fusion recomputation adds a few FLOPs;
  # jaxlib 0.8.0 simplifies softmax to 152 of its 156): within 10% here.
  assert _summary.flops(mox) == _xla(lowered.cost_analysis())
  compiled = _xla(lowered.compile().cost_analysis())
  assert 0.9 * _summary.flops(mox) <= compiled <= 1.1 * _summary.flops(mox)


def test_conv_and_scan_flops():
  x, w = jnp.ones((2, 3, 8, 8)), jnp.ones((5, 3, 3, 3))
  f = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), 'VALID')
  compiled = jax.jit(f).lower(x, w).compile()
  assert _summary.flops(yax.make_mox(f)(x, w)) == 2 * (2 * 5 * 6 * 6) * 27 \
      == round(xla_cost_flops(compiled))

  def g(c, xs):
    return jax.lax.scan(lambda c, x: (c @ x, None), c, xs)[0]
  c, xs = jnp.ones((2, 3)), jnp.ones((5, 3, 3))
  assert _summary.flops(yax.make_mox(g)(c, xs)) == 5 * 2 * 2 * 3 * 3


CONV_CONFIGS = [
    # lhs (NCHW), rhs (OIHW), strides, padding, lhs_dilation, rhs_dilation,
    # feature_group_count
    ((2, 3, 9, 9), (4, 3, 3, 3), (1, 1), 'SAME', (1, 1), (1, 1), 1),
    ((2, 3, 9, 9), (4, 3, 3, 3), (2, 2), 'SAME', (1, 1), (1, 1), 1),
    ((2, 3, 10, 9), (4, 3, 3, 2), (2, 3), 'VALID', (1, 1), (1, 1), 1),
    ((2, 3, 9, 9), (4, 3, 3, 3), (1, 1), 'SAME', (1, 1), (2, 2), 1),
    ((2, 3, 9, 9), (4, 3, 3, 3), (1, 1), ((2, 1), (0, 3)), (2, 2), (1, 2), 1),
    ((1, 3, 12, 11), (6, 3, 5, 4), (3, 2), ((1, -1), (2, 2)), (1, 3), (2, 1),
     1),
    ((2, 4, 9, 9), (6, 2, 3, 3), (2, 1), 'SAME', (1, 1), (3, 1), 2),
    ((1, 2, 7, 7), (3, 2, 4, 4), (3, 3), ((3, 3), (3, 3)), (2, 3), (1, 1), 1),
    ((1, 8, 16), (8, 1, 5), (1,), 'SAME', (1,), (2,), 8),  # depthwise 1-D
]


@pytest.mark.parametrize('cfg', CONV_CONFIGS)
def test_conv_flops_equal_xla_at_any_padding_stride_and_dilation(cfg):
  lhs, rhs, strides, padding, lhs_dil, rhs_dil, groups = cfg
  x = jax.random.normal(jax.random.key(0), lhs)
  w = jax.random.normal(jax.random.key(1), rhs)
  f = lambda x, w: jax.lax.conv_general_dilated(
      x, w, strides, padding, lhs_dil, rhs_dil,
      feature_group_count=groups)
  mox = yax.make_mox(f)(x, w)
  lowered = jax.jit(f).lower(x, w)
  assert _summary.flops(mox) == round(xla_cost_flops(lowered))
  assert _summary.flops(mox) == round(xla_cost_flops(lowered.compile()))


def test_conv_flops_of_flax_convs_equal_xla():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Conv(8, (3, 3), strides=2, padding='SAME', use_bias=False)(x)
      x = nn.Conv(8, (3, 3), kernel_dilation=2, padding='SAME',
                  use_bias=False)(x)
      return nn.ConvTranspose(4, (3, 3), strides=(2, 2), use_bias=False)(x)

  x = jnp.ones((2, 15, 15, 3))
  v = Net().init(jax.random.key(0), x)
  mox = yax.make_mox(Net().apply)(v, x)
  compiled = jax.jit(Net().apply).lower(v, x).compile()
  assert _summary.flops(mox) == round(xla_cost_flops(compiled))


def test_unknown_primitives_are_reported():
  prim = jax.extend.core.Primitive('yax_test_unknown')
  prim.def_impl(lambda x: x)
  prim.def_abstract_eval(lambda x: x)
  mox = yax.make_mox(lambda x: prim.bind(x) + 1.0)(jnp.ones(3))
  assert _summary.flops(mox) == 3  # the add only: unknown counts zero
  assert _flops.uncounted_primitives(
      _summary.leaf_equations(mox)) == {'yax_test_unknown'}
  text = _summary.format_summary(mox)
  assert 'Not counted (no FLOP rule): yax_test_unknown' in text


class _TopKGate(nn.Module):
  @nn.compact
  def __call__(self, x):
    values, _ = jax.lax.top_k(nn.Dense(8, name='router')(x), 2)
    return values


class _RematGate(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.remat(_TopKGate)(name='gate')(x)


def test_remat_bodies_and_top_k_are_counted():
  # Before: nn.remat's `remat2` and `top_k` had no FLOP rule; the summary
  # said so ("Not counted").
  x = jnp.ones((4, 6))
  model = _RematGate()
  variables = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(variables, x)
  assert _flops.uncounted_primitives(_summary.leaf_equations(mox)) == set()
  # The router: 2 * 4 * 6 * 8 for the matmul, 4 * 8 for the bias; top_k one
  # comparison per element of its 4 x 8 operand.
  assert _summary.flops(mox) == 2 * 4 * 6 * 8 + 4 * 8 + 4 * 8
  assert 'Not counted' not in _summary.format_summary(mox)


# --------------------------------------------------------------- rendering

def _words(row) -> set[str]:
  text = ' '.join([row.path, row.type, *row.inputs, *row.outputs, *row.variables])
  return {w for w in re.split(r'[ /=]|, ', text) if w}


@pytest.mark.parametrize('width', [60, 100, 140, None])
def test_table_fits_width_without_breaking_words(tiny_bert_mox, width):
  text = _summary.format_summary(tiny_bert_mox, title='bert', width=width)
  lines = text.splitlines()
  assert all(line == line.rstrip() for line in lines)
  if width is not None and width >= 100:
    assert max(len(line) for line in lines) <= width
  # Every word of every row appears whole on some line.
  for row in yax.summary(tiny_bert_mox):
    for word in _words(row):
      assert any(word in line for line in lines), word


def test_wrap_breaks_only_at_spaces_commas_slashes():
  assert _summary._wrap('hidden_states: f32[2,8,32]', 16) == \
      ['hidden_states:', 'f32[2,8,32]']
  assert _summary._wrap('encoder/layer/0/attention', 16) == \
      ['encoder/layer/0/', 'attention']
  assert _summary._wrap('(f32[2,3], f32[4])', 10) == ['(f32[2,3],', 'f32[4])']
  assert _summary._wrap('averyveryverylongword', 5) == ['averyveryverylongword']


# ------------------------------------------- every parameter in one row

def _nnx_models():
  from flax import nnx
  from jax.sharding import PartitionSpec as P

  class Experts(nnx.Module):  # never called: the MoE block reads its kernel
    def __init__(self):
      self.w = nnx.Param(jnp.linspace(-1.0, 1.0, 48).reshape(3, 4, 4))

  class MoE(nnx.Module):
    def __init__(self, rngs):
      self.gate = nnx.Linear(4, 3, rngs=rngs)
      self.experts = Experts()

    def __call__(self, x):
      mesh = jax.make_mesh((1,), ('x',))
      experts = jax.shard_map(
          lambda x, w: jax.nn.silu(jnp.einsum('...i,eio->...o', x, w)),
          mesh=mesh, in_specs=(P(), P()), out_specs=P())
      return experts(x, self.experts.w[...]) + self.gate(x).sum()

  class Embed(nnx.Module):
    def __init__(self):
      self.embedding = nnx.Param(jnp.linspace(0.0, 1.0, 40).reshape(10, 4))

    def __call__(self, ids):
      return self.embedding[...][ids]

  class Decoder(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, ids, shared_embedding):
      return self.lin(shared_embedding(ids))

  class Top(nnx.Module):
    """MaxText's ``self.decoder(shared_embedding=self.token_embedder)``: a
    module passed as an argument to another module's method."""

    def __init__(self, rngs):
      self.token_embedder = Embed()
      self.decoder = Decoder(rngs)
      self.moe = MoE(rngs)

    def __call__(self, ids):
      return self.moe(self.decoder(ids, shared_embedding=self.token_embedder))

  return nnx, Top


def test_every_parameter_sits_in_one_row():
  """Each parameter is the own parameter of exactly one row, and the root
  row and the total count every parameter: the embedding reached through
  an argument of another module's method, and experts read (inside a
  shard_map) from a submodule that is never called."""
  nnx, Top = _nnx_models()
  model = Top(nnx.Rngs(0))
  ids = jnp.array([[1, 2, 3]])
  mox = yax.make_mox(lambda m, ids: m(ids))(model, ids)
  n_model = sum(int(np.size(x)) for x in
                jax.tree.leaves(nnx.state(model, nnx.Param)))
  rows = {r.path: r for r in yax.summary(mox)}
  assert rows[''].params == n_model
  assert _summary.total_params(mox)[0] == n_model
  assert sum(r.own_params for r in rows.values()) == n_model
  assert rows['decoder'].params == 4 * 4 + 4 + 10 * 4
  assert rows['token_embedder'].own_params == 10 * 4
  assert rows['moe'].own_params == 3 * 4 * 4  # the experts' kernel
  assert rows['moe'].params == 3 * 4 * 4 + 4 * 3 + 3


# ------------------------------- parameters the forward never reads

def _n_leaves(tree) -> int:
  return sum(int(np.size(x)) for x in jax.tree.leaves(tree))


def _assert_each_param_in_one_row(mox, n_model, check=True):
  rows = yax.summary(mox)
  assert rows[0].params == n_model
  assert sum(r.own_params for r in rows) == n_model
  assert _summary.total_params(mox)[0] == n_model
  if check:
    yax.check_mox(mox)  # the calls' inputs stay what their bodies read
  return {r.path: r for r in rows}


class _ScanLayer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(nn.Dense(4, name='fc')(x)), None


class _Scanned(nn.Module):
  axis: int = 0  # the layer axis of the stacked params

  @nn.compact
  def __call__(self, x):
    layers = nn.scan(_ScanLayer, variable_axes={'params': self.axis},
                     split_rngs={'params': True}, length=3)
    return layers(name='layers')(x, None)[0]


class _Jitted(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4, name='a')(x)
    return nn.jit(nn.Dense)(5, name='b')(h) + nn.Dense(5, name='c')(h).sum()


@pytest.mark.parametrize('axis', [0, 1])
def test_scan_params_sit_in_one_row(axis):
  """A scanned layer's calls read one layer of the stacked kernel (the
  scan body's inputs), the call around the scan the stacked kernel: one
  param, counted once, the whole stack in the scanned calls' rows. With
  the layer axis at 1 the scan reads the kernel transposed (layer axis
  first): still that param."""
  m, x = _Scanned(axis), jnp.ones((2, 4))
  variables = m.init(jax.random.key(0), x)
  mox = yax.make_mox(m.apply)(variables, x)
  n_model = _n_leaves(variables['params'])
  assert n_model == 3 * (4 * 4 + 4)
  # check_mox refuses the axis-1 trace (open, not the summary's): the
  # transpose in _Scanned's body reads a param _Scanned does not list.
  rows = _assert_each_param_in_one_row(mox, n_model, check=axis == 0)
  assert rows['layers'].params == n_model
  assert rows['layers/fc'].own_params == rows['layers/fc'].params == n_model


def test_jit_params_sit_in_one_row():
  """Params read by calls inside an ``nn.jit`` body are the params the
  equation around it receives: counted once."""
  m, x = _Jitted(), jnp.ones((2, 3))
  variables = m.init(jax.random.key(0), x)
  mox = yax.make_mox(m.apply)(variables, x)
  params = variables['params']
  rows = _assert_each_param_in_one_row(mox, _n_leaves(params))
  assert rows['b'].own_params == rows['b'].params == _n_leaves(params['b'])


def test_a_tied_head_kernel_never_read_sits_in_the_root_row():
  """An NNX head tied to the embedding (the logits use the embedding's
  transpose) that still owns a kernel, as EasyDeL's Gemma 2: the kernel is
  read by no call, yet it is the model's, so the root row and the total
  count it, marked unread."""
  from flax import nnx

  class Embed(nnx.Module):
    def __init__(self):
      self.embedding = nnx.Param(jnp.linspace(-1.0, 1.0, 40).reshape(10, 4))

    def __call__(self, ids):
      return self.embedding[...][ids]

  class TiedLM(nnx.Module):
    def __init__(self, rngs):
      self.embed = Embed()
      self.lin = nnx.Linear(4, 4, rngs=rngs)
      self.lm_head = nnx.Linear(4, 10, use_bias=False, rngs=rngs)

    def __call__(self, ids):
      return self.lin(self.embed(ids)) @ self.embed.embedding[...].T

  model = TiedLM(nnx.Rngs(0))
  ids = jnp.array([[1, 2, 3]])
  expected = model(ids)
  model.lm_head.kernel[...] = model.lm_head.kernel[...] + 1.0
  np.testing.assert_array_equal(model(ids), expected)  # truly never read
  mox = yax.make_mox(lambda m, ids: m(ids))(model, ids)
  rows = _assert_each_param_in_one_row(
      mox, _n_leaves(nnx.state(model, nnx.Param)))
  top = rows['']
  assert top.unread_params == top.own_params == 4 * 10
  assert 'lm_head/kernel: f32[4,10] (unread)' in top.variables
  assert all(r.unread_params == 0 for r in rows.values() if r.path)
  text = _summary.format_summary(mox)
  assert 'Total params: 100 (400 B), 40 of them read by no module call' in text


def test_unread_params_are_counted_next_to_a_picky_argument():
  """The unread params come from the traced arguments' key paths. A pytree
  node of the user's whose unflatten refuses placeholder leaves (Picky,
  a second argument) used to drop them all from the totals (the summary
  said 20 params for a model of 40)."""
  from helpers import Picky

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, aux: bool = False):
      y = nn.Dense(4, name='main')(x)
      return y + nn.Dense(4, name='aux')(x) if aux else y

  x = jnp.ones((1, 4))
  variables = Block().init(jax.random.key(0), x, aux=True)
  mox = yax.make_mox(lambda v, p, x: Block().apply(v, x) * p.w)(
      variables, Picky(jnp.ones(4)), x)
  params = variables['params']
  rows = yax.summary(mox)
  assert rows[0].params == _n_leaves(params) == 40
  assert rows[0].unread_params == _n_leaves(params['aux']) == 20
  assert _summary.total_params(mox)[0] == 40


def test_a_linen_submodule_never_called_sits_in_its_parent_row():
  """A Linen submodule created at init but not called on the traced path
  (``aux=False``): its params are the owning module's, unread; the rows
  above count them too."""

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, aux: bool = False):
      y = nn.Dense(4, name='main')(x)
      return y + nn.Dense(4, name='aux')(x) if aux else y

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, aux: bool = False):
      return nn.Dense(2, name='head')(Block(name='block')(x, aux))

  x = jnp.ones((1, 4))
  variables = Net().init(jax.random.key(0), x, aux=True)
  mox = yax.make_mox(Net().apply)(variables, x)
  params = variables['params']
  rows = _assert_each_param_in_one_row(mox, _n_leaves(params))
  n_aux = _n_leaves(params['block']['aux'])
  assert rows['block'].unread_params == rows['block'].own_params == n_aux
  assert rows['block'].params == _n_leaves(params['block'])
  assert set(rows['block'].variables) == {
      'aux/bias: f32[4] (unread)', 'aux/kernel: f32[4,4] (unread)'}
  assert rows['block/main'].params == _n_leaves(params['block']['main'])
  assert rows[''].unread_params == rows['head'].unread_params == 0


class _CheckedLeaf:
  """A pytree container that takes only arrays as its leaf (its unflatten
  checks), as some libraries' parameter containers do."""

  def __init__(self, w):
    if not isinstance(w, (jax.Array, np.ndarray)):
      raise TypeError(f'a _CheckedLeaf holds an array, not {type(w).__name__}')
    self.w = w


jax.tree_util.register_pytree_node(
    _CheckedLeaf, lambda c: ((c.w,), None), lambda _, xs: _CheckedLeaf(*xs))


def test_a_variable_tree_that_cannot_be_rebuilt_is_refused_by_name():
  # Before: the call's variables became one group named 'variables'
  # (not 'params'), so its parameters were silently left out of the
  # parameter counts.
  x = jnp.ones((1, 3))
  variables = nn.Dense(2).init(jax.random.key(0), x)
  mox = yax.make_mox(nn.Dense(2).apply)(variables, x)
  (dense,) = yax.query('//module_call[@type="Dense"]', mox)
  assert set(_summary.variable_groups(dense)) == {'params'}
  odd = dense.replace(var_tree=jax.tree.structure(
      {'params': {'bias': _CheckedLeaf(np.zeros(2)),
                  'kernel': np.zeros((3, 2))}}))
  with pytest.raises(yax.YaxError) as info:
    _summary.variable_groups(odd)
  message = str(info.value)
  assert "Dense call at '<root>'" in message, message
  assert 'a _CheckedLeaf holds an array' in message, message
