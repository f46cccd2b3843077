"""LoRA: low-rank adapters on the linear layers of a traced model.

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (2021),
https://arxiv.org/abs/2106.09685. A frozen linear map ``y = x W + b`` gets a
trainable low-rank update::

    y = x W + b + (alpha / rank) * (x A) B,   A: [in, rank], B: [rank, out]

``B`` starts at zero, so the adapted model computes exactly what the original
did until the adapters are trained. ``yax.lora`` builds this on top of
``yax.sub``: each selected module call becomes a ``LoRA`` module call whose
body is the original call followed by the adapter equations, and whose
variables are the original ones plus ``lora_a`` and ``lora_b`` (stored next
to ``kernel`` in the params tree).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import tree_util as jtu

from yax._errors import SubstitutionError
from yax._ir import Equation, Literal, Mox, Symbol, Var
from yax._sub import _Substitution, _dyn, _insert, _key_name, _rel_keys
from yax._sub import resolve_targets
from yax._trace import make_mox


class LoRA:
  """Marker class for LoRA module calls (``module_ty`` of adapted nodes)."""


@dataclasses.dataclass
class LoraResult:
  """What ``yax.lora`` returns.

  Attributes:
    mox: the rewritten tree.
    params: the argument to pass where ``params`` went: the original weights
      and the adapters (``lora_a`` random, ``lora_b`` zero).
    mask: a pytree of bools with ``params``' structure, True exactly on the
      adapter weights (for ``optax.masked`` / ``optax.multi_transform``).
    merge: ``merge(p)`` folds trained adapters in ``p`` into the kernels and
      returns a params tree for the ORIGINAL tree.
  """
  mox: Mox
  params: Any
  mask: Any
  merge: Callable[[Any], Any]
  paths: list  # module paths that were adapted


def _kernel(node: Mox) -> Symbol | None:
  for keys, sym in zip(_rel_keys(node), node.var_inputs):
    if keys == ('params', 'kernel'):
      return sym
  return None


def _adapter_body(x_aval, y_aval, a_shape, b_shape, dtype, scale):
  """Traces ``y + scale * (x A) B`` once per distinct shape."""
  return _traced_adapter(tuple(x_aval.shape), x_aval.dtype,
                         tuple(y_aval.shape), y_aval.dtype, tuple(a_shape),
                         tuple(b_shape), dtype, scale)


# The traced adapter is only read (its symbols are re-wired per node), so one
# trace serves every node of the same shapes: BERT-base's 73 Dense layers need
# 3 traces instead of 73.
@functools.lru_cache(maxsize=256)
def _traced_adapter(x_shape, x_dtype, y_shape, y_dtype, a_shape, b_shape,
                    dtype, scale):
  def adapter(y, x, a, b):
    delta = (x.astype(dtype) @ a) @ b
    return y + (scale * delta).astype(y.dtype)
  spec = jax.ShapeDtypeStruct
  return make_mox(adapter)(spec(y_shape, y_dtype), spec(x_shape, x_dtype),
                           spec(a_shape, dtype), spec(b_shape, dtype))


def _lora_template(node: Mox, rank: int, alpha: float) -> Mox:
  """A ``LoRA`` module call wrapping ``node``; reads the node's symbols."""
  kernel = _kernel(node)
  if kernel is None or kernel.aval is None or kernel.aval.ndim < 2:
    found = ', '.join('/'.join(k) + ':' + s.type_str
                      for k, s in zip(_rel_keys(node), node.var_inputs))
    raise SubstitutionError(
        f"lora expects Dense-like module calls (a 'params/kernel' variable of "
        f"shape [..., in, out]), but the module call "
        f"{node.type_name or 'ephemeral'} at path '{'/'.join(node.path)}' has "
        f"variables [{found or 'none'}]")
  xs = _dyn(node.arg_inputs)
  ys = _dyn(node.outputs)
  d_in, d_out = kernel.aval.shape[-2], kernel.aval.shape[-1]
  if (len(xs) != 1 or len(ys) != 1 or xs[0].aval.shape[-1:] != (d_in,)
      or ys[0].aval.shape[-1:] != (d_out,)):
    raise SubstitutionError(
        f"lora expects a module call with one input [..., {d_in}] and one "
        f"output [..., {d_out}] (its kernel is {kernel.type_str}); the call at "
        f"path '{'/'.join(node.path)}' takes "
        f"({', '.join(s.type_str for s in xs)}) and returns "
        f"({', '.join(s.type_str for s in ys)})")
  if kernel.aval.ndim != 2:
    raise SubstitutionError(
        f"lora supports 2-D kernels [in, out]; the kernel at path "
        f"'{'/'.join(node.path)}' is {kernel.type_str}")
  x, y = xs[0], ys[0]
  dtype = kernel.aval.dtype
  adapter = _adapter_body(x.aval, y.aval, (d_in, rank), (rank, d_out), dtype,
                          alpha / rank)
  a, b = Var(jax.core.ShapedArray((d_in, rank), dtype)), Var(
      jax.core.ShapedArray((rank, d_out), dtype))
  # Wire the adapter's inputs (y, x, a, b) to the node's symbols.
  y_in, x_in, a_in, b_in = _dyn(adapter.inputs)
  wiring = {y_in: y, x_in: x, a_in: a, b_in: b}
  children = [node]
  for eqn in adapter.children:
    new_out = [Var(s.aval) for s in eqn.outputs]
    wiring.update(zip(eqn.outputs, new_out))
    children.append(eqn.replace(
        inputs=[wiring.get(s, s) for s in eqn.inputs], outputs=new_out))
  out = wiring.get(adapter.outputs[0], adapter.outputs[0])
  var_dict = (jtu.tree_unflatten(node.var_tree, node.var_inputs)
              if node.num_vars else {})
  var_dict = _insert(var_dict, ('params', 'lora_a'), a)
  var_dict = _insert(var_dict, ('params', 'lora_b'), b)
  var_inputs, var_tree = jtu.tree_flatten(
      var_dict, is_leaf=lambda s: isinstance(s, Symbol))
  outputs = [out if s is y else s for s in node.outputs]
  return Mox(var_inputs + list(node.arg_inputs), outputs,
             {'name': node.name, 'rank': rank, 'alpha': alpha,
              'base': node.type_name},
             children=children, module_ty=LoRA, entrypoint='__call__',
             path=node.path, in_tree=node.in_tree, out_tree=node.out_tree,
             var_tree=var_tree)


def _params_position(sub: _Substitution, params) -> tuple:
  """The root keypath prefix of the argument that holds ``params``."""
  prefix = sub.prefix.get('params')
  if prefix is None:
    raise SubstitutionError(
        "lora found no 'params' collection among the traced arguments; trace "
        "a function that takes the parameters as an argument, e.g. "
        "make_mox(model.apply)(variables, x) or make_mox(model)(x, params=p)")
  # prefix = (0|1, position or kwarg name, *keys inside that argument)
  root_args = jtu.tree_unflatten(sub.root.in_tree, sub.root.inputs)
  arg = root_args[prefix[0]][prefix[1]]
  if jtu.tree_structure(arg) != jtu.tree_structure(params):
    raise SubstitutionError(
        'lora: `params` must have the structure of the traced argument that '
        f'holds the parameters ({"args" if prefix[0] == 0 else "kwargs"}'
        f'[{prefix[1]!r}]).\n  expected: {jtu.tree_structure(arg)}\n'
        f'  given:    {jtu.tree_structure(params)}')
  return prefix


def lora(mox: Mox, params, selection='//module_call[@type="Dense"]', *,
         rank: int = 4, alpha: float = 1.0, key=None) -> LoraResult:
  """Wraps every selected linear module call in a LoRA adapter.

  **Arguments:**
  - ``mox``: the traced tree (left unchanged).
  - ``params``: the traced argument that holds the parameters: the variables
    dict for ``model.apply`` (``{'params': ...}``) or the params tree of an
    HF-style call (``model(x, params=...)``).
  - ``selection``: XPath (or node list) of Dense-like module calls (a 2-D
    ``kernel`` [in, out]).
  - ``rank``, ``alpha``: adapter rank and scale (``alpha / rank``).
  - ``key``: PRNG key for ``lora_a`` (``jax.random.key(0)`` if omitted).

  **Returns:** a :class:`LoraResult` with ``.mox``, ``.params``, ``.mask``,
  ``.merge``.

  Example::

      res = yax.lora(mox, variables, '//module_call[@type="Dense"]', rank=8)
      y = yax.eval_mox(res.mox, res.params, x)     # equals the original at init
  """
  if not isinstance(mox, Mox):
    raise SubstitutionError(f'lora expects a Mox, found {type(mox).__name__}')
  if not isinstance(rank, int) or rank < 1:
    raise SubstitutionError(f'lora: rank must be a positive int, found {rank!r}')
  targets = [n for n in resolve_targets(selection, mox)]
  for node in targets:
    if not isinstance(node, Mox) or node.is_ephemeral:
      raise SubstitutionError(
          f'lora selects module calls, but {selection!r} matched {node!r}')
  if not targets:
    raise SubstitutionError(f'lora: {selection!r} matched no module call')
  templates = {}

  def make(path, node):
    if id(node) not in templates:
      templates[id(node)] = _lora_template(node, rank, alpha)
    return templates[id(node)]

  sub = _Substitution(mox, targets, make)
  prefix = _params_position(sub, params)
  new_mox = sub.run()

  key = jax.random.key(0) if key is None else key
  new_params, mask = params, jtu.tree_map(lambda _: False, params)
  adapted = []  # (keys of the module inside params, a shape, b shape)
  for loc, var in sorted(sub.added.items()):
    keys = (*prefix[2:], *loc[1:])
    if loc[-1] == 'lora_a':
      key, sub_key = jax.random.split(key)
      fan_in = var.aval.shape[0]
      value = (jax.random.normal(sub_key, var.aval.shape, var.aval.dtype)
               / jnp.sqrt(jnp.asarray(fan_in, var.aval.dtype)))
      adapted.append(tuple(loc[1:-1]))
    else:
      value = jnp.zeros(var.aval.shape, var.aval.dtype)
    new_params = _insert(new_params, keys, value)
    mask = _insert(mask, keys, True)
  scale = alpha / rank
  collection_keys = tuple(prefix[2:])

  def merge(trained):
    """Folds ``kernel + (alpha/rank) * lora_a @ lora_b`` for every adapter and
    returns params for the original tree (adapters removed)."""
    out = trained
    for module_path in adapted:
      keys = (*collection_keys, *module_path)
      module = _get(out, keys)
      a, b = module['lora_a'], module['lora_b']
      merged = {k: v for k, v in module.items() if k not in ('lora_a', 'lora_b')}
      merged['kernel'] = (module['kernel'] + scale * (a @ b)).astype(
          module['kernel'].dtype)
      out = _insert(out, keys, merged)
    return out

  return LoraResult(new_mox, new_params, mask, merge, adapted)


def _get(tree, keys):
  for k in keys:
    tree = tree[k]
  return tree
