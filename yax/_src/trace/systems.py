"""What tools, views and reports ask of a module system (Linen, NNX, Equinox).

Each module system has its frontend in ``yax/_src/trace/``: Linen's calls
are marked in ``linen.py`` (``flax.linen.intercept_methods``), NNX's in
``nnx.py``, Equinox's in ``equinox.py``. Code outside ``trace/`` never
imports them (``tests/test_layering.py`` checks it): it asks the functions
here, which answer for every system.

The questions, by concern:

* **Variables.** How a variable is boxed where the model holds it (a Linen
  collection holds plain arrays or ``nn.Partitioned`` boxes, an NNX state
  typed Variables, an Equinox module plain arrays), which kinds are
  parameters, and how a call's variables are grouped for the summary.
* **Arguments and replay.** How the traced arguments flatten (NNX modules
  split as ``nnx.split`` does), how state updates flow back into the
  given modules after ``eval_mox``, and how a model returned by a
  command-line factory becomes an argument.
* **Rebuilds.** How a call's module is built anew from the fields the
  trace recorded (``cast`` at another dtype, ``init_params`` for new
  variables, ``contraction``'s declared kernel shapes): a Linen module is
  rebuilt and applied, NNX and Equinox modules built by their
  ``__init__``; and which classes are Flax's norm layers (``lean_norm``).
* **Tracing.** The scope of one ``make_mox`` trace: every frontend's
  interception active around the traced function.

A variable's place in the tree (``ir/variables.py``) has two encodings:
Linen collections (``params``, ``batch_stats`` ...) and the typed
:data:`~yax._src.ir.variables.NNX_GROUP` one, which NNX and Equinox share
(an Equinox array field is a ``Param`` when inexact).

Example::

    box = systems.new_variable_boxer(arguments)
    value = box(NNX_GROUP, 'LoRAParam', array)  # an nnx.LoRAParam in an
                                                # NNX state, the array in an
                                                # Equinox model
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

from yax._src.ir.variables import NNX_GROUP
from yax._src.trace import equinox as _eqx
from yax._src.trace import linen as _linen
from yax._src.trace import nnx as _nnx
from yax._src.trace import nnx_arguments as _nnx_arguments
from yax._src.trace import nnx_variables as _nnx_variables

# ------------------------------------------------------------ variables


def is_param(group: str, kind: str) -> bool:
  """Whether a variable of ``group`` (a Linen collection or ``NNX_GROUP``)
  and ``kind`` (for ``NNX_GROUP``: a Variable type name) is a parameter.

  Example: ``is_param('params', 'params')``, ``is_param(NNX_GROUP,
  'LoRAParam')`` are True; ``is_param(NNX_GROUP, 'BatchStat')`` is False.
  """
  if group == NNX_GROUP:
    return _nnx_variables.is_param_kind(kind)
  return group == 'params'


def typed_variable(kind: str, value) -> Any:
  """``value`` (an array or a placeholder) held as a variable of type
  ``kind`` of the typed encoding (an ``nnx.Variable`` subclass by name;
  ``Param`` for a name NNX does not define).

  Example: ``typed_variable('LoRAParam', jnp.zeros((4, 2)))``.
  """
  return _nnx_variables.variable_holding(kind, value)


def typed_variable_like(kind: str, value, like, **changes) -> Any:
  """``value`` held as a variable of type ``kind`` with the metadata of the
  variable ``like`` (its sharding names, ...) updated by ``changes``.

  Example: ``typed_variable_like('LoRAParam', a, kernel,
  sharding_names=('embed', None))``.
  """
  return _nnx_variables.variable_like(kind, value, like, **changes)


def sharding_names(var) -> tuple[str, tuple] | None:
  """``(metadata key, axis names)`` of a typed variable annotated with axis
  names (``nnx.with_partitioning``), else None."""
  return _nnx_variables.sharding_names(var)


def new_variable_boxer(arguments) -> Callable[[str, str, Any], Any]:
  """How a new variable is held in ``arguments`` (the traced arguments,
  unflattened): a function ``(group, kind, value) -> leaf``.

  A typed (``NNX_GROUP``) variable is an NNX Variable of its kind in an NNX
  state and a plain array in an Equinox model; a Linen variable is the
  value itself.

  Example: ``new_variable_boxer((args, kwargs))(NNX_GROUP, 'Param', x)``.
  """
  typed = not _eqx.holds_modules(arguments)

  def box(group: str, kind: str, value):
    if group == NNX_GROUP and typed:
      return _nnx_variables.variable_holding(kind, value)
    return value
  return box


def is_record_module(cls: type) -> bool:
  """Whether ``cls`` is a module class whose variables are its fields (an
  ``eqx.Module`` subclass), built anew by
  :func:`record_module_variables`."""
  return _eqx.is_module_class(cls)


def record_module_variables(cls: type, attributes: dict, key,
                            where: str) -> dict:
  """``{field name: array}`` of a new ``cls`` (an ``eqx.Module``) built by
  its ``__init__`` from a call's recorded ``attributes`` and ``key``;
  ``where`` names the variable asked for, in the error raised when
  ``__init__`` needs an argument the trace did not record.

  Example: ``record_module_variables(eqx.nn.PReLU, {}, key, where)``
  gives ``{'negative_slope': ...}``.
  """
  return _eqx.init_variables(cls, attributes, key, where)


def is_metadata_box(x) -> bool:
  """Whether ``x`` is a Linen metadata box around a variable's value
  (``nn.Partitioned``, ``nn.LogicallyPartitioned`` ...)."""
  return _linen.is_box(x)


def box_axis_names(x) -> tuple | None:
  """The axis names of a Linen metadata box that has them
  (``nn.Partitioned``'s ``names``), else None."""
  names = getattr(x, 'names', None)
  if _linen.is_box(x) and isinstance(names, (tuple, list)):
    return tuple(names)
  return None


def reboxed(box, value, names: tuple):
  """``value`` in a Linen metadata box like ``box`` with axis ``names``.

  Example: ``reboxed(nn.Partitioned(k, ('embed', 'mlp')), a,
  ('embed', None))``.
  """
  return box.replace(value=value, names=names)


def norm_kind(cls) -> str | None:
  """``'layer'`` for Flax's ``LayerNorm``, ``'rms'`` for its ``RMSNorm``
  (Linen's and NNX's classes alike), else None.

  Example: ``norm_kind(nnx.RMSNorm) == 'rms'``.
  """
  return (_linen.norm_kinds().get(cls)
          or _nnx_variables.norm_kinds().get(cls))


def is_typed_variable(x) -> bool:
  """Whether ``x`` is a typed variable of a model (an ``nnx.Variable``)."""
  return _nnx_variables.nnx is not None and isinstance(
      x, _nnx_variables.nnx.Variable)


def unboxed(value):
  """The array a model holds for a variable: ``value`` without a Linen
  metadata box (``nn.Partitioned`` ...) or an NNX Variable around it.

  Example: ``unboxed(nnx.Param(x)) is x``.
  """
  if is_typed_variable(value):
    return value[...]
  return _linen.unboxed(value)


def is_rebuilt_module(cls) -> bool:
  """Whether a call of ``cls`` is run again by rebuilding its module from
  the fields the trace recorded and applying it (a Linen module), rather
  than by running its traced body again (NNX, Equinox)."""
  return _linen.is_module_class(cls)


def rebuilt_module(cls: type, attributes: dict, **changes):
  """``(module, changed)``: a new ``cls`` (see :func:`is_rebuilt_module`)
  from a call's recorded ``attributes``, with ``changes`` applied to the
  fields ``cls`` has (``changed`` names them). Run it with
  :func:`apply_module`.

  Example: ``rebuilt_module(nn.Dense, node.params, dtype=jnp.bfloat16)``.
  """
  return _linen.rebuilt(cls, attributes, **changes)


def apply_module(module, variables, method: str, *args, **kwargs):
  """``method`` of a module from :func:`rebuilt_module` run on
  ``variables`` and the arguments.

  Example: ``apply_module(module, {'params': p}, '__call__', x)``.
  """
  return module.apply(variables, *args, method=getattr(type(module), method),
                      **kwargs)


def new_module_variables(cls, attributes: dict, key, example, method: str,
                         where: str):
  """The variables a new module of ``cls`` creates, built from a call's
  recorded ``attributes`` and initialised with ``key``: Linen collections
  (``{'params': {...}}``) from ``init`` of ``method`` on ``example`` (the
  call's ``(args, kwargs)``), an NNX module's state, an Equinox module's
  ``{field: array}``; None when ``cls`` is no module class of any system.
  ``where`` names the variable asked for, in the error raised when the
  module's ``__init__`` needs an argument the trace did not record.

  Example: ``new_module_variables(nn.Dense, {'features': 4}, key,
  ((x,), {}), '__call__', where)``.
  """
  if _linen.is_module_class(cls):
    args, kwargs = example
    return _linen.init_variables(cls, attributes, key, args, kwargs, method)
  if _nnx_variables.is_module_class(cls):
    return _nnx_variables.init_variables(cls, attributes, key, where)
  if _eqx.is_module_class(cls):
    return _eqx.init_variables(cls, attributes, key, where)
  return None


def variable_kinds(node) -> list[str] | None:
  """The kind of each of a module call's variable inputs (``Param``,
  ``BatchStat``, ``RngCount`` ...) when they are typed (NNX, Equinox),
  else None (Linen: the collection names the kind)."""
  return _nnx_variables.var_kinds(node)


def typed_variable_groups(node) -> dict | None:
  """A module call's typed variable inputs grouped as the summary shows
  them (``params``, ``batch_stats``, other kinds by name); None when its
  variables are in Linen collections."""
  if _nnx_variables.var_kinds(node) is None:
    return None
  return _nnx_variables.variable_groups(node)


def typed_own_variables(node) -> dict | None:
  """``{group: {path: symbol}}`` of a module call's own typed variables
  (not its submodules'), paths as ``nnx.state`` shows them; None when its
  variables are in Linen collections."""
  if _nnx_variables.var_kinds(node) is None:
    return None
  return _nnx_variables.own_variables(node)


def param_leaves(arguments) -> set:
  """The leaves of ``arguments`` (unflattened, each leaf its index) that
  sit in a typed parameter (an ``nnx.Param`` or a subclass)."""
  return _nnx_variables.param_leaves(arguments)


def is_typed_state(x) -> bool:
  """Whether ``x`` is an ``nnx.State``: a container of typed variables
  only, at their module paths (never a Linen collection)."""
  return _nnx.nnx is not None and isinstance(x, _nnx.nnx.State)


def holds_module_argument(mox) -> bool:
  """Whether the tree was traced with an NNX module itself (not its state)
  among the arguments: the module form, whose variables rewrites cannot
  add to."""
  return _nnx_arguments.holds_graph_argument(mox)


# ------------------------------------------------ arguments and replay


def flatten_arguments(args, kwargs) -> tuple[list, Any]:
  """``(leaves, treedef)`` of ``(args, kwargs)`` as a trace flattens them
  (NNX modules split as ``nnx.split`` does)."""
  return _nnx_arguments.flatten_arguments(args, kwargs)


def apply_updates(result, args, kwargs):
  """The traced function's output from what a replay returned, with the
  state updates it carries written into the given NNX modules."""
  return _nnx_arguments.apply_updates(result, args, kwargs)


def module_as_argument(fn, args) -> tuple[Callable, Any]:
  """``(fn, args)`` of a command-line factory, with a model given as ``fn``
  (an NNX module) turned into the first argument of a function that calls
  it, so that its state is traced as inputs."""
  return _nnx_arguments.module_as_argument(fn, args)


# ------------------------------------------------------------- tracing


class TraceScope:
  """Every frontend's side of one ``make_mox`` trace.

  ``leaves``/``in_tree`` flatten the arguments (NNX modules split),
  ``static`` holds the indices of leaves that stay static (an Equinox
  module's non-array fields). Enter :meth:`active` around the traced call
  and call the function with :meth:`call`.

  Example::

      scope = TraceScope(args, kwargs)
      with scope.active(trace, a, k):
        out = scope.call(fn, a, k)
  """

  def __init__(self, args, kwargs):
    self._nnx = _nnx.TraceScope(args, kwargs)
    self.leaves, self.in_tree = self._nnx.leaves, self._nnx.in_tree
    self.static = set() if self._nnx.has_nodes else _eqx.static_leaves(
        (args, kwargs))

  @contextlib.contextmanager
  def active(self, trace, args, kwargs):
    """Linen methods intercepted for ``trace`` (a ``calls.Trace``), NNX and
    Equinox methods wrapped (the modules in ``(args, kwargs)`` indexed at
    their paths) while the block runs."""
    with _linen.tracing(functools.partial(_linen.interceptor, trace)), \
        self._nnx, _eqx.tracing(args, kwargs):
      yield

  def call(self, fn, args, kwargs):
    """``fn(*args, **kwargs)`` on the traced arguments (NNX modules merged
    from their traced state; state updates returned with the output)."""
    return self._nnx.call(fn, args, kwargs)
