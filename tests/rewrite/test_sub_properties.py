"""Property tests for yax.sub on random Linen architectures.

* Replacing random module calls with a fresh trace of themselves (and random
  activations with a fresh trace of the same activation) leaves eval_mox
  unchanged, eagerly and under jit.
* A random sequence of substitutions (activation swaps, LoRA on random Dense
  calls) never breaks the tree's invariants (yax.check_mox) and the result
  always equals an independent reference computed from the same parameters.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import yax
from yax._src.ir.nodes import iter_nodes

ACTS = {'relu': nn.relu, 'tanh': jnp.tanh, 'gelu': nn.gelu, 'silu': nn.silu}


@dataclasses.dataclass(frozen=True)
class Layer:
  kind: str  # dense | act | norm | block | shared
  width: int = 4
  act: str = 'relu'
  inner: tuple = ()


class Net(nn.Module):
  layers: tuple

  @nn.compact
  def __call__(self, x):
    for layer in self.layers:
      x = apply_layer(layer, x)
    return x


class Block(nn.Module):
  layers: tuple

  @nn.compact
  def __call__(self, x):
    h = x
    for layer in self.layers:
      h = apply_layer(layer, h)
    return x + h if h.shape == x.shape else h


def apply_layer(layer: Layer, x):
  if layer.kind == 'dense':
    return nn.Dense(layer.width)(x)
  if layer.kind == 'act':
    return ACTS[layer.act](x)
  if layer.kind == 'norm':
    return nn.LayerNorm()(x)
  if layer.kind == 'shared':
    dense = nn.Dense(x.shape[-1])
    return dense(jnp.tanh(dense(x)))
  return Block(layer.inner)(x)


leaf = st.one_of(
    st.builds(Layer, st.just('dense'), st.integers(2, 6)),
    st.builds(Layer, st.just('act'), st.just(4), st.sampled_from(sorted(ACTS))),
    st.builds(Layer, st.just('norm')),
    st.builds(Layer, st.just('shared')))
layers = st.recursive(
    st.lists(leaf, min_size=1, max_size=4).map(tuple),
    lambda inner: st.lists(
        st.one_of(leaf, inner.map(lambda l: Layer('block', inner=l))),
        min_size=1, max_size=3).map(tuple),
    max_leaves=8)


def build(arch, seed):
  model = Net(arch)
  x = jax.random.normal(jax.random.key(seed), (2, 3))
  variables = model.init(jax.random.key(seed + 1), x)
  return model, variables, x, yax.make_mox(model.apply)(variables, x)


def zeros_like_symbol(sym):
  return jnp.zeros(sym.aval.shape, sym.aval.dtype)


def fresh_trace(path, node):
  """A new trace of the same computation, built from the node alone."""
  if isinstance(node, yax.Equation):
    return yax.make_mox(ACTS[node.name])(zeros_like_symbol(node.inputs[0]))
  fields = {k: v for k, v in node.params.items() if k != 'name'}
  module = node.module_ty(**fields)
  var_values = jax.tree_util.tree_unflatten(
      node.var_tree, [zeros_like_symbol(s) for s in node.var_inputs])
  args, kwargs = jax.tree_util.tree_unflatten(
      node.in_tree, [s.value if isinstance(s, yax.Literal) else
                     zeros_like_symbol(s) for s in node.arg_inputs])
  return yax.make_mox(lambda v, *a, **k: module.apply(
      v, *a, method=node.entrypoint, **k))(var_values, *args, **kwargs)


def close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5,
                             atol=2e-5)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(arch=layers, seed=st.integers(0, 100), data=st.data())
def test_replacing_nodes_with_fresh_traces_changes_nothing(arch, seed, data):
  model, variables, x, mox = build(arch, seed)
  candidates = [n for n in iter_nodes(mox)
                if n is not mox and (
                    (isinstance(n, yax.Mox) and not n.is_ephemeral
                     and n.type_name in ('Dense', 'LayerNorm', 'Block'))
                    or (isinstance(n, yax.Equation) and n.name in ACTS))]
  # never select a node together with one of its descendants
  chosen = data.draw(st.lists(st.sampled_from(candidates), unique_by=id,
                              max_size=4)) if candidates else []
  chosen = [n for n in chosen if not any(
      n is not m and any(n is d for d in iter_nodes(m)) for m in chosen)]
  before = str(mox)
  if not chosen:  # selections are exact: matching nothing is an error
    with pytest.raises(yax.SubstitutionError, match='matched no module call'):
      yax.sub(chosen, fresh_trace, mox)
    return
  new = yax.sub(chosen, fresh_trace, mox)
  assert str(mox) == before
  yax.check_mox(new)
  assert new.in_tree == mox.in_tree
  expected = model.apply(variables, x)
  close(yax.eval_mox(new, variables, x), expected)
  close(jax.jit(lambda v, x: yax.eval_mox(new, v, x))(variables, x), expected)


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(arch=layers, seed=st.integers(0, 100), data=st.data())
def test_random_substitution_sequences_keep_invariants(arch, seed, data):
  model, variables, x, mox = build(arch, seed)
  params = variables
  tree = mox
  swaps = {}  # activation name -> replacement function
  steps = data.draw(st.lists(st.sampled_from(['swap', 'lora', 'keep']),
                             min_size=1, max_size=3))
  adapted = False
  for step in steps:
    if step == 'swap':
      # relu (custom_jvp) and silu (jit) keep their names in the trace;
      # gelu and tanh are inlined primitives without a name.
      old = data.draw(st.sampled_from(['relu', 'silu']))
      new_fn = data.draw(st.sampled_from([jnp.sin, jnp.tanh, jax.nn.softplus]))
      if old in swaps or not yax.query(f'//*[@name="{old}"]', tree):
        continue  # selections are exact: one that matches nothing raises
      swaps[old] = new_fn
      tree = yax.sub(f'//*[@name="{old}"]', lambda p, n, f=new_fn: yax.make_mox(
          f)(zeros_like_symbol(n.inputs[0])), tree)
    elif step == 'lora' and not adapted and yax.query(
        'count(//module_call[@type="Dense"])', tree):
      res = yax.lora(tree, params, '//module_call[@type="Dense"]', rank=2)
      tree, params, adapted = res.mox, res.params, True
      # give the adapters non-zero values so they matter
      params = jax.tree_util.tree_map(
          lambda p, m: p + 0.1 if m else p, params, res.mask)
    else:
      # every innermost module call (a node and its ancestor cannot both
      # be selected)
      tree = yax.sub('//module_call[not(.//module_call)]', lambda p, n: n,
                     tree)
    yax.check_mox(tree)
  yax.check_mox(mox)
  assert mox.in_tree == jax.tree_util.tree_structure(((variables, x), {}))

  # Reference: the same architecture run by hand from the same parameters.
  def ref_apply(p, x):
    def dense(q, h):
      w = q['kernel']
      if 'lora_a' in q:
        w = w + 0.5 * q['lora_a'] @ q['lora_b']
      return h @ w + q['bias']

    def act(name, h):
      return swaps.get(name, ACTS[name])(h)

    def run(layer_list, scope, x):
      counters = {}

      def child(prefix):
        i = counters.get(prefix, 0)
        counters[prefix] = i + 1
        return scope.get(f'{prefix}_{i}', {})

      for layer in layer_list:
        if layer.kind == 'dense':
          x = dense(child('Dense'), x)
        elif layer.kind == 'act':
          x = act(layer.act, x)
        elif layer.kind == 'norm':
          q = child('LayerNorm')
          mean = x.mean(-1, keepdims=True)
          var = ((x - mean) ** 2).mean(-1, keepdims=True)
          x = (x - mean) / jnp.sqrt(var + 1e-6) * q['scale'] + q['bias']
        elif layer.kind == 'shared':
          q = child('Dense')
          x = dense(q, jnp.tanh(dense(q, x)))
        else:
          h = run(layer.inner, child('Block'), x)
          x = x + h if h.shape == x.shape else h
      return x

    return run(arch, p.get('params', {}), x)

  close(yax.eval_mox(tree, params, x), ref_apply(params, x))
