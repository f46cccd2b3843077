"""The Linen frontend: a Linen method call marked as a module call.

Linen calls are intercepted with ``flax.linen.intercept_methods`` while a
``make_mox`` trace runs (:func:`tracing`); the interceptor wraps each bound
module's method in the boundary markers of ``trace/calls.py``, with every
variable the module reaches (its ``module.variables``, dict-valued ones
included) and the RNG keys it may draw from riding in the enter marker.

Example::

    with linen.tracing(functools.partial(linen.interceptor, trace)):
      out = fn(*args, **kwargs)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping

import flax.linen as nn
import jax

from yax._src.compat import linen_rng_keys
from yax._src.trace import calls as _calls
from yax._src.trace import nnx as _nnx
from yax._src.trace.calls import is_traced_value, marked_call

# The collection a Linen call lists the RNG keys it draws from under.
RNGS = 'rngs'

# Field names per module class, computed once (``dataclasses.fields`` is
# slow enough to show up when tracing models with hundreds of module calls).
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def module_fields(module: nn.Module) -> dict:
  """A module's dataclass fields except ``parent``, including ``name``.

  Example: ``module_fields(nn.Dense(4))['features'] == 4``.
  """
  cls = type(module)
  names = _FIELD_NAMES.get(cls)
  if names is None:
    names = _FIELD_NAMES[cls] = tuple(
        f.name for f in dataclasses.fields(module)
        if f.name != 'parent' and (f.init or f.name == 'name'))
  return {name: getattr(module, name, None) for name in names}


def interceptor(trace: _calls.Trace, next_fun, args, kwargs, context):
  """The ``nn.intercept_methods`` interceptor of ``trace``: a bound module's
  method call, marked as a module call when ``trace`` is the innermost
  active trace.

  Args:
    trace: the ``make_mox`` trace that records the call.
    next_fun, args, kwargs, context: as ``nn.intercept_methods`` passes them.

  Returns:
    What the method returns.

  Example: ``functools.partial(interceptor, trace)`` is given to
  :func:`tracing`.
  """
  active = _calls.active()
  # A nested ``make_mox`` (called while ``fn`` of an outer one runs) installs
  # its own interceptor; only the innermost trace records, so the inner tree
  # is the same as when traced alone and the outer one sees no markers twice.
  if not active or active[-1] is not trace or not _calls.is_module_method(
      context.method_name):
    return next_fun(*args, **kwargs)
  module = context.module
  if module.scope is None:
    # Why skipping is right: a method of an unbound module (called outside
    # ``apply``/``init``, e.g. a helper that only reads dataclass fields)
    # has no variables and no scope path; it is recorded by nothing, and
    # whatever arrays it computes stay in the caller's body.
    return next_fun(*args, **kwargs)
  path = tuple(module.path)
  # Every variable the module reaches (its own, dict-valued ones included,
  # and its submodules' scopes, as ``module.variables`` nests them) rides
  # in the marker; the tree builder keeps those the call's body reads.
  # The keys of the RNG streams given to ``apply`` ride along too, under
  # the collection ``rngs``: a call that draws from a stream (Dropout's
  # ``make_rng('dropout')``) reads its key.
  reachable = dict(module.variables)
  keys = {name: key for name, key in linen_rng_keys(module.scope).items()
          if is_traced_value(key)}
  if keys and RNGS not in reachable:
    reachable[RNGS] = keys
  var_leaves, var_tree = jax.tree_util.tree_flatten(_traced_only(reachable))
  bridged = _nnx.bridged_class(module)
  if bridged is not None:
    # Flax's ToLinen: an NNX model built and run inside this call, its
    # whole state in this module's variables (nested dicts are the NNX
    # attribute paths, not submodule scopes: ToLinen has no submodules).
    next_fun = _nnx.bridged(path, bridged, next_fun)
  return marked_call(type(module), context.method_name, module_fields(module),
                     path, var_leaves, var_tree, next_fun, args, kwargs)


def _traced_only(tree):
  """The nested dicts of ``tree`` with only their traced leaves (metadata
  boxes such as ``nn.LogicallyPartitioned`` kept around them)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      value = _traced_only(value)
      if value:
        out[key] = value
    elif all(map(is_traced_value, jax.tree_util.tree_leaves(value))):
      out[key] = value
  return out


@contextlib.contextmanager
def tracing(method_interceptor):
  """Linen methods intercepted by ``method_interceptor`` (an
  :func:`interceptor` bound to its trace) while the block runs.

  Example: ``with tracing(functools.partial(interceptor, trace)): ...``.
  """
  with nn.intercept_methods(method_interceptor):
    yield


# ------------------------------------------------------------- rebuilds


def is_module_class(cls) -> bool:
  """Whether ``cls`` is a Linen module class (rebuilt from the fields a
  trace recorded as a call's attributes)."""
  return isinstance(cls, type) and issubclass(cls, nn.Module)


def rebuilt(cls: type, attributes: dict, **changes) -> tuple[nn.Module, set]:
  """A new ``cls`` (a Linen module) from a call's recorded ``attributes``,
  with ``changes`` applied to the fields ``cls`` has; returns it and the
  names of the fields changed.

  Example: ``rebuilt(nn.Dense, {'features': 4}, dtype=jnp.bfloat16)``
  gives ``(nn.Dense(4, dtype=bfloat16), {'dtype'})``.
  """
  fields = {f.name for f in dataclasses.fields(cls)
            if f.init and f.name not in ('parent', 'name')}
  kwargs = {k: v for k, v in attributes.items() if k in fields}
  changed = {k for k in changes if k in fields}
  kwargs.update({k: changes[k] for k in changed})
  return cls(**kwargs), changed


def init_variables(cls: type, attributes: dict, key, args, kwargs,
                   method: str) -> dict:
  """The variables (``{collection: {name: array}}``) a new ``cls`` (a
  Linen module rebuilt from ``attributes``) creates when ``method`` is
  initialised on ``args``/``kwargs`` with ``key``.

  Example: ``init_variables(nn.Dense, {'features': 4}, key, (x,), {},
  '__call__')['params']['kernel']``.
  """
  module, _ = rebuilt(cls, attributes)
  return module.init(key, *args, method=getattr(cls, method), **kwargs)


def unboxed(value):
  """``value`` without its Linen metadata box (``nn.Partitioned`` ...)."""
  return nn.meta.unbox(value)


def is_box(x) -> bool:
  """Whether ``x`` is a Linen metadata box (``nn.meta.AxisMetadata``:
  ``nn.Partitioned``, ``nn.LogicallyPartitioned`` ...)."""
  return isinstance(x, nn.meta.AxisMetadata)


def norm_kinds() -> dict[type, str]:
  """Linen's normalisation layers by kind: ``{nn.LayerNorm: 'layer',
  nn.RMSNorm: 'rms'}``."""
  return {nn.LayerNorm: 'layer', nn.RMSNorm: 'rms'}
