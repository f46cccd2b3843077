"""A module call between boundary markers: shared by the Linen, NNX and
Equinox frontends (``trace/linen.py``, ``trace/nnx.py``,
``trace/equinox.py``), so none imports another.

:func:`marked_call` runs one method call between ``yax_enter`` and
``yax_exit`` (see ``trace/markers.py``) and describes it in a :class:`CallRecord`,
which rides in the markers' ``call_id`` parameter. The tree builder of
``trace/make.py`` turns each marker pair into a ``module_call`` node.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from typing import Any

import jax

from yax._src.compat import get_opaque_trace_state
from yax._src.errors import SubstitutionError
from yax._src.trace import markers as _markers

tree_flatten = jax.tree_util.tree_flatten
tree_unflatten = jax.tree_util.tree_unflatten


def is_traced_value(x) -> bool:
  """Inside a module call only JAX values (arrays and tracers) flow through
  markers. Everything else passed to a module method reaches it unchanged,
  as under plain Flax: Python scalars (``deterministic=True``) and NumPy
  arrays (a model may compute on the host with them, e.g. a mel filterbank
  built in ``setup``; a float64 NumPy helper stays float64)."""
  return isinstance(x, (jax.core.Tracer, jax.Array))


@dataclasses.dataclass(eq=False)  # compared and hashed by identity
class CallRecord:
  """What the interceptor saw about one module method call.

  The record rides in the ``call_id`` parameter of the call's markers (see
  :class:`CallId`), so a Jaxpr that JAX serves from its cache (traced by an
  earlier ``make_mox``) carries the descriptions of its module calls."""
  module_ty: type
  method: str
  params: dict
  path: tuple
  var_tree: Any  # every variable the module reaches
  in_tree: Any
  arg_statics: dict  # leaf position -> static value
  num_arg_leaves: int
  out_tree: Any = None
  out_statics: dict = dataclasses.field(default_factory=dict)
  num_out_leaves: int = 0
  # Set when the call ended in an exception (the model may catch it): the
  # exit marker was never bound, so the builder leaves the call out.
  failed: str | None = None
  # Per variable leaf, in ``var_tree`` order: the position among the
  # trace's dynamic inputs of a variable that is one of them, seen in the
  # root trace (not passed through the enter marker), or None for one that
  # the marker carries; None when the marker carries every variable.
  var_refs: tuple | None = None


class CallId:
  """The ``call_id`` parameter of a call's markers: holds its record.

  JAX caches every primitive's abstract evaluation keyed on its parameters.
  A marker's result types do not depend on which call it marks, so all
  ``CallId`` s compare equal and hash alike: the cache answers every marker
  after the first of each type signature, instead of taking one entry per
  module call and pushing out the entries of the model's own primitives.
  The tree builder tells calls apart by their ``record`` (by identity),
  never by comparing ``CallId`` s.
  """

  __slots__ = ('record',)

  def __init__(self, record: CallRecord):
    self.record = record

  def __eq__(self, other):
    return isinstance(other, CallId)

  def __hash__(self):
    return hash(CallId)

  def __repr__(self):
    rec = self.record
    return f"{rec.module_ty.__name__}.{rec.method}@{'/'.join(rec.path)}"


class Trace:
  """One ``make_mox`` trace (its identity tells nested traces apart).

  ``roots`` maps ``id`` of each dynamic input tracer of the root JAX trace
  to its position, and ``state`` is that trace's opaque state: a module
  called in the root trace names the variables that are root inputs by
  position instead of passing them through its enter marker (each input
  costs the marker's bind time, and the NNX Transformer's calls carry every
  Variable once per enclosing call)."""

  def __init__(self):
    self.roots: dict[int, int] = {}
    self.state = None

  def enter_root(self, dyn_vals) -> None:
    """Called first thing in the root trace, with its input tracers."""
    self.roots = {id(v): i for i, v in enumerate(dyn_vals)}
    self.state = get_opaque_trace_state()


_state = threading.local()


def active() -> list[Trace]:
  """The ``make_mox`` traces running on this thread, innermost last."""
  stack = getattr(_state, 'traces', None)
  if stack is None:
    stack = _state.traces = []
  return stack


def recording() -> bool:
  """Whether a ``make_mox`` trace is active on this thread."""
  return bool(active())


def _call(fn, args, kwargs):
  return fn(*args, **kwargs)


# ``call_with_stack_room(fn, args, kwargs)`` calls ``fn`` from a frame that
# reserves 32768 unused stack slots (256 KiB), so the calls ``fn`` makes run in
# a fresh stack chunk with that much room. Why: CPython (3.11 and later) keeps
# Python frames in 16 KiB chunks and maps a new chunk whenever a call does not
# fit in the current one, unmapping it again when that call returns. Tracing a
# model calls every JAX primitive from deep in the model's stack (module
# methods, interceptors, JAX's binding machinery); when a chunk boundary falls
# inside that depth, every primitive bind maps and unmaps a chunk (an mmap,
# munmap and page faults each time: BERT-base traced tens of thousands of
# them per trace, up to half of the tracing time, depending only on where the
# boundary happened to fall). The reserved slots are never written, so their
# pages are never touched; only the chunk is mapped, once per trace.
call_with_stack_room = type(_call)(
    _call.__code__.replace(co_stacksize=_call.__code__.co_stacksize + 32768),
    _call.__globals__, 'call_with_stack_room')


def is_module_method(name: str) -> bool:
  """Whether a call of method ``name`` is a module call: ``__call__`` and
  ordinary methods are; ``setup`` and Python protocol methods
  (``__getattr__``, ``__setattr__``, ``__getitem__``, ...: every dunder but
  ``__call__``) never are, whatever the model's class defines."""
  if name == 'setup':
    return False
  return name == '__call__' or not (name.startswith('__')
                                    and name.endswith('__'))


def marked_call(module_ty, method, params, path, var_leaves, var_tree, call,
                args, kwargs, *, is_leaf=None):
  """Runs ``call(*args, **kwargs)`` between the boundary markers and
  returns its result. The call's record is the markers' ``call_id``
  parameter. Used for Linen calls (the interceptor above) and NNX calls
  (``trace/nnx.py``, which passes ``is_leaf`` to keep graph nodes whole)."""
  var_refs = None
  trace = active()[-1]
  if var_leaves and trace.roots and get_opaque_trace_state() == trace.state:
    roots = trace.roots
    var_refs = tuple(roots.get(id(x)) for x in var_leaves)
    var_leaves = [x for x, r in zip(var_leaves, var_refs, strict=True)
                  if r is None]
  if not kwargs and all(isinstance(x, jax.core.Tracer) for x in args):
    # Most calls: positional arrays only (no tree to walk).
    in_tree, statics = _positional_tree(len(args)), {}
    record = CallRecord(module_ty, method, params, path, var_tree, in_tree,
                        statics, len(args), var_refs=var_refs)
    args = tuple(_markers.enter_p.bind(*var_leaves, *args,
                                       call_id=CallId(record),
                                       num_vars=len(var_leaves)))
  else:
    leaves, in_tree = tree_flatten((args, kwargs), is_leaf=is_leaf)
    statics = {i: x for i, x in enumerate(leaves) if not is_traced_value(x)}
    dyn = [i for i in range(len(leaves)) if i not in statics]
    record = CallRecord(module_ty, method, params, path, var_tree, in_tree,
                        statics, len(leaves), var_refs=var_refs)
    marked = _markers.enter_p.bind(
        *var_leaves, *[leaves[i] for i in dyn], call_id=CallId(record),
        num_vars=len(var_leaves))
    leaves = list(leaves)
    for i, x in zip(dyn, marked, strict=True):
      leaves[i] = x
    args, kwargs = tree_unflatten(in_tree, leaves)

  try:
    out = call(*args, **kwargs)
  except BaseException as e:
    # The model may catch this (``try: y = self.inner(x) except ...``): the
    # call has no exit, and the tree builder leaves it out with a warning.
    record.failed = type(e).__name__
    raise

  if isinstance(out, jax.core.Tracer):  # most calls: one array
    record.out_tree, record.num_out_leaves = _LEAF_TREE, 1
    out, = _markers.exit_p.bind(out, call_id=CallId(record))
    return out
  out_leaves, out_tree = tree_flatten(out, is_leaf=is_leaf)
  out_statics = {i: x for i, x in enumerate(out_leaves)
                 if not is_traced_value(x)}
  out_dyn = [i for i in range(len(out_leaves)) if i not in out_statics]
  record.out_tree = out_tree
  record.num_out_leaves = len(out_leaves)
  record.out_statics = out_statics
  marked = _markers.exit_p.bind(*[out_leaves[i] for i in out_dyn],
                                call_id=CallId(record))
  for i, x in zip(out_dyn, marked, strict=True):
    out_leaves[i] = x
  return tree_unflatten(out_tree, out_leaves)


_LEAF_TREE = jax.tree_util.tree_structure(0)


@functools.lru_cache(maxsize=64)
def _positional_tree(n: int):
  """The treedef of ``(args, kwargs)`` for ``n`` array arguments and no
  keyword arguments."""
  return jax.tree_util.tree_structure(((0,) * n, {}))


def constructor_kwargs(cls, attributes: dict, *, rng: tuple[str, Any],
                       where: str, system: str, remedy: str,
                       skip: tuple[str, ...] = ()) -> dict:
  """The keyword arguments that rebuild ``cls`` from a call's recorded
  attributes, for ``init_params`` (NNX and Equinox frontends).

  ``rng`` is the ``__init__`` parameter that takes randomness and its value
  (``('rngs', nnx.Rngs(key))``, ``('key', key)``); ``skip`` names attributes
  never passed on. A required parameter the trace did not record raises
  :class:`SubstitutionError` naming ``where`` and ``remedy``.

  Example: ``constructor_kwargs(eqx.nn.Linear, {'in_features': 2,
  'out_features': 3}, rng=('key', key), where=..., system='Equinox',
  remedy='make them fields of the module')``.
  """
  kwargs, missing = {}, []
  signature = inspect.signature(cls.__init__)
  for name, p in list(signature.parameters.items())[1:]:
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
      continue
    if name == rng[0]:
      kwargs[name] = rng[1]
    elif name in attributes and name not in skip:
      kwargs[name] = attributes[name]
    elif p.default is p.empty:
      missing.append(name)
  if missing:
    raise SubstitutionError(
        f'init_params: {where} is declared by the {system} module '
        f'{cls.__name__}, whose __init__ needs {missing}, which the trace '
        f'did not record (it recorded '
        f'{sorted(k for k in attributes if k != "name")}); {remedy}, or '
        'pass the variable in params')
  return kwargs
