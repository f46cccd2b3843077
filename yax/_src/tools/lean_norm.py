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
E[x]^2``, used here too unless ``use_fast_variance=False``; Equinox's
``jnp.var``). A selected call (``nn.LayerNorm``/``nn.RMSNorm``,
``nnx.LayerNorm``/``nnx.RMSNorm``, ``eqx.nn.LayerNorm``/``eqx.nn.RMSNorm``
of one feature axis, its ``weight`` as the scale) keeps its type, path,
fields and variables, so queries written for the plain model still find
it; its body becomes the ``custom_vjp`` and it gains the field
``lean="norm"``.

A norm of any other class (MaxText's, Gemma's ``x * (1 + scale)``,
RecurrentGemma's, Tunix's, Hugging Face's ``FlaxT5LayerNorm`` ...) is read
from what its body computes (``lean_norm_body.py``): the mean of squares
(or the variance) over the last axis, ``rsqrt(. + eps)``, a scale with a
constant offset, a bias, whatever the classes and primitives that spell
them; the lean body then computes it in float32 with a two-pass variance
and casts to the call's output dtype. Its static arguments (MaxText's
``out_sharding``) stay inputs of the call and are not read.

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

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import tree_util as jtu

from yax._src.errors import SubstitutionError
from yax._src.ir.nodes import Literal, Mox, iter_nodes
from yax._src.rewrite import activations as _activations
from yax._src.rewrite.engine import describe, leave_out_hint, select, substitute
from yax._src.tools import lean_norm_body as _body
from yax._src.trace import systems as _systems
from yax._src.trace.make import make_mox
from yax._src.views.query import query

DEFAULT = '//module_call[@type="LayerNorm" or @type="RMSNorm"]'


def _stats(x, rms: bool, eps: float, fast: bool):
  x32 = x.astype(jnp.float32)
  if rms:
    mean = jnp.zeros(x.shape[:-1] + (1,), jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  elif fast:  # Flax's default: E[x^2] - E[x]^2
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.maximum(
        jnp.mean(jnp.square(x32), axis=-1, keepdims=True) - jnp.square(mean),
        0.0)
  else:  # E[(x - E[x])^2], as jnp.var (Equinox; Flax's
    mean = jnp.mean(x32, axis=-1, keepdims=True)  # use_fast_variance=False)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  return mean, jax.lax.rsqrt(var + eps)


@functools.lru_cache(maxsize=None)
def lean_function(rms: bool, eps: float, use_scale: bool, use_bias: bool,
                  fast: bool = True, offset: float = 0.0, out_dtype=None):
  """``f(x, scale, bias)`` (absent ones passed as None) with the lean
  backward pass; ``fast``: the variance as ``E[x^2] - E[x]^2``;
  ``offset``: the scale applied as ``scale + offset`` (Gemma's ``1 +
  scale``); ``out_dtype``: the output's dtype (None: the input's)."""

  def effective(scale):
    return scale.astype(jnp.float32) + offset

  def forward(x, scale, bias):
    mean, rstd = _stats(x, rms, eps, fast)
    y = (x.astype(jnp.float32) - mean) * rstd
    if use_scale:
      y = y * effective(scale)
    if use_bias:
      y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype), mean, rstd

  @jax.custom_vjp
  def f(x, scale, bias):
    return forward(x, scale, bias)[0]

  def f_fwd(x, scale, bias):
    y, mean, rstd = forward(x, scale, bias)
    keep_mean = None if rms else mean
    return y, (x, keep_mean, rstd, scale, bias)

  def f_bwd(res, g):
    x, mean, rstd, scale, bias = res
    g32 = g.astype(jnp.float32)
    centred = x.astype(jnp.float32) - (0.0 if mean is None else mean)
    xhat = centred * rstd
    rows = tuple(range(x.ndim - 1))
    gh = g32 * effective(scale) if use_scale else g32
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


def _kind(cls) -> tuple[str, bool] | None:
  """``(system, rms)`` of a norm class lean_norm rewrites: ``'flax'``
  (Linen and NNX) or ``'equinox'``, and whether it is an RMSNorm; None
  for any other class. Each call keeps its type, path, fields and
  variables; only its body changes."""
  kind = _systems.norm_kind(cls)
  if kind is not None:
    return 'flax', kind == 'rms'
  kind = _systems.equinox_norm_kind(cls)
  if kind is not None:
    return 'equinox', kind == 'rms'
  return None


@dataclasses.dataclass(frozen=True)
class _Norm:
  """What the lean body of one norm call needs: ``f(x, scale, bias)`` of
  :func:`lean_function` with these settings, its ``scale`` and ``bias``
  the call's variables at these positions (None: absent)."""
  rms: bool
  eps: float
  fast: bool
  scale: int | None
  bias: int | None
  offset: float = 0.0
  out_dtype: object = None
  x: int = 0  # the input's position among the call's arguments


def _last_axis(value) -> bool:
  return value in (-1, (-1,), [-1])


def _norm(node) -> _Norm | str:
  """The settings of a norm call lean_norm can rewrite, or why it cannot."""
  if not isinstance(node, Mox) or node.is_ephemeral:
    return 'it is not a module call'
  kind = _kind(node.module_ty)
  if kind is None:  # another library's norm: read from what it computes
    return _read(node)
  if node.rewritten:
    return ('another rewrite changed its variables (rewritten="true"); '
            'lean_norm reads a norm\'s own scale and bias')
  p = node.params
  if 'compute_dtype' in p:
    return (f'yax.cast made it compute in {p["compute_dtype"]}; lean_norm '
            'computes in float32 and would drop that (leave norms out of '
            'the cast)')
  if len(node.arg_inputs) != 1:
    return f'it takes {len(node.arg_inputs)} arguments, expected one'
  x = node.arg_inputs[0]
  if isinstance(x, Literal) or not getattr(x.aval, 'shape', ()):
    return 'its argument is not a traced array with a feature axis'
  system, rms = kind
  if len(node.outputs) != 1 or node.outputs[0].aval.dtype != x.aval.dtype:
    return ('its output dtype differs from its input\'s (a dtype= '
            'setting); lean_norm keeps the input dtype')
  if system == 'flax':
    if not _last_axis(p.get('reduction_axes', -1)) or not _last_axis(
        p.get('feature_axes', -1)):
      return (f'it normalises over reduction_axes='
              f'{p.get("reduction_axes")!r} with feature_axes='
              f'{p.get("feature_axes")!r}; lean_norm supports the last axis '
              'for both')
    if p.get('axis_name') is not None or \
        p.get('axis_index_groups') is not None:
      return 'it reduces across devices (axis_name); lean_norm does not'
    use_scale, use_bias = p.get('use_scale', True), \
        p.get('use_bias', True) and not rms
    eps, fast, scale_name = float(p.get('epsilon', 1e-6)), \
        p.get('use_fast_variance', True), 'scale'
  else:  # Equinox: the whole (per-example) shape is normalised
    shape = tuple(p.get('shape', ()))
    if len(shape) != 1 or tuple(x.aval.shape[-1:]) != shape:
      return (f'it normalises over shape={shape!r} for an input '
              f'{x.aval.str_short()}; lean_norm supports one feature axis, '
              'the last')
    use_scale, use_bias = p.get('use_weight', True), p.get('use_bias', True)
    eps, fast, scale_name = float(p['eps']), False, 'weight'
  names = _variable_names(node)
  wanted = {scale_name} if use_scale else set()
  if use_bias:
    wanted.add('bias')
  if names is None or set(names) != wanted:
    return (f'it reads the variables {names!r}, expected '
            f'{sorted(wanted)!r} (its own scale/bias)')
  features = x.aval.shape[-1]
  odd = [n for n, s in zip(names, node.var_inputs)
         if tuple(s.aval.shape) != (features,)]
  if odd:
    return (f'its variables {odd!r} are not of shape ({features},) (a '
            'stack of norms under a transform); lean_norm reads one scale '
            'and bias')
  return _Norm(rms, eps, fast,
               names.index(scale_name) if use_scale else None,
               names.index('bias') if use_bias else None)


def _read(node: Mox) -> _Norm | str:
  """The settings of a call of another class, read from its body (its
  static arguments, such as MaxText's ``out_sharding``, are left out)."""
  if node.rewritten:
    return ('another rewrite changed its variables (rewritten="true"); '
            'lean_norm reads a norm\'s own scale and bias')
  if 'compute_dtype' in node.params:
    return (f'yax.cast made it compute in {node.params["compute_dtype"]}; '
            'lean_norm computes in float32 and would drop that (leave norms '
            'out of the cast)')
  if any(isinstance(c, Mox) for c in node.children):
    return ('it calls other modules; a norm computes its output from its '
            'input and variables alone')
  read = _body.read_norm(node)
  if isinstance(read, str):
    return read
  return _Norm(read.rms, read.eps, False, read.scale, read.bias,
               read.offset, jnp.dtype(node.outputs[0].aval.dtype), read.x)


def _variable_names(node: Mox) -> list | None:
  """The name of each variable input of a norm call, in input order (an
  NNX or Equinox call's top-level names; a Linen call's names in
  ``params``), or None when they are not laid out so."""
  names = []
  for path, _ in jtu.tree_flatten_with_path(
      jtu.tree_unflatten(node.var_tree, list(range(node.num_vars))))[0]:
    keys = [getattr(k, 'key', getattr(k, 'name', None)) for k in path]
    if len(keys) == 2 and keys[0] == 'params':  # Linen: {'params': {...}}
      keys = keys[1:]
    if len(keys) != 1:
      return None
    names.append(keys[0])
  return names


def _lean_call(node: Mox) -> Mox:
  """The norm call with its body replaced by the lean ``custom_vjp``: same
  inputs (variables, then ``x``), outputs, type, path and fields, plus the
  field ``lean="norm"``."""
  norm = _norm(node)
  fn = lean_function(norm.rms, norm.eps, norm.scale is not None,
                     norm.bias is not None, norm.fast, norm.offset,
                     norm.out_dtype)

  def run(values):
    pick = lambda k: None if k is None else values[k]
    return fn(values[node.num_vars + norm.x], pick(norm.scale),
              pick(norm.bias))

  # A static argument (a Literal: MaxText's out_sharding) is passed as it
  # is, so the call keeps its inputs.
  root = make_mox(run)([s.value if isinstance(s, Literal) else
                        jax.ShapeDtypeStruct(tuple(s.aval.shape),
                                             s.aval.dtype)
                        for s in node.inputs])
  call = Mox(root.inputs, root.outputs, {**node.params, 'lean': 'norm'},
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


def _default_norms(mox: Mox) -> list:
  """What ``selection=None`` selects, in tree order: every call of a type
  named ``LayerNorm`` or ``RMSNorm`` (refused with the reason where it is
  not one lean_norm can rewrite), and every other module call that calls
  no module and whose body computes a norm (``FlaxT5LayerNorm``, ...)."""
  typed = {id(n) for n in query(DEFAULT, mox)}
  return [n for n in iter_nodes(mox) if isinstance(n, Mox) and (
      id(n) in typed or (
          n is not mox and not n.is_ephemeral and n.params.get('lean') is None
          and not any(isinstance(c, Mox) for c in n.children)
          and not isinstance(_norm(n), str)))]


def lean_norm(mox: Mox, selection=None, *, activations=False) -> Mox:
  """LayerNorm/RMSNorm calls that keep their input and per-row statistics
  for the backward pass, with exact gradients.

  **Arguments:**
  - ``mox``: the traced tree (left unchanged).
  - ``selection``: XPath or node list of norm calls: ``flax.linen``,
    ``flax.nnx`` or Equinox ``LayerNorm`` / ``RMSNorm``, or any call whose
    body computes a LayerNorm/RMSNorm over the last axis; ``None`` selects
    every call of a type named ``LayerNorm`` or ``RMSNorm`` and every other
    call (calling no module) whose body computes one.

  **Returns:** the new tree: each selected call keeps its type, path,
  fields and variables (``scale``/``bias``) and gains ``lean="norm"``;
  each activation found is a ``LeanActivation`` call (attribute ``name``:
  the activation). Outputs equal the original's within float rounding
  (activations: bit for bit), gradients exact.

  Raises ``SubstitutionError`` naming each selected call it cannot
  rewrite (a body that computes no norm, with the first equation it could
  not follow; another axis, a cross-device norm,
  a ``dtype`` that changes the output's, a norm ``yax.cast`` changed),
  ending with an XPath that leaves them out.

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
  if selection is None:
    found = _default_norms(mox)
    if not found and activations is not False:
      return _lean_activations(mox, activations)
    chosen = select(found or DEFAULT, mox)
  else:
    chosen = select(selection, mox)
  problems = [(n, why) for n in chosen.targets
              if isinstance(why := _norm(n), str)]
  if problems:
    lines = '\n'.join(f'  - {describe(n)}: {why}' for n, why in problems)
    hint = leave_out_hint([(n, False) for n, _ in problems],
                          DEFAULT if selection is None else selection,
                          chosen.targets)
    raise SubstitutionError(
        f'lean_norm cannot rewrite {len(problems)} of the '
        f'{len(chosen.targets)} calls selected by '
        f'{DEFAULT if selection is None else chosen.description}:\n'
        f'{lines}\n{hint}')

  new = substitute(chosen, lambda path, node: _lean_call(node), mox).mox
  if activations is False:
    return new
  return _lean_activations(new, activations)
