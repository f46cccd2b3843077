"""eval_mox, to_jaxpr and map_mox against the traced functions themselves."""

import gc
import re
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp

import pytest

import yax
from helpers import assert_trees_close, flops, jit_call, jit_eval, modules
from yax._src.ir.nodes import iter_nodes

KEY = jax.random.key(0)


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(16)(x))
    h = nn.LayerNorm()(h)
    h = h + nn.silu(nn.Dense(16)(h))
    return nn.Dense(3)(nn.gelu(h))


@pytest.fixture(scope='module')
def net():
  model = Net()
  x = jax.random.normal(jax.random.key(1), (4, 5))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)
  return model, variables, x, mox


def test_eager_and_jit(net):
  model, variables, x, mox = net
  expected = model.apply(variables, x)
  assert_trees_close(yax.eval_mox(mox, variables, x), expected)
  assert_trees_close(jit_eval(mox)(variables, x), expected)
  # New values with the traced shapes.
  x2 = jax.random.normal(jax.random.key(2), x.shape)
  v2 = model.init(jax.random.key(3), x)
  assert_trees_close(yax.eval_mox(mox, v2, x2), model.apply(v2, x2))


def test_vmap_over_batch_of_examples(net):
  model, variables, _, _ = net
  one = jnp.ones((5,))
  mox = yax.make_mox(model.apply)(variables, one)  # traced on one example
  batch = jax.random.normal(jax.random.key(4), (7, 5))
  got = jax.vmap(lambda x: yax.eval_mox(mox, variables, x))(batch)
  expected = jax.vmap(lambda x: model.apply(variables, x))(batch)
  assert got.shape == (7, 3)
  assert_trees_close(got, expected)
  got = jax.jit(jax.vmap(yax.eval_mox, in_axes=(None, None, 0)),
                static_argnums=0)(mox, variables, batch)
  assert_trees_close(got, expected)


def test_grad_wrt_params(net):
  model, variables, x, mox = net

  def loss(fn):
    return lambda v: jnp.mean(fn(v, x) ** 2)

  expected = jax.grad(loss(model.apply))(variables)
  got = jax.grad(loss(lambda v, x: yax.eval_mox(mox, v, x)))(variables)
  assert_trees_close(got, expected, rtol=1e-4, atol=1e-6)
  got = jax.jit(jax.grad(loss(lambda v, x: yax.eval_mox(mox, v, x))))(variables)
  assert_trees_close(got, expected, rtol=1e-4, atol=1e-6)
  # Gradient w.r.t. the input as well.
  gx = jax.grad(lambda x: yax.eval_mox(mox, variables, x).sum())(x)
  assert_trees_close(gx, jax.grad(lambda x: model.apply(variables, x).sum())(x),
                     rtol=1e-4, atol=1e-6)


def test_inside_lax_scan_body(net):
  model, variables, x, mox = net
  xs = jax.random.normal(jax.random.key(5), (6,) + x.shape)

  def body(fn):
    def step(carry, xi):
      y = fn(variables, xi)
      return carry + y.sum(), y
    return step

  expected = jax.lax.scan(body(model.apply), 0.0, xs)
  got = jax.lax.scan(body(lambda v, x: yax.eval_mox(mox, v, x)), 0.0, xs)
  assert_trees_close(got, expected, rtol=1e-4, atol=1e-4)


def test_dtypes_other_than_float32():
  model = nn.Dense(4, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  x = jnp.ones((2, 3), jnp.bfloat16)
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)
  out = yax.eval_mox(mox, variables, x)
  assert out.dtype == jnp.bfloat16
  assert_trees_close(out, model.apply(variables, x))
  ids = jnp.array([[1, 2, 3]], jnp.int32)
  emb = nn.Embed(10, 4)
  ev = emb.init(KEY, ids)
  mox = yax.make_mox(emb.apply)(ev, ids)
  assert_trees_close(yax.eval_mox(mox, ev, ids), emb.apply(ev, ids))


# --------------------------------------------------------------- errors

def test_wrong_argument_tree(net):
  model, variables, x, mox = net
  # The message names the first argument path that differs, not treedefs.
  with pytest.raises(yax.SignatureError, match=r'argument tree differs .* at '
                     r'args\[1\]: missing\n  expected: f32\[4,5\]'):
    yax.eval_mox(mox, variables)
  with pytest.raises(yax.SignatureError, match=re.escape(
      "args[0]['params']['Dense_1']['bias']: missing")):
    yax.eval_mox(mox, {'params': {'Dense_0': variables['params']['Dense_0']}},
                 x)
  with pytest.raises(yax.SignatureError, match=r'argument tree differs .* at '
                     r'args\[1\]: missing'):
    yax.eval_mox(mox, variables, x=x)
  assert issubclass(yax.SignatureError, yax.YaxError)


def test_wrong_shape_names_position(net):
  model, variables, x, mox = net
  with pytest.raises(yax.SignatureError,
                     match=r'argument args\[1\] does not match.*\n'
                     r'  expected: f32\[4,5\]\n  given:    f32\[3,5\]'):
    yax.eval_mox(mox, variables, x[:3])
  bad = jax.tree_util.tree_map(lambda p: p, variables)
  bad['params']['Dense_1']['kernel'] = jnp.ones((16, 2))
  with pytest.raises(yax.SignatureError,
                     match=r"args\[0\]\['params'\]\['Dense_1'\]\['kernel'\]"
                     r'.*\n  expected: f32\[16,16\]\n  given:    f32\[16,2\]'):
    yax.eval_mox(mox, bad, x)


def test_wrong_dtype(net):
  model, variables, x, mox = net
  with pytest.raises(yax.SignatureError,
                     match=r'args\[1\].*\n  expected: f32\[4,5\]\n'
                     r'  given:    i32\[4,5\]'):
    yax.eval_mox(mox, variables, x.astype(jnp.int32))
  with pytest.raises(yax.SignatureError,
                     match=r"args\[1\].*\n  expected: f32\[4,5\]\n"
                     r"  given:    str 'x'"):
    yax.eval_mox(mox, variables, 'x')


def test_wrong_static_value():
  fn = lambda x, mode='sum', flag=True: (x.sum() if mode == 'sum'
                                         else x.max()) * (2 if flag else 1)
  x = jnp.arange(3.0)
  mox = yax.make_mox(fn)(x, mode='sum', flag=True)
  assert float(yax.eval_mox(mox, x, mode='sum', flag=True)) == 6.0
  with pytest.raises(yax.SignatureError,
                     match=r"argument kwargs\['mode'\] does not match.*\n"
                     r"  expected: static value 'sum' .*\n  given:    'max'"):
    yax.eval_mox(mox, x, mode='max', flag=True)
  with pytest.raises(yax.SignatureError,
                     match=r"kwargs\['flag'\].*\n  expected: static value "
                     r'True .*\n  given:    False'):
    yax.eval_mox(mox, x, mode='sum', flag=False)
  # 1 == True in Python, but a number is not the traced bool.
  with pytest.raises(yax.SignatureError, match=r"kwargs\['flag'\]"):
    yax.eval_mox(mox, x, mode='sum', flag=1)


def test_eval_requires_a_mox():
  with pytest.raises(yax.SignatureError, match='expects a Mox.*found int'):
    yax.eval_mox(3, jnp.ones(2))


# ----------------------------------------------------- to_jaxpr, map_mox

def test_to_jaxpr_equivalent(net):
  model, variables, x, mox = net
  closed = yax.to_jaxpr(mox)
  assert isinstance(closed, jax.extend.core.ClosedJaxpr)
  leaves = jax.tree_util.tree_leaves((variables, x))
  assert len(closed.jaxpr.invars) == len(leaves)
  out = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *leaves)
  expected = jax.tree_util.tree_leaves(model.apply(variables, x))
  assert_trees_close(out, expected)
  # No markers and no module calls are left; the same equations as JAX.
  prims = [e.primitive.name for e in closed.jaxpr.eqns]
  ref = jax.make_jaxpr(model.apply)(variables, x)
  assert prims == [e.primitive.name for e in ref.jaxpr.eqns]
  assert not any(p.startswith('yax_') or p == 'module_call' for p in prims)
  assert str(closed) == str(ref)


def test_to_jaxpr_with_static_inputs_and_lifted_bodies():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, c, _):
      return nn.Dense(3)(c), None

  class M(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
      x, _ = nn.scan(Block, variable_axes={'params': 0},
                     split_rngs={'params': True}, length=2)()(x, None)
      return nn.Dropout(0.1, deterministic=not train)(x)

  model = M()
  x = jnp.ones((2, 3))
  variables = model.init(KEY, x, False)
  mox = yax.make_mox(model.apply)(variables, x, False)
  closed = yax.to_jaxpr(mox)
  leaves = jax.tree_util.tree_leaves(variables) + [x]
  assert len(closed.jaxpr.invars) == len(leaves)  # the static bool is baked in
  out = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *leaves)
  assert_trees_close(out[0], model.apply(variables, x, False))
  text = str(closed)
  assert 'yax_enter' not in text and 'yax_exit' not in text


def test_map_mox_is_preorder(net):
  *_, mox = net
  seen = yax.map_mox(lambda n: n, mox)
  assert seen[0] is mox

  def expected(node):
    out = [node]
    for c in getattr(node, 'children', ()):
      out += expected(c)
    return out

  # The tree's own nodes in pre-order; besides them, only the equations
  # in the bodies of equations that hold a Jaxpr calling no module
  # (nn.silu's jit), right after their equation (where a pattern match can
  # lie); the body itself is no module call, so no Mox for it.
  own = {id(n) for n in expected(mox)}
  assert [id(n) for n in seen if id(n) in own] == [id(n) for n in
                                                   expected(mox)]
  silu, = yax.query('//*[@name="silu"]', mox)
  at = next(i for i, n in enumerate(seen) if n is silu)
  extra = [n for n in seen if id(n) not in own]
  assert seen[at + 1:at + 1 + len(extra)] == extra
  assert all(isinstance(n, yax.Equation) for n in extra)
  assert {e.prim.name for e in extra} == {'logistic', 'mul'}
  # jax.nn.silu(x) = x * sigmoid(x): what the body computes.
  assert sorted(e.prim.name for e in extra) == ['logistic', 'mul']
  labels = yax.map_mox(
      lambda n: n.type_name if isinstance(n, yax.Mox) else n.prim.name, mox)
  top = labels.index('Net')
  assert labels[top + 1] == 'Dense' and labels[top + 2] == 'dot_general'


# ----------------------------------------------------------------- FLOPs

def test_jit_compiles_to_same_flops(net):
  model, variables, x, mox = net
  fn = jax.jit(model.apply).lower(variables, x).compile()
  ev = jax.jit(lambda *a: yax.eval_mox(mox, *a)).lower(variables, x).compile()
  assert flops(fn) > 0
  assert flops(ev) == flops(fn)
  ref_hlo = jax.jit(model.apply).lower(variables, x).as_text()
  got_hlo = jax.jit(lambda *a: yax.eval_mox(mox, *a)).lower(
      variables, x).as_text()
  count = lambda text: sum(1 for line in text.splitlines() if ' = stablehlo.'
                           in line or ' = "stablehlo.' in line)
  assert count(got_hlo) == count(ref_hlo)


def test_flops_with_batchnorm_and_mutable():
  class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Conv(4, (3, 3))(x)
      x = nn.BatchNorm(use_running_average=False)(x)
      return nn.relu(x).mean((1, 2))

  model = CNN()
  x = jnp.ones((2, 8, 8, 3))
  variables = model.init(KEY, x)
  fn = lambda v, x: model.apply(v, x, mutable=['batch_stats'])
  mox = yax.make_mox(fn)(variables, x)
  assert_trees_close(yax.eval_mox(mox, variables, x), fn(variables, x))
  assert_trees_close(jit_call(lambda *a: yax.eval_mox(mox, *a), variables, x),
                     fn(variables, x))
  a = flops(jax.jit(fn).lower(variables, x).compile())
  b = flops(jax.jit(lambda *a: yax.eval_mox(mox, *a)).lower(
      variables, x).compile())
  assert a > 0 and a == b


def test_interpreter_subclass_observes_module_outputs(net):
  model, variables, x, mox = net

  class Recorder(yax.Interpreter):
    def __init__(self):
      super().__init__()
      self.seen = []

    def run_module(self, node):
      super().run_module(node)
      if not node.is_ephemeral:
        self.seen.append((node.path, [self.read(s) for s in node.outputs]))

  rec = Recorder()
  leaves = jax.tree_util.tree_leaves((variables, x))
  out = rec.run(mox, mox.consts, leaves)
  assert_trees_close(out[0], model.apply(variables, x))
  paths = [p for p, _ in rec.seen]
  assert paths == [m.path for m in modules(mox)][1:] + [()]
  _, state = model.apply(variables, x, capture_intermediates=True,
                         mutable=['intermediates'])
  inter = state['intermediates']
  seen = dict((p, v) for p, v in rec.seen)
  assert_trees_close(seen[('Dense_0',)][0], inter['Dense_0']['__call__'][0])


# ------------------------------------------- values freed after last use

def _chain(x):
  for _ in range(30):
    x = jnp.sin(x) * 1.5
  return x


def test_interpreter_releases_an_intermediate_after_its_last_use():
  # Each value of the chain is read once, by the next equation: the first
  # intermediate must be gone (no reference left) before the chain ends.
  x = jnp.arange(4.0)
  mox = yax.make_mox(_chain)(x)
  refs, alive_at_end = [], []

  class Watcher(yax.Interpreter):
    def run_equation(self, eqn):
      if len(refs) == 1 and eqn is mox.children[-1]:
        gc.collect()
        alive_at_end.append(refs[0]() is not None)
      super().run_equation(eqn)
      if not refs:
        refs.append(weakref.ref(self.read(eqn.outputs[0])))

  out = Watcher().run(mox, mox.consts, [x])
  assert_trees_close(out[0], _chain(x))
  assert alive_at_end == [False]


def test_interpreter_holds_few_values_at_once(net):
  # Eager replay keeps only live values: the peak number of environment
  # entries stays near the tree's inputs, far below its symbol count.
  model, variables, x, mox = net
  sizes = []

  class Counter(yax.Interpreter):
    def run_equation(self, eqn):
      super().run_equation(eqn)
      sizes.append(len(self.env))

  leaves = jax.tree_util.tree_leaves(((variables, x), {}))
  out = Counter().run(mox, mox.consts, leaves)
  assert_trees_close(out[0], model.apply(variables, x))
  defined = len({s for e in iter_nodes(mox) if isinstance(e, yax.Equation)
                 for s in e.outputs})
  assert defined > 30
  assert max(sizes) <= len(leaves) + 6, (max(sizes), len(leaves), defined)

  chain = yax.make_mox(_chain)(jnp.arange(4.0))
  sizes.clear()
  Counter().run(chain, chain.consts, [jnp.arange(4.0)])
  assert len(sizes) == 60 and max(sizes) <= 3


class _Step(nn.Module):
  @nn.compact
  def __call__(self, c, _):
    return jnp.tanh(nn.Dense(4, name='fc')(c)), None


class _Lifted(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.scan(_Step, variable_axes={'params': 0},
                split_rngs={'params': True}, length=2)(name='stack')(x, None)[0]
    x = nn.remat(nn.Dense)(4, name='remat')(x)
    return nn.jit(nn.Dense)(4, name='jitted')(x)


def test_interpreter_leaves_only_the_tree_inputs_and_outputs():
  # Values inside module calls and inside the bodies of lifted transforms
  # (tracers of the body's trace) are dropped once used.
  model = _Lifted()
  x = jnp.ones((2, 4))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)
  interp = yax.Interpreter()
  leaves = jax.tree_util.tree_leaves(((variables, x), {}))
  out = interp.run(mox, mox.consts, leaves)
  assert_trees_close(out[0], model.apply(variables, x))
  assert set(interp.env) <= {*mox.constvars, *mox.inputs, *mox.outputs}
  assert not any(isinstance(v, jax.core.Tracer) for v in interp.env.values())


class Unused(nn.Module):
  @nn.compact
  def __call__(self, x):
    nn.Dense(3, name='dead')(x)  # its output is never read
    return nn.Dense(2, name='live')(x)


def test_subclass_reads_module_inputs_and_outputs_after_the_call():
  # Freeing waits until a module call's run_module has returned, so an
  # override can read the call's inputs and outputs (even an output no
  # later equation reads) after super().run_module.
  model = Unused()
  x = jnp.ones((1, 4))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)
  seen = {}

  class Recorder(yax.Interpreter):
    def run_module(self, node):
      super().run_module(node)
      if not node.is_ephemeral:
        seen[node.path] = ([self.read(s) for s in node.inputs],
                           [self.read(s) for s in node.outputs])

  leaves = jax.tree_util.tree_leaves(((variables, x), {}))
  Recorder().run(mox, mox.consts, leaves)
  dense = lambda name, f: nn.Dense(f).apply(
      {'params': variables['params'][name]}, x)
  assert_trees_close(seen[('dead',)][1][0], dense('dead', 3))
  assert_trees_close(seen[('live',)][1][0], dense('live', 2))
  assert_trees_close(seen[('dead',)][0][-1], x)
