"""``yax.init_params``: the variables a rewritten tree expects and the given
params lack, initialised by the modules that declare them.

A replacement with variables (ReLU -> PReLU at two sites) makes the tree
read ``params['PReLU_0']['alpha']`` and ``params['PReLU_1']['alpha']``.
``init_params`` finds, for each such variable, the module call that
declares it, builds that module again from the fields the trace recorded
(a Linen dataclass; an NNX module whose ``__init__`` arguments are among
its recorded attributes, with ``rngs``) and runs its initialiser at that
site's shapes, with ``key`` folded by the variable's path. Variables
already in ``params`` are returned unchanged, in the same containers.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import zlib

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
from jax import tree_util as jtu

from yax._src.errors import SubstitutionError
from yax._src.ir.arguments import boxed_like
from yax._src.ir.containers import set_many
from yax._src.ir.nodes import Mox, Symbol, iter_nodes
from yax._src.ir.variables import (NNX_GROUP, key_name, location, unboxed_path,
                                   var_entries, var_keys, var_kind)
from yax._src.rewrite import contraction as _contraction
from yax._src.rewrite.engine import collections_of
from yax._src.rewrite.quant_formats import FORMATS, quantize_kernel
from yax._src.trace import nnx as _nnx


def _declared(mox: Mox) -> dict:
  """``(collection, *module path, name)`` -> the module call that holds the
  variable as its own (the first one in evaluation order)."""
  out = {}
  for node in iter_nodes(mox):
    if isinstance(node, Mox) and not node.is_ephemeral:
      for entry in var_entries(node):
        if len(entry.rel_path) == 1:
          out.setdefault(location(node, entry), node)
  return out


def _example_args(node: Mox):
  """Zeros of the call's argument shapes, static arguments as traced."""
  values = [jnp.zeros(s.aval.shape, s.aval.dtype) if s.aval is not None
            else s.value for s in node.arg_inputs]
  return jtu.tree_unflatten(node.in_tree, values)


def _linen_variables(node: Mox, key) -> dict:
  cls = node.module_ty
  fields = {f.name for f in dataclasses.fields(cls)
            if f.init and f.name not in ('parent', 'name')}
  module = cls(**{k: v for k, v in node.params.items() if k in fields})
  args, kwargs = _example_args(node)
  method = node.entrypoint or '__call__'
  return module.init(key, *args, method=getattr(cls, method), **kwargs)


def _nnx_variables(node: Mox, key, where: str) -> dict:
  cls = node.module_ty
  signature = inspect.signature(cls.__init__)
  kwargs, missing = {}, []
  for name, p in list(signature.parameters.items())[1:]:
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
      continue
    if name == 'rngs':
      kwargs['rngs'] = nnx.Rngs(key)
    elif name in node.params:
      kwargs[name] = node.params[name]
    elif p.default is p.empty:
      missing.append(name)
  if missing:
    raise SubstitutionError(
        f'init_params: {where} is declared by the NNX module {cls.__name__}, '
        f'whose __init__ needs {missing}, which the trace did not record '
        f'(it recorded {sorted(k for k in node.params if k != "name")}); '
        'store them as attributes of the module, or pass the variable in '
        'params')
  module = cls(**kwargs)
  return nnx.state(module)


def init_params(mox: Mox, params, *, key):
  """Returns ``params`` completed with every variable ``mox`` expects and
  ``params`` lacks.

  **Arguments:**
  - ``mox``: a tree, typically rewritten by ``yax.sub`` with a replacement
    that brings variables (``PReLU`` in place of ``relu``).
  - ``params``: the argument of the traced function that holds the
    variables (the Linen variables dict, an HF params tree, an
    ``nnx.State``).
  - ``key``: a PRNG key; each variable's initialiser gets it folded with
    the variable's path.

  **Returns:** ``params`` (same container types) with the missing
  variables, each initialised by the ``init`` of the module that declares
  it, at that site's shapes. Raises ``yax.SubstitutionError`` naming the
  path of a missing variable that no module can initialise.

  Example::

      new = yax.sub('//*[@name="relu"]', prelu_mox, mox)
      full = yax.init_params(new, variables, key=jax.random.key(0))
      y = yax.eval_mox(new, full, x)
  """
  if not isinstance(mox, Mox):
    raise SubstitutionError(
        f'init_params expects a Mox, found {type(mox).__name__}')
  prefixes = collections_of(mox)
  if not prefixes:
    raise SubstitutionError(
        'init_params found no variable collection among the traced '
        'arguments of this tree')
  where_arg = {tuple(p[:2]) for p in prefixes.values()}
  if len(where_arg) != 1:
    raise SubstitutionError(
        'init_params needs the variables in one argument of the traced '
        f'function; this tree reads them from {sorted(where_arg)}')
  (side, position), = where_arg
  args, kwargs = jtu.tree_unflatten(mox.in_tree, mox.inputs)
  expected = (args if side == 0 else kwargs)[position]
  flat_expected = jtu.tree_flatten_with_path(
      expected, is_leaf=lambda s: isinstance(s, Symbol))[0]
  have = {_keys(kp) for kp, _ in jtu.tree_flatten_with_path(params)[0]}
  declared = _declared(mox)
  inside = {col: tuple(p[2:]) for col, p in prefixes.items()}
  cache, values = {}, []
  for keypath, sym in flat_expected:
    path = _keys(keypath)
    if path in have:
      continue
    col = next((c for c, pre in inside.items() if path[:len(pre)] == pre),
               None)
    # The variable's location: module paths and names are strings.
    loc = ((col, *map(str, path[len(inside[col]):])) if col is not None
           else None)
    node = declared.get(loc) if loc is not None else None
    where = 'params' + ''.join(f'[{k!r}]' for k in path)
    if node is None:
      raise SubstitutionError(
          f'init_params: the tree reads {where} ({sym.type_str}), which '
          'params lacks, and no module call of the tree declares it')
    folded = jax.random.fold_in(key, zlib.crc32('/'.join(loc).encode()))
    made = _rewrite_variable(node, loc[-1], sym, folded, params, keypath,
                             where)
    if made is not None:  # a LoRA adapter, a quantization scale
      values.extend(made)
      continue
    if id(node) not in cache:
      cls = node.module_ty
      if isinstance(cls, type) and issubclass(cls, nn.Module):
        cache[id(node)] = _linen_variables(node, folded)
      elif isinstance(cls, type) and issubclass(cls, nnx.Module):
        cache[id(node)] = _nnx_variables(node, folded, where)
      else:
        raise SubstitutionError(
            f'init_params: {where} is declared by {node.type_name} at path '
            f"{'/'.join(node.path) or '<root>'}, which is not a Flax module "
            'YAX can initialise')
    value = _lookup(cache[id(node)], loc, node, where, col == NNX_GROUP)
    if tuple(value.shape) != tuple(sym.aval.shape) or \
        value.dtype != sym.aval.dtype:
      raise SubstitutionError(
          f'init_params: {node.type_name}.init gives {where} as '
          f'{value.dtype}{list(value.shape)}, but the tree reads '
          f'{sym.type_str}')
    if col == NNX_GROUP:
      entry = next(e for e in var_entries(node)
                   if location(node, e) == loc)
      value = _nnx.variable_holding(entry.kind, value)
    values.append((path, value))
  return set_many(params, values)


def _rewrite_variable(node: Mox, name: str, sym, key, params, keypath,
                      where: str):
  """``[(native key path, value), ...]`` for a variable that a rewrite
  added (no Flax module declares it): a LoRA adapter (``A`` random as
  ``lora`` draws it, ``B`` zero) or a quantization scale (from the float
  kernel in ``params``, which is stored quantized with it); None for any
  other variable."""
  adapter = name.endswith(('lora_a', 'lora_b'))
  is_lora = _is_lora_call(node)
  if is_lora and not adapter:  # a variable of the call it wraps
    node = node.children[0]
  keys = var_keys(node)
  index = [k[-1] for k in keys].index(name)
  is_nnx = keys[index][0] == NNX_GROUP
  box = (lambda v: _nnx.variable_holding(var_kind(node, index)[0], v)) \
      if is_nnx else (lambda v: v)
  shape, dtype = tuple(sym.aval.shape), sym.aval.dtype
  if is_lora and adapter:
    if name.endswith('lora_b'):
      return [(_keys(keypath), box(jnp.zeros(shape, dtype)))]
    plan = _contraction.kernel_plan(node.children[0], shape[-1])
    if isinstance(plan, str):
      raise SubstitutionError(f'init_params: {where} is a LoRA adapter, but '
                              f'its module no longer fits one: {plan}')
    value = jax.random.normal(key, shape, jnp.float32) / math.sqrt(
        plan.fan_in)
    return [(_keys(keypath), box(value.astype(dtype)))]
  fmt = node.params.get('quant')
  if fmt not in FORMATS or not name.endswith('_scale'):
    return None
  kernel_name = name[:-len('_scale')]
  plan = _contraction.kernel_plan(node, 1)
  if isinstance(plan, str) or plan.kernel_name != kernel_name:
    raise SubstitutionError(
        f'init_params: {where} is the scale of a quantized kernel, but its '
        f'module reads no kernel {kernel_name!r} quantize could scale')
  kernel_path = (*_keys(keypath)[:-1], kernel_name)
  kernel = nn.meta.unbox(_get(params, kernel_path))
  if isinstance(kernel, nnx.Variable):
    kernel = kernel[...]
  if not jnp.issubdtype(kernel.dtype, jnp.floating) or \
      jnp.dtype(kernel.dtype).itemsize < 2:
    raise SubstitutionError(
        f'init_params: {where} is the scale of the quantized kernel '
        f'{kernel_name!r}, which params holds already stored as '
        f'{kernel.dtype}; a scale comes from the float kernel')
  size = math.prod(plan.kernel_shape[v] for v in plan.contracted)
  tile = None if len(shape) == len(plan.kernel_shape) else size // shape[0]
  q, scale = quantize_kernel(kernel, fmt, plan.contracted, tile)
  old = _get(params, kernel_path)
  return [(tuple(kernel_path), boxed_like(old, q)),
          (_keys(keypath), box(scale.astype(dtype)))]


def _is_lora_call(node: Mox) -> bool:
  """Whether ``node`` is a call ``yax.lora`` made (its marker class
  ``LoRA``, wrapping the adapted call as its first child)."""
  return getattr(node.module_ty, '__name__', None) == 'LoRA' and bool(
      node.children) and isinstance(node.children[0], Mox)


def _get(tree, keys):
  for k in keys:
    tree = tree[k]
  return tree


def _lookup(variables, loc, node: Mox, where: str, is_nnx: bool):
  """The array the module's init made for ``loc``."""
  name = loc[-1]
  if is_nnx:
    tree = variables
  else:
    tree = variables.get(loc[0], {})
  value = tree.get(name) if hasattr(tree, 'get') else None
  if value is None:
    raise SubstitutionError(
        f'init_params: {node.type_name}.init does not create {where} '
        f'(it creates {sorted(map(str, tree))})')
  if isinstance(value, nnx.Variable):
    return value[...]
  return nn.meta.unbox(value)


def _keys(keypath) -> tuple:
  """A params key path as its dict keys, attribute names and indices (the
  ``value`` field of an NNX Variable left out)."""
  return tuple(key_name(k) for k in unboxed_path(keypath))
