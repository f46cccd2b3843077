"""Guarantees of yax.sub / yax.lora (SPEC "Guarantees"), one focused test each.

* Selections are exact: nothing matched, non-nodes, nodes of another tree or
  of the tree before a rewrite, a node with its ancestor, a node twice all
  raise SubstitutionError naming the selection; a callable replacement is
  called once per target; every target is reached exactly once.
* A rewrite says what it did (``yax._src.rewrite.engine.substitute`` -> ``Rewrite``).
* LoRA never doubles or misplaces an adapter (LoRA on a LoRA tree, tied
  embedding heads in a hand-written Linen model and in HF GPT-Neo), shares
  one adapter between call sites that share weights, validates rank, alpha
  and key, and merge never fails with a bare KeyError.
* Containers are kept (FrozenDict, other Mapping pytrees).
* Non-2-D kernels: DenseGeneral adapted along its contracted axes, Einsum and
  Conv refused with the kernel's shape.

References are plain Flax modules with hand-written LoRA on the same weights.
"""

import collections
import os
from typing import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import FrozenDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import yax
from yax._src.ir.nodes import iter_nodes
from yax._src.rewrite.engine import Rewrite, substitute

os.environ.setdefault('USE_TORCH', '0')


def close(a, b, tol=1e-5):
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def bump(res, amount=0.1):
  """Adapter weights moved away from their init (as if trained)."""
  return jax.tree_util.tree_map(lambda p, m: p + amount if m else p,
                                res.params, res.mask)


def lora_ok(res):
  yax.check_mox(res.mox)
  return res


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(8)(x))
    h = nn.relu(nn.Dense(8)(h))
    return nn.Dense(3)(h)


@pytest.fixture(scope='module')
def mlp():
  model = MLP()
  x = jax.random.normal(jax.random.key(1), (2, 5))
  variables = model.init(jax.random.key(0), x)
  return model, variables, x, yax.make_mox(model.apply)(variables, x)


class HandLoRADense(nn.Module):
  """A Dense with a LoRA adapter written out by hand (the reference)."""
  features: int
  rank: int
  alpha: float

  @nn.compact
  def __call__(self, x):
    kernel = self.param('kernel', nn.initializers.zeros,
                        (x.shape[-1], self.features))
    bias = self.param('bias', nn.initializers.zeros, (self.features,))
    a = self.param('lora_a', nn.initializers.zeros, (x.shape[-1], self.rank))
    b = self.param('lora_b', nn.initializers.zeros, (self.rank, self.features))
    return x @ kernel + bias + (self.alpha / self.rank) * ((x @ a) @ b)


# ------------------------------------------------------ exact selections

def test_selection_matching_nothing_raises(mlp):
  _, variables, _, mox = mlp
  tanh = yax.make_mox(jnp.tanh)(jnp.zeros((2, 8)))
  with pytest.raises(yax.SubstitutionError,
                     match=r"'//module_call\[@type=\"Conv\"\]' matched no module call"):
    yax.sub('//module_call[@type="Conv"]', tanh, mox)
  with pytest.raises(yax.SubstitutionError, match='matched no module call'):
    yax.sub([], tanh, mox)
  with pytest.raises(yax.SubstitutionError,
                     match=r"'//module_call\[@type=\"Conv\"\]' matched no module call"):
    yax.lora(mox, variables, '//module_call[@type="Conv"]')


def test_selection_of_values_and_symbols_raises(mlp):
  _, variables, _, mox = mlp
  tanh = yax.make_mox(jnp.tanh)(jnp.zeros((2, 8)))
  cases = [
      ('count(//module_call)', r"'count\(//module_call\)' matched a float"),
      ('//module_call/@name', r"'//module_call/@name' matched a str \('Dense_0'"),
      ('//module_call[@type="Dense"]/input', r'matched a Var of type f32\[8\] '
       r'\(a symbol\)'),
      ('boolean(//module_call)', r'matched a bool \(True\)'),
  ]
  for expr, message in cases:
    with pytest.raises(yax.SubstitutionError, match=message):
      yax.sub(expr, tanh, mox)
    with pytest.raises(yax.SubstitutionError, match=message):
      yax.lora(mox, variables, expr)
  with pytest.raises(yax.SubstitutionError, match=r'matched a int \(3\)'):
    yax.sub([3], tanh, mox)
  with pytest.raises(yax.SubstitutionError, match='found a int'):
    yax.sub(3, tanh, mox)


def test_selection_of_nodes_not_in_the_tree_raises(mlp):
  model, variables, x, mox = mlp
  gelu = yax.make_mox(jax.nn.gelu)(jnp.zeros((2, 8)))
  new = yax.sub('//*[@name="relu"]', gelu, mox)
  yax.check_mox(new)
  old_relu = yax.query('//*[@name="relu"]', mox)[0]
  # a node of the tree before the rewrite: gone from the new tree
  with pytest.raises(yax.SubstitutionError,
                     match=r"equation 'custom_jvp_call' \(relu\), which is not "
                           r'a node of this tree.*before a rewrite'):
    yax.sub([old_relu], gelu, new)
  # a module call of the old tree that the rewrite rebuilt (the root's child)
  old_mlp = yax.query('//module_call[@type="MLP"]', mox)[0]
  assert old_mlp not in yax.query('//module_call', new)
  with pytest.raises(yax.SubstitutionError, match='not a node of this tree'):
    yax.lora(new, variables, [old_mlp])
  # a node of another tree
  other = yax.make_mox(model.apply)(variables, x)
  dense = yax.query('//module_call[@type="Dense"]', other)[0]
  with pytest.raises(yax.SubstitutionError,
                     match=r"module_call Dense at path 'Dense_0', which is not "
                           'a node of this tree'):
    yax.lora(mox, variables, [dense])
  # nodes the rewrite left untouched are shared, hence still nodes of `new`
  kept = yax.query('//module_call[@type="Dense"]', mox)[0]
  assert kept in yax.query('//module_call[@type="Dense"]', new)
  res = lora_ok(yax.lora(new, variables, [kept]))
  assert res.paths == [('Dense_0',)]


def test_selection_of_a_node_with_its_ancestor_raises(mlp):
  _, variables, _, mox = mlp
  tanh = yax.make_mox(jnp.tanh)(jnp.zeros((2, 8)))
  outer = yax.query('//module_call[@type="MLP"]', mox)[0]
  inner = yax.query('//module_call[@type="Dense"]', mox)[1]
  calls = []
  with pytest.raises(yax.SubstitutionError,
                     match=r"matched module_call Dense at path 'Dense_1' "
                           r'together with its ancestor module_call MLP'):
    yax.sub([outer, inner], lambda p, n: calls.append(p) or n, mox)
  assert calls == []  # refused before any replacement ran
  with pytest.raises(yax.SubstitutionError, match='together with its ancestor'):
    yax.sub('//module_call[@type="MLP"] | //*[@name="relu"]', tanh, mox)
  with pytest.raises(yax.SubstitutionError, match='together with its ancestor'):
    yax.lora(mox, variables, '//module_call')  # the root is an ancestor
  with pytest.raises(yax.SubstitutionError, match='holds .* twice'):
    yax.sub([inner, inner], lambda p, n: n, mox)


class Block(nn.Module):
  @nn.compact
  def __call__(self, c, _):
    return nn.relu(nn.Dense(4)(c)), None


class Stack(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4, name='pre')(x)
    scan = nn.scan(Block, variable_axes={'params': 0},
                   split_rngs={'params': True}, length=3)
    c, _ = scan(name='blocks')(x, None)
    return nn.relu(c)


@pytest.fixture(scope='module')
def stack():
  model = Stack()
  x = jax.random.normal(jax.random.key(0), (2, 4))
  variables = model.init(jax.random.key(1), x)
  return model, variables, x, yax.make_mox(model.apply)(variables, x)


def test_callable_called_once_per_target_inside_bodies(stack):
  model, variables, x, mox = stack
  targets = yax.query('//custom_jvp_call[@name="relu"] | '
                      '//module_call[@type="Dense"]', mox)
  # one ReLU and one Dense inside the scan body, one of each outside it
  assert len(targets) == 4
  inside = yax.query('//scan//*', mox)
  assert sum(t in inside for t in targets) == 2
  seen = []

  def record(path, node):
    seen.append(id(node))
    return node

  same = yax.sub(targets, record, mox)
  yax.check_mox(same)
  assert sorted(seen) == sorted(map(id, targets))  # each exactly once
  close(yax.eval_mox(same, variables, x), model.apply(variables, x))
  done = substitute(targets, record, mox)
  assert [t for t, _ in done.replaced] == [t for t in iter_nodes(mox)
                                            if any(t is u for u in targets)]
  scan = yax.query('//scan', mox)[0]
  with pytest.raises(yax.SubstitutionError,
                     match=r"matched the body of an equation \(equation "
                           r"'scan'"):
    yax.sub([scan.children[0]], record, mox)


def test_every_target_is_reached_exactly_once(mlp):
  _, _, _, mox = mlp
  # A malformed tree holding one node object in two places: the walk would
  # replace it twice, which the visit count catches.
  dense = mox.children[0].children[0]
  twice = mox.replace(children=[mox.children[0].replace(
      children=[dense] + mox.children[0].children)])
  with pytest.raises(yax.SubstitutionError, match=r'reached module_call Dense '
                     r"at path 'Dense_0' .* 2 times instead of once"):
    yax.sub([dense], lambda p, n: n, twice)


# ------------------------------------------------ a rewrite says what it did

class ScaledDense(nn.Module):
  """Reads a Dense's kernel and bias and adds a per-feature ``scale``."""
  features: int

  @nn.compact
  def __call__(self, x):
    kernel = self.param('kernel', nn.initializers.zeros,
                        (x.shape[-1], self.features))
    bias = self.param('bias', nn.initializers.zeros, (self.features,))
    scale = self.param('scale', nn.initializers.ones, (self.features,))
    return (x @ kernel + bias) * scale


def test_substitute_returns_added_variables_and_collections(mlp):
  _, variables, x, mox = mlp

  scaled = ScaledDense(8)
  repl = yax.make_mox(scaled.apply)(
      scaled.init(jax.random.key(3), jnp.zeros((2, 8))), jnp.zeros((2, 8)))
  target = yax.query('//module_call[@path="Dense_1"]', mox)[0]
  done = substitute([target], repl, mox)
  assert isinstance(done, Rewrite)
  yax.check_mox(done.mox)
  assert list(done.added) == [('params', 'Dense_1', 'scale')]
  assert done.added[('params', 'Dense_1', 'scale')].type_str == 'f32[8]'
  assert done.collections == {'params': (0, 0, 'params')}
  (old, new), = done.replaced
  assert old is target and len(new) == 1
  assert new[0].type_name == 'ScaledDense'


# ------------------------------------ LoRA never doubles or misplaces

def test_lora_on_a_lora_tree_refuses_and_the_predicate_works(mlp):
  _, variables, x, mox = mlp
  first = lora_ok(yax.lora(mox, variables, '//module_call[@path="Dense_0"]',
                           rank=2, alpha=2.0, key=jax.random.key(1)))
  with pytest.raises(yax.SubstitutionError) as info:
    yax.lora(first.mox, first.params, '//module_call[@type="Dense"]', rank=2,
             alpha=2.0)
  message = str(info.value)
  assert "Dense at path 'Dense_0'" in message
  assert 'already carries an adapter' in message
  suggested = message.splitlines()[-1].strip()
  assert suggested == ('//module_call[@type="Dense"]'
                       '[not(parent::module_call[@type="LoRA"])]')
  with pytest.raises(yax.SubstitutionError, match='is a LoRA adapter already'):
    yax.lora(first.mox, first.params, '//module_call[@type="LoRA"]')
  second = lora_ok(yax.lora(first.mox, first.params, suggested, rank=2,
                            alpha=2.0, key=jax.random.key(2)))
  assert second.paths == [('Dense_1',), ('Dense_2',)]
  trained = jax.tree_util.tree_map(
      lambda p, m1, m2: p + 0.1 if m2 else (p - 0.2 if m1 else p),
      second.params, _pad_mask(first.mask, second.params), second.mask)

  class Reference(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.relu(HandLoRADense(8, 2, 2.0, name='Dense_0')(x))
      h = nn.relu(HandLoRADense(8, 2, 2.0, name='Dense_1')(h))
      return HandLoRADense(3, 2, 2.0, name='Dense_2')(h)

  ref = Reference().apply(trained, x)
  close(yax.eval_mox(second.mox, trained, x), ref)  # each adapter counted once
  close(yax.eval_mox(first.mox, second.merge(trained), x), ref)
  close(yax.eval_mox(mox, first.merge(second.merge(trained)), x), ref)


def _pad_mask(mask, like):
  """``mask`` extended with False where ``like`` has more leaves."""
  def pad(path, leaf):
    node = mask
    for k in path:
      node = node.get(k.key, False) if isinstance(node, Mapping) else False
    return bool(node) if not isinstance(node, Mapping) else False
  return jax.tree_util.tree_map_with_path(pad, like)


class TiedLM(nn.Module):
  """Two heads tied to two embeddings, as HF GPT-Neo/OPT write them.

  With ``lora_rank`` > 0, ``proj`` carries a hand-written adapter.
  """
  lora_rank: int = 0
  lora_alpha: float = 1.0

  def setup(self):
    self.wte = nn.Embed(11, 6)
    self.wpe = nn.Embed(11, 6)
    self.proj = (HandLoRADense(6, self.lora_rank, self.lora_alpha)
                 if self.lora_rank else nn.Dense(6))
    self.lm_head = nn.Dense(11, use_bias=False)
    self.aux_head = nn.Dense(11, use_bias=False)

  def __call__(self, ids):
    h = self.proj(self.wte(ids))
    logits = self.lm_head.apply(
        {'params': {'kernel': self.wte.embedding.T}}, h)
    aux = self.aux_head.apply(
        {'params': {'kernel': self.wpe.embedding.T}}, h)
    return logits + aux


def test_tied_heads_get_call_site_adapters_never_at_the_root():
  """The heads are applied through nested Module.apply calls with the
  embeddings transposed: each gets its own adapter under the calling
  module's path and its own name, never at the params root; merge refuses
  (a merged head would no longer be tied)."""
  model = TiedLM()
  ids = jnp.array([[1, 4, 7], [2, 3, 9]])
  variables = model.init(jax.random.key(0), ids)
  mox = yax.make_mox(model.apply)(variables, ids)
  heads = yax.query('//module_call[@type="Dense" and @name!="proj"]', mox)
  assert [h.path for h in heads] == [(), ()]  # both at the nested apply's root
  res = lora_ok(yax.lora(mox, variables, '//module_call[@type="Dense"]',
                         rank=3, alpha=6.0))
  assert res.paths == [('aux_head',), ('lm_head',), ('proj',)]
  p = res.params['params']
  assert set(p) == set(variables['params']) | {'lm_head', 'aux_head'}
  assert 'lora_a' not in p and 'lora_b' not in p  # never at the root
  assert set(p['lm_head']) == {'lora_a', 'lora_b'}
  assert p['lm_head']['lora_a'].shape == (6, 3)
  assert p['lm_head']['lora_b'].shape == (3, 11)
  close(yax.eval_mox(res.mox, res.params, ids), model.apply(variables, ids))
  trained = bump(res)
  # By hand: proj with its adapter; each head h @ (embedding.T + s A B).
  t = trained['params']
  h = HandLoRADense(6, 3, 6.0).apply({'params': t['proj']},
                                     t['wte']['embedding'][ids])
  s = 6.0 / 3
  ref = (h @ (t['wte']['embedding'].T + s * t['lm_head']['lora_a']
              @ t['lm_head']['lora_b'])
         + h @ (t['wpe']['embedding'].T + s * t['aux_head']['lora_a']
                @ t['aux_head']['lora_b']))
  close(yax.eval_mox(res.mox, trained, ids), ref)
  with pytest.raises(yax.SubstitutionError,
                     match=r"(?s)params\['params'\]\['aux_head'\].*call-site adapter.*"
                           r'computed in the model.*could no longer be tied'):
    res.merge(trained)
  # Without the heads, the adapters merge.
  only = lora_ok(yax.lora(mox, variables, '//module_call[@name="proj"]',
                          rank=3, alpha=6.0))
  trained = bump(only)
  ref = TiedLM(lora_rank=3, lora_alpha=6.0).apply(trained, ids)
  close(yax.eval_mox(only.mox, trained, ids), ref)
  close(model.apply(only.merge(trained), ids), ref)


def test_lora_on_hf_gpt_neo_with_a_tied_head():
  from transformers import FlaxGPTNeoForCausalLM, GPTNeoConfig
  config = GPTNeoConfig(vocab_size=40, hidden_size=8, num_layers=1,
                        num_heads=2, attention_types=[[['global'], 1]],
                        max_position_embeddings=16, intermediate_size=16)
  model = FlaxGPTNeoForCausalLM(config, seed=0)
  ids = jnp.array([[1, 5, 7, 3]])
  mox = yax.make_mox(model)(ids, params=model.params)
  every = lora_ok(yax.lora(mox, model.params, '//module_call[@type="Dense"]',
                           rank=2))
  assert ('lm_head',) in every.paths and len(every.paths) == 7
  assert set(every.params['lm_head']) == {'lora_a', 'lora_b'}
  close(yax.eval_mox(every.mox, ids, params=every.params).logits,
        model(ids, params=model.params).logits)
  with pytest.raises(yax.SubstitutionError, match='could no longer be tied'):
    every.merge(bump(every, 0.05))
  suggested = ('//module_call[@type="Dense"][not(@type="Dense" and '
               '@name="lm_head" and string(@path)="")]')
  res = lora_ok(yax.lora(mox, model.params, suggested, rank=2))
  assert len(res.paths) == 6 and () not in res.paths
  assert 'lora_a' not in res.params  # nothing at the root of the params
  close(yax.eval_mox(res.mox, ids, params=res.params).logits,
        model(ids, params=model.params).logits)
  trained = bump(res, 0.05)
  lora_logits = yax.eval_mox(res.mox, ids, params=trained).logits
  assert not np.allclose(lora_logits, model(ids, params=model.params).logits)
  close(model(ids, params=res.merge(trained)).logits, lora_logits, tol=1e-4)


class SharedTwice(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(5, name='shared')
    other = nn.Dense(5, name='other')
    return other(jnp.tanh(dense(jnp.tanh(dense(x)))))


def test_lora_on_a_module_called_twice_shares_one_adapter_and_merges():
  model = SharedTwice()
  x = jax.random.normal(jax.random.key(0), (3, 5))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  res = lora_ok(yax.lora(mox, variables, '//module_call[@type="Dense"]',
                         rank=2, alpha=1.0))
  assert res.paths == [('other',), ('shared',)]
  loras = yax.query('//module_call[@type="LoRA"]', res.mox)
  assert len(loras) == 3
  assert loras[0].var_inputs == loras[1].var_inputs  # one adapter pair
  assert loras[0].var_inputs != loras[2].var_inputs
  trained = bump(res, 0.3)

  class Reference(nn.Module):
    @nn.compact
    def __call__(self, x):
      dense = HandLoRADense(5, 2, 1.0, name='shared')
      other = HandLoRADense(5, 2, 1.0, name='other')
      return other(jnp.tanh(dense(jnp.tanh(dense(x)))))

  ref = Reference().apply(trained, x)
  close(yax.eval_mox(res.mox, trained, x), ref)
  merged = res.merge(trained)
  close(model.apply(merged, x), ref)
  close(yax.eval_mox(mox, merged, x), ref)


def test_lora_on_a_bare_dense_keeps_the_adapter_next_to_its_kernel():
  # The traced model is the Dense itself: its kernel sits at the root of the
  # params collection, and so do its adapters (nothing is misplaced).
  dense = nn.Dense(4)
  x = jax.random.normal(jax.random.key(0), (2, 3))
  variables = dense.init(jax.random.key(1), x)
  mox = yax.make_mox(dense.apply)(variables, x)
  res = lora_ok(yax.lora(mox, variables, rank=2, alpha=3.0))
  assert res.paths == [()]
  assert set(res.params['params']) == {'bias', 'kernel', 'lora_a', 'lora_b'}
  trained = bump(res)
  ref = HandLoRADense(4, 2, 3.0).apply(trained, x)
  close(yax.eval_mox(res.mox, trained, x), ref)
  close(dense.apply(res.merge(trained), x), ref)


def test_lora_validates_rank_alpha_and_key(mlp):
  _, variables, x, mox = mlp
  sel = '//module_call[@type="Dense"]'
  for rank in (0, -2, 2.5, True, '4', None):
    with pytest.raises(yax.SubstitutionError, match='rank must be a positive int'):
      yax.lora(mox, variables, sel, rank=rank)
  for alpha in (float('nan'), float('inf'), '1', None, True, 1j):
    with pytest.raises(yax.SubstitutionError,
                       match='alpha must be a finite real number'):
      yax.lora(mox, variables, sel, alpha=alpha)
  bad_keys = (0, 'key', jnp.zeros(3), jax.random.split(jax.random.key(0), 2),
              jnp.zeros(2, jnp.float32))
  for key in bad_keys:
    with pytest.raises(yax.SubstitutionError, match='key must be one PRNG key'):
      yax.lora(mox, variables, sel, key=key)
  res = lora_ok(yax.lora(mox, variables, sel, rank=np.int64(2),
                         alpha=np.float32(3.0), key=jax.random.PRNGKey(4)))
  assert res.params['params']['Dense_0']['lora_a'].shape == (5, 2)
  close(yax.eval_mox(res.mox, res.params, x), yax.eval_mox(mox, variables, x))


def test_merge_of_params_without_adapters_names_the_path(mlp):
  _, variables, _, mox = mlp
  res = lora_ok(yax.lora(mox, variables, '//module_call[@type="Dense"]'))
  with pytest.raises(yax.SubstitutionError,
                     match=r"params\['params'\]\['Dense_0'\]\['lora_a'\] is "
                           r"missing \(found \['bias', 'kernel'\]"):
    res.merge(variables)
  broken = jax.tree_util.tree_map(lambda a: a, res.params)
  broken['params']['Dense_2'] = {k: v for k, v in broken['params'][
      'Dense_2'].items() if k != 'lora_b'}
  with pytest.raises(yax.SubstitutionError,
                     match=r"\['Dense_2'\]\['lora_b'\] is missing"):
    res.merge(broken)


# ------------------------------------------------------ containers kept

def _mapping_types(tree):
  out = []

  def walk(node):
    if isinstance(node, Mapping):
      out.append(type(node))
      for v in node.values():
        walk(v)
  walk(tree)
  return set(out)


def test_frozendict_params_come_back_frozen(mlp):
  model, _, x, _ = mlp
  variables = FrozenDict(model.init(jax.random.key(0), x))
  assert _mapping_types(variables) == {FrozenDict}
  mox = yax.make_mox(model.apply)(variables, x)
  res = lora_ok(yax.lora(mox, variables, '//module_call[@type="Dense"]'))
  assert _mapping_types(res.params) == {FrozenDict}
  assert _mapping_types(res.mask) == {FrozenDict}
  close(yax.eval_mox(res.mox, res.params, x), model.apply(variables, x))
  trained = bump(res)
  merged = res.merge(trained)
  assert _mapping_types(merged) == {FrozenDict}
  close(yax.eval_mox(mox, merged, x), yax.eval_mox(res.mox, trained, x))
  close(model.apply(merged, x), yax.eval_mox(res.mox, trained, x))

  # sub with a replacement that brings a new variable
  scaled = ScaledDense(8)
  repl = yax.make_mox(scaled.apply)(
      scaled.init(jax.random.key(3), jnp.zeros((2, 8))), jnp.zeros((2, 8)))
  new = yax.sub('//module_call[@path="Dense_1"]', repl, mox)
  yax.check_mox(new)
  grown = variables.copy({'params': variables['params'].copy(
      {'Dense_1': variables['params']['Dense_1'].copy(
          {'scale': jnp.full((8,), 2.0)})})})
  assert _mapping_types(grown) == {FrozenDict}
  p = variables['params']
  h = jax.nn.relu(x @ p['Dense_0']['kernel'] + p['Dense_0']['bias'])
  h = jax.nn.relu(2.0 * (h @ p['Dense_1']['kernel'] + p['Dense_1']['bias']))
  close(yax.eval_mox(new, grown, x),
        h @ p['Dense_2']['kernel'] + p['Dense_2']['bias'])


class Params(Mapping):
  """A user's own immutable Mapping, registered as a pytree."""

  def __init__(self, items=()):
    self._items = dict(items)

  def __getitem__(self, key):
    return self._items[key]

  def __iter__(self):
    return iter(self._items)

  def __len__(self):
    return len(self._items)


jax.tree_util.register_pytree_with_keys(
    Params,
    lambda p: ([(jax.tree_util.DictKey(k), p[k]) for k in sorted(p)],
               tuple(sorted(p))),
    lambda keys, values: Params(zip(keys, values)))


class Strict(Params):
  """A Mapping that cannot be rebuilt from a dict."""

  def __init__(self, items, tag):
    super().__init__(items)
    self.tag = tag


jax.tree_util.register_pytree_with_keys(
    Strict,
    lambda p: ([(jax.tree_util.DictKey(k), p[k]) for k in sorted(p)],
               (tuple(sorted(p)), p.tag)),
    lambda aux, values: Strict(zip(aux[0], values), aux[1]))


def _convert(tree, cls, *extra):
  if isinstance(tree, Mapping):
    return cls({k: _convert(v, cls, *extra) for k, v in tree.items()}, *extra)
  return tree


def test_other_mapping_pytrees_come_back_as_themselves(mlp):
  model, variables, x, _ = mlp
  for cls in (Params, collections.OrderedDict):
    params = _convert(variables, cls)
    mox = yax.make_mox(lambda p, x: model.apply(_convert(p, dict), x))(
        params, x)
    res = lora_ok(yax.lora(mox, params, '//module_call[@type="Dense"]'))
    assert _mapping_types(res.params) == {cls}
    assert _mapping_types(res.mask) == {cls}
    trained = bump(res)
    merged = res.merge(trained)
    assert _mapping_types(merged) == {cls}
    close(yax.eval_mox(mox, merged, x), yax.eval_mox(res.mox, trained, x))
  strict = _convert(variables, Strict, 'v1')
  mox = yax.make_mox(lambda p, x: model.apply(_convert(p, dict), x))(strict, x)
  with pytest.raises(yax.SubstitutionError,
                     match=r'cannot add to or remove from a .*Strict'):
    yax.lora(mox, strict, '//module_call[@type="Dense"]')


# ---------------------------------------------------- non-2-D kernels

class HandLoRADenseGeneral(nn.Module):
  """DenseGeneral over the trailing input axes with a hand-written adapter."""
  features: tuple
  n_in: int
  rank: int
  alpha: float

  @nn.compact
  def __call__(self, x):
    in_shape = x.shape[x.ndim - self.n_in:]
    kernel = self.param('kernel', nn.initializers.zeros,
                        in_shape + self.features)
    bias = self.param('bias', nn.initializers.zeros, self.features)
    # Unflattened adapters: A [*in_axes, rank], B [rank, *features].
    a = self.param('lora_a', nn.initializers.zeros, in_shape + (self.rank,))
    b = self.param('lora_b', nn.initializers.zeros,
                   (self.rank,) + self.features)
    axes = tuple(range(x.ndim - self.n_in, x.ndim))
    y = jnp.tensordot(x, kernel, (axes, tuple(range(self.n_in)))) + bias
    delta = jnp.tensordot(jnp.tensordot(x, a, (axes, tuple(range(self.n_in)))),
                          b, 1)
    return y + (self.alpha / self.rank) * delta


@pytest.mark.parametrize('features,axis,x_shape', [
    ((2, 8), -1, (3, 16)),      # kernel [16, 2, 8]
    (8, (-2, -1), (3, 2, 16)),  # kernel [2, 16, 8]
])
def test_dense_general_is_adapted_along_its_contracted_axes(features, axis,
                                                            x_shape):
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jnp.tanh(nn.DenseGeneral(features, axis=axis, name='proj')(x))

  model = Model()
  x = jax.random.normal(jax.random.key(0), x_shape)
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  res = lora_ok(yax.lora(mox, variables, '//module_call[@type="DenseGeneral"]',
                         rank=3, alpha=1.5))
  n_in = 1 if isinstance(axis, int) else len(axis)
  feats = (features,) if isinstance(features, int) else features
  p = res.params['params']['proj']
  assert p['lora_a'].shape == (*x_shape[-n_in:], 3)
  assert p['lora_b'].shape == (3, *feats)
  close(yax.eval_mox(res.mox, res.params, x), model.apply(variables, x))
  trained = bump(res, 0.2)

  class Reference(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jnp.tanh(HandLoRADenseGeneral(feats, n_in, 3, 1.5, name='proj')(x))

  ref = Reference().apply(trained, x)
  close(yax.eval_mox(res.mox, trained, x), ref)
  close(model.apply(res.merge(trained), x), ref)


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(st.integers(1, 3), min_size=1, max_size=2),
       in_axes=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       features=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       rank=st.integers(1, 3), seed=st.integers(0, 50))
def test_dense_general_lora_matches_a_hand_written_adapter(
    batch, in_axes, features, rank, seed):
  features, n_in = tuple(features), len(in_axes)
  axis = tuple(range(-n_in, 0))
  dense = nn.DenseGeneral(features, axis=axis)
  x = jax.random.normal(jax.random.key(seed), (*batch, *in_axes))
  variables = dense.init(jax.random.key(seed + 1), x)
  mox = yax.make_mox(dense.apply)(variables, x)
  res = lora_ok(yax.lora(mox, variables, rank=rank, alpha=2.0,
                         selection='//module_call[@type="DenseGeneral"]',
                         key=jax.random.key(seed + 2)))
  trained = bump(res, 0.1)
  ref = HandLoRADenseGeneral(features, n_in, rank, 2.0).apply(trained, x)
  close(yax.eval_mox(res.mox, trained, x), ref, tol=1e-4)
  close(dense.apply(res.merge(trained), x), ref, tol=1e-4)


# ------------------------------------------------ no silent fallbacks

def test_unknown_key_path_steps_are_reported():
  from yax._src.ir.variables import key_name as _key_name
  assert _key_name(jax.tree_util.DictKey('a')) == 'a'
  assert _key_name(jax.tree_util.SequenceKey(2)) == 2
  assert _key_name(jax.tree_util.GetAttrKey('x')) == 'x'
  with pytest.raises(yax.YaxError, match='key path step of unknown kind str'):
    _key_name('a')


class WeightNormDense(nn.Module):
  """Hugging Face Wav2Vec2's positional conv pattern: the module's own
  params (``bias`` read as is) are passed to a nested ``Module.apply``,
  whose root call reads them under a path of its own."""
  features: int

  def setup(self):
    self.inner = nn.Dense(self.features)
    self.weight_v = self.param('weight_v', nn.initializers.normal(),
                               (6, self.features))
    self.bias = self.param('bias', nn.initializers.zeros, (self.features,))

  def __call__(self, x):
    kernel = self.weight_v / jnp.linalg.norm(self.weight_v, axis=0)
    return self.inner.apply({'params': {'kernel': kernel, 'bias': self.bias}},
                            x)


def test_a_nested_apply_reading_params_does_not_move_the_collection():
  """The root call of the nested apply reads ``bias`` at the path 'bias'
  while the argument holds it at 'params/pos/bias': the params collection
  stays at args[0]['params'] (it once became args[0]['params']['pos'] and
  every adapter was refused as misplaced)."""
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = jnp.tanh(WeightNormDense(6, name='pos')(x))
      h = jnp.tanh(nn.Dense(6, name='q')(h))
      return nn.Dense(3, name='out')(h)

  model = Model()
  x = jax.random.normal(jax.random.key(0), (2, 6))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  res = lora_ok(yax.lora(mox, variables,
                         '//module_call[@path="q" or @path="out"]', rank=2))
  assert res.paths == [('out',), ('q',)]
  assert set(res.params['params']['q']) == {'kernel', 'bias', 'lora_a',
                                            'lora_b'}
  close(yax.eval_mox(res.mox, res.params, x), model.apply(variables, x))
  trained = bump(res, 0.2)
  close(model.apply(res.merge(trained), x),
        yax.eval_mox(res.mox, trained, x))
