"""``yax.lean_norm``: LayerNorm and RMSNorm that keep what PyTorch keeps.

JAX's autodiff of a LayerNorm keeps several full-size tensors for the
backward pass (the centred input, its square, the normalised output ...),
where PyTorch's fused kernel keeps the input and two per-row statistics.
Here each selected norm becomes one ``custom_vjp`` that keeps its input
``x`` and the per-row ``mean`` and ``rstd = 1 / sqrt(var + eps)`` (RMSNorm:
``rstd`` only), and computes the exact gradient from them:

``xhat = (x - mean) * rstd``, ``gh = g * scale``;
``dx = rstd * (gh - mean(gh) - xhat * mean(gh * xhat))`` (RMSNorm:
``xhat = x * rstd``, ``dx = rstd * (gh - xhat * mean(gh * xhat))``),
``dscale = sum(g * xhat)``, ``dbias = sum(g)`` over every axis but the
features.

The forward pass computes the norm in float32 as Flax does (equal within
float rounding, not bit for bit: Flax's fast variance is ``E[x^2] -
E[x]^2``, used here too). A selected Linen call is substituted by a
``LeanNorm`` module call at the same path reading the same ``scale`` and
``bias`` variables. An NNX call (``nnx.LayerNorm``/``nnx.RMSNorm``) keeps
its type, path, fields and variables; its body becomes the ``custom_vjp``
and it gains the field ``lean="norm"``.

With ``activations=``, element-wise activations keep one tensor too.
JAX's autodiff of an activation keeps what its derivative's formula reads:
GELU's tanh form keeps its input, its square, the tanh and more (four or
five full-size tensors), SiLU its input and the sigmoid. A
``LeanActivation`` call keeps only its input ``x`` and, in the backward
pass, computes ``f'(x) * g`` from it again (``jax.vjp`` of the same
function at ``x``: the gradient of plain code, recomputed element-wise).
Activations are found by data flow as ``yax.fewbit`` finds them (the same
list: GELU in both forms, SiLU, ReLU, ...), and a ``FewBit`` call is left
as it is: ``fewbit`` then ``lean_norm(activations=True)`` keeps fewbit's
codes where fewbit chose and one tensor everywhere else.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import tree_util as jtu

from yax._src.errors import SubstitutionError
from yax._src.ir.nodes import Literal, Mox, iter_nodes
from yax._src.rewrite import activations as _activations
from yax._src.rewrite.engine import describe, leave_out_hint, select, substitute
from yax._src.trace import systems as _systems
from yax._src.trace.make import make_mox
from yax._src.views.query import query

DEFAULT = '//module_call[@type="LayerNorm" or @type="RMSNorm"]'


def _stats(x, rms: bool, eps: float):
  x32 = x.astype(jnp.float32)
  if rms:
    mean = jnp.zeros(x.shape[:-1] + (1,), jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  else:
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.maximum(
        jnp.mean(jnp.square(x32), axis=-1, keepdims=True) - jnp.square(mean),
        0.0)
  return mean, jax.lax.rsqrt(var + eps)


@functools.lru_cache(maxsize=None)
def lean_function(rms: bool, eps: float, use_scale: bool, use_bias: bool):
  """``f(x, scale, bias)`` (absent ones passed as None) with the lean
  backward pass."""

  def forward(x, scale, bias):
    mean, rstd = _stats(x, rms, eps)
    y = (x.astype(jnp.float32) - mean) * rstd
    if use_scale:
      y = y * scale.astype(jnp.float32)
    if use_bias:
      y = y + bias.astype(jnp.float32)
    return y, mean, rstd

  @jax.custom_vjp
  def f(x, scale, bias):
    return forward(x, scale, bias)[0].astype(x.dtype)

  def f_fwd(x, scale, bias):
    y, mean, rstd = forward(x, scale, bias)
    keep_mean = None if rms else mean
    return y.astype(x.dtype), (x, keep_mean, rstd, scale, bias)

  def f_bwd(res, g):
    x, mean, rstd, scale, bias = res
    g32 = g.astype(jnp.float32)
    centred = x.astype(jnp.float32) - (0.0 if mean is None else mean)
    xhat = centred * rstd
    rows = tuple(range(x.ndim - 1))
    gh = g32 * scale.astype(jnp.float32) if use_scale else g32
    inner = jnp.mean(gh * xhat, axis=-1, keepdims=True)
    if rms:
      dx = rstd * (gh - xhat * inner)
    else:
      dx = rstd * (gh - jnp.mean(gh, axis=-1, keepdims=True) - xhat * inner)
    dscale = jnp.sum(g32 * xhat, axis=rows).astype(scale.dtype) \
        if use_scale else None
    dbias = jnp.sum(g32, axis=rows).astype(bias.dtype) if use_bias else None
    return dx.astype(x.dtype), dscale, dbias

  f.defvjp(f_fwd, f_bwd)
  return f


class LeanNorm(nn.Module):
  """A LayerNorm (``rms=False``) or RMSNorm over the last axis whose
  backward pass keeps its input and per-row statistics."""
  rms: bool = False
  epsilon: float = 1e-6
  use_scale: bool = True
  use_bias: bool = True
  param_dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x):
    features = (x.shape[-1],)
    scale = self.param('scale', nn.initializers.ones, features,
                       self.param_dtype) if self.use_scale else None
    bias = self.param('bias', nn.initializers.zeros, features,
                      self.param_dtype) if self.use_bias else None
    return lean_function(self.rms, float(self.epsilon), self.use_scale,
                         self.use_bias)(x, scale, bias)


def _is_rms(node: Mox) -> bool:
  return _systems.norm_kind(node.module_ty) == 'rms'


def _keeps_call(node: Mox) -> bool:
  """An NNX norm keeps its call (type, path, variables); only the body
  changes. A Linen one becomes a ``LeanNorm`` call."""
  return not _systems.is_rebuilt_module(node.module_ty)


def _last_axis(value) -> bool:
  return value in (-1, (-1,), [-1])


def _why_not(node) -> str | None:
  if not isinstance(node, Mox) or _systems.norm_kind(
      node.module_ty) is None:
    return ('it is not a flax.linen or flax.nnx LayerNorm or RMSNorm call '
            '(lean_norm rewrites those)')
  if node.rewritten:
    return ('another rewrite changed its variables (rewritten="true"); '
            'lean_norm reads a norm\'s own scale and bias')
  p = node.params
  if not _last_axis(p.get('reduction_axes', -1)) or not _last_axis(
      p.get('feature_axes', -1)):
    return (f'it normalises over reduction_axes={p.get("reduction_axes")!r} '
            f'with feature_axes={p.get("feature_axes")!r}; lean_norm supports '
            'the last axis for both')
  if p.get('axis_name') is not None or p.get('axis_index_groups') is not None:
    return 'it reduces across devices (axis_name); lean_norm does not'
  if len(node.arg_inputs) != 1:
    return f'it takes {len(node.arg_inputs)} arguments, expected one'
  x = node.arg_inputs[0]
  if isinstance(x, Literal) or not getattr(x.aval, 'shape', ()):
    return 'its argument is not a traced array with a feature axis'
  if len(node.outputs) != 1 or node.outputs[0].aval.dtype != x.aval.dtype:
    return ('its output dtype differs from its input\'s (a dtype= '
            'setting); lean_norm keeps the input dtype')
  if _keeps_call(node):
    names = _nnx_names(node)
    wanted = {'scale'} if p.get('use_scale', True) else set()
    if p.get('use_bias', True) and not _is_rms(node):
      wanted.add('bias')
    if names is None or set(names) != wanted:
      return (f'it reads the variables {names!r}, expected '
              f'{sorted(wanted)!r} (its own scale/bias)')
  return None


def _nnx_names(node: Mox) -> list | None:
  """The name of each variable input of an NNX call, in input order, or
  None when they are not top-level names."""
  names = []
  for path, _ in jtu.tree_flatten_with_path(
      jtu.tree_unflatten(node.var_tree, list(range(node.num_vars))))[0]:
    if len(path) != 1:
      return None
    key = path[0]
    names.append(getattr(key, 'key', getattr(key, 'name', None)))
  return names


def _nnx_replacement(node: Mox) -> Mox:
  """The NNX call with its body replaced by the lean ``custom_vjp``: same
  inputs (variables, then ``x``), outputs, type, path and fields."""
  p = node.params
  rms = _is_rms(node)
  use_scale = p.get('use_scale', True)
  use_bias = p.get('use_bias', True) and not rms
  fn = lean_function(rms, float(p.get('epsilon', 1e-6)), use_scale, use_bias)
  names = _nnx_names(node)

  def run(values):
    own = dict(zip(names, values[:node.num_vars]))
    return fn(values[node.num_vars], own.get('scale'), own.get('bias'))

  root = make_mox(run)([jax.ShapeDtypeStruct(tuple(s.aval.shape),
                                             s.aval.dtype)
                        for s in node.inputs])
  call = Mox(root.inputs, root.outputs, {**p, 'lean': 'norm'},
             children=root.children, module_ty=node.module_ty,
             entrypoint=node.entrypoint, path=node.path,
             in_tree=node.in_tree, out_tree=node.out_tree,
             var_tree=node.var_tree)
  return Mox(root.inputs, root.outputs, {}, children=[call],
             constvars=root.constvars, consts=root.consts)


@functools.lru_cache(maxsize=None)
def lean_activation_function(name: str, slope: float | None = None):
  """The activation ``name`` (a key of the activations ``fewbit`` finds)
  whose backward pass keeps its input only; ``slope``: leaky ReLU's
  negative slope where it is not the default."""
  fn = _activations.ACTIVATIONS[name]
  if slope is not None:
    fn = functools.partial(fn, negative_slope=slope)

  @jax.custom_vjp
  def f(x):
    return fn(x)

  def f_fwd(x):
    return fn(x), x

  def f_bwd(x, g):
    return jax.vjp(fn, x)[1](g)

  f.defvjp(f_fwd, f_bwd)
  f.__name__ = f'lean_{name}'
  return f


class LeanActivation(nn.Module):
  """An element-wise activation (``name``, as ``FewBit``'s) whose backward
  pass keeps its input only and recomputes the derivative from it."""
  slope: float | None = None

  @nn.compact
  def __call__(self, x):
    return lean_activation_function(self.name, self.slope)(x)


class _ActivationReplacement:
  """``(path, group node) -> LeanActivation`` call traced at its input."""

  def __init__(self):
    self.cache: dict = {}

  def __call__(self, path, node: Mox) -> Mox:
    del path
    (x,) = node.arg_inputs
    slope = None
    if node.name == 'leaky_relu':
      slopes = [v for v in map(_activations.leaky_slope, iter_nodes(node))
                if v is not None]
      # The default slope (as the trace's float32 rounds it) stays None.
      if slopes and float(jnp.float32(slopes[0])) != float(
          jnp.float32(_activations.LEAKY_SLOPE)):
        slope = slopes[0]
    key = (node.name, slope, tuple(x.aval.shape), jnp.dtype(x.aval.dtype))
    traced = self.cache.get(key)
    if traced is None:
      module = LeanActivation(name=node.name, slope=slope)
      spec = jax.ShapeDtypeStruct(tuple(x.aval.shape), x.aval.dtype)
      traced = self.cache[key] = make_mox(module.apply)({}, spec)
    return traced


def _lean_activations(mox: Mox, where) -> Mox:
  """Every supported activation under ``where`` (True: the whole tree; an
  XPath: the module calls it selects) as a ``LeanActivation`` call."""
  within = None
  if where is not True:
    within = list(select(where, mox).targets)
    if not all(isinstance(n, Mox) for n in within):
      raise SubstitutionError(
          f'lean_norm: activations={where!r} must select module calls to '
          f'search; it holds '
          f'{describe(next(n for n in within if not isinstance(n, Mox)))}')
  found = _activations.find(mox, within)
  done = [n for top in (within or [mox]) for n in iter_nodes(top)
          if isinstance(n, Mox) and n.type_name in _activations.REWRITTEN]
  if not found and done:  # every activation is FewBit or lean already
    return mox
  if not found:
    ops = _activations.elementwise_found(within if within is not None
                                         else [mox])
    place = 'the tree' if where is True else repr(where)
    raise SubstitutionError(
        f'lean_norm: activations={where!r} found no supported activation '
        f'in {place} (FewBit and LeanActivation calls are left as they '
        f'are); found the element-wise operations '
        f'{", ".join(ops) or "(none)"}; supported: '
        f'{", ".join(_activations.ACTIVATIONS)}')
  tree, nodes = _activations.group(mox, found)
  return substitute(nodes, _ActivationReplacement(), tree).mox


def lean_norm(mox: Mox, selection=None, *, activations=False) -> Mox:
  """LayerNorm/RMSNorm calls that keep their input and per-row statistics
  for the backward pass, with exact gradients.

  **Arguments:**
  - ``mox``: the traced tree (left unchanged).
  - ``selection``: XPath or node list of ``flax.linen`` or ``flax.nnx``
    ``LayerNorm`` / ``RMSNorm`` calls; ``None`` selects every one.

  **Returns:** the new tree: each selected Linen call is a ``LeanNorm``
  call at the same path, reading the same ``scale``/``bias``; each NNX
  call keeps its type, path and variables and gains ``lean="norm"``;
  each activation found is a ``LeanActivation`` call (attribute ``name``:
  the activation). Outputs equal the original's within float rounding
  (activations: bit for bit), gradients exact.

  Raises ``SubstitutionError`` naming each selected call it cannot
  rewrite (not a Linen LayerNorm/RMSNorm, another axis, a cross-device
  norm, a ``dtype`` that changes the output's), ending with an XPath that
  leaves them out.

  Example::

      lean = yax.lean_norm(mox, activations=True)
      grads = jax.grad(lambda p: loss(yax.eval_mox(lean, p, x)))(params)
  """
  if not isinstance(mox, Mox):
    raise SubstitutionError(
        f'lean_norm expects a Mox, found {type(mox).__name__}')
  if activations is not False and activations is not True and \
      not isinstance(activations, str):
    raise SubstitutionError(
        f'lean_norm: activations must be False, True or an XPath of module '
        f'calls, found {activations!r}')
  if selection is None and activations is not False and \
      not query(DEFAULT, mox):
    return _lean_activations(mox, activations)
  chosen = select(DEFAULT if selection is None else selection, mox)
  problems = [(n, why) for n in chosen.targets
              if (why := _why_not(n)) is not None]
  if problems:
    lines = '\n'.join(f'  - {describe(n)}: {why}' for n, why in problems)
    hint = leave_out_hint([(n, False) for n, _ in problems],
                          DEFAULT if selection is None else selection,
                          chosen.targets)
    raise SubstitutionError(
        f'lean_norm cannot rewrite {len(problems)} of the '
        f'{len(chosen.targets)} calls selected by {chosen.description}:\n'
        f'{lines}\n{hint}')

  def replace(path, node):
    del path
    if _keeps_call(node):
      return _nnx_replacement(node)
    p = node.params
    x = node.arg_inputs[0]
    module = LeanNorm(rms=_is_rms(node),
                      epsilon=p.get('epsilon', 1e-6),
                      use_scale=p.get('use_scale', True),
                      use_bias=p.get('use_bias', True) and
                      not _is_rms(node),
                      param_dtype=p.get('param_dtype', jnp.float32),
                      name=node.path[-1] if node.path else None)
    spec = jax.ShapeDtypeStruct(tuple(x.aval.shape), x.aval.dtype)
    variables = jax.eval_shape(module.init, jax.random.key(0), spec)
    return make_mox(module.apply)(variables, spec)

  new = substitute(chosen, replace, mox).mox
  if activations is False:
    return new
  return _lean_activations(new, activations)
