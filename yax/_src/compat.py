"""Every use of JAX private internals lives here, with the reason for each.

Tracing, evaluation and rewriting use only public APIs (``jax.make_jaxpr``,
``jax.core.eval_jaxpr``, ``jax.extend.core``, ``flax.linen.intercept_methods``).
The one thing the public API does not offer is JAX's Jaxpr *pretty printer*
as building blocks: ``str(jaxpr)`` prints a whole jaxpr, but printing a
``module_call`` with a nested body in the same syntax, with the same variable
names and line breaking, needs the printer's pieces. If these names move in a
future JAX, only printing of ``module_call`` nodes degrades (see
``HAVE_PRINTER``); everything else keeps working.
"""

from __future__ import annotations

import functools
import operator

# Why: a new primitive (the boundary markers of `trace/markers.py`) needs batching,
# JVP and lowering rules; `jax.interpreters.{ad,batching,mlir}` hold the rule
# tables JAX documents for that ("How JAX primitives work"), and `jax.extend`
# does not yet expose them. Imported here so every internal use is in one place.
from jax.interpreters import ad, batching, mlir  # noqa: E402,F401

try:
  # Why: the building blocks of Jaxpr printing (naming context, settings,
  # printing a list of variables, the `{ lambda ; ... let ... in ... }`
  # skeleton, per-primitive printing rules) have no public equivalent.
  from jax._src import core as _core
  # Why: the Wadler-Lindig document type used by the functions above.
  from jax._src import pretty_printer as pp

  JaxprPpContext = _core.JaxprPpContext
  JaxprPpSettings = _core.JaxprPpSettings
  pp_vars = _core.pp_vars
  pp_kv_pairs = _core.pp_kv_pairs
  pp_jaxpr_skeleton = _core.pp_jaxpr_skeleton
  pp_eqn_rules = _core.pp_eqn_rules
  pp_eqns = _core.pp_eqns
  HAVE_PRINTER = True
except (ImportError, AttributeError):  # pragma: no cover - depends on JAX
  HAVE_PRINTER = False

# Not private: the opaque state of the current JAX trace, comparable for
# equality (Flax uses it the same way). ``jax.extend.core`` has it on newer
# JAX; older JAX (0.8) has it only as ``jax.core.get_opaque_trace_state``.
import jax.extend.core as _jex_core  # noqa: E402
import jax.core as _jax_core  # noqa: E402

get_opaque_trace_state = (getattr(_jex_core, 'get_opaque_trace_state', None)
                          or _jax_core.get_opaque_trace_state)

# Why: adding an input to a ``jit`` equation (a rewrite that threads a new
# variable into an ``nn.jit`` body) needs the "no sharding given" marker JAX
# puts in ``in_shardings`` for inputs without one; it has no public name.
from jax._src.sharding_impls import UNSPECIFIED  # noqa: E402,F401

try:
  # Why: tracing an NNX model needs, for every module it calls, the variables
  # reachable from that module. ``nnx.iter_graph`` walks a module's whole
  # subtree, so asking it once per module costs (model size x depth); the
  # graph-node protocol's listing of one node's direct children (what
  # ``iter_graph`` itself uses) lets each node be listed once per trace.
  # Flax exports it publicly only as ``nnx.iter_children`` in newer releases.
  from flax.nnx import graph as _nnx_graph

  # Newer Flax wraps a Pytree's attribute values in these when flattening.
  _ELEMS = tuple(getattr(_nnx_graph, name) for name in ('DataElem', 'StaticElem')
                 if hasattr(_nnx_graph, name))
  # Why the class attributes below: Flax's listing of a module's children
  # wraps every attribute and sorts them through a generator, a third of
  # YAX's NNX tracing overhead. A class that flattens as Flax's own
  # ``Pytree`` does (its attributes sorted by name; ``_pytree__has_int_keys``
  # marks the int-keyed ones, such as ``nnx.List``, which take Flax's
  # listing) is listed from its attribute dict; any other class, or an older
  # Flax, takes Flax's listing.
  from flax import nnx as _nnx
  _PYTREE = getattr(_nnx, 'Pytree', None)
  _PYTREE_FLATTEN = getattr(_PYTREE, '_graph_node_flatten', None)
  _by_key = operator.itemgetter(0)
  # Why: every Flax Pytree (each module) holds a ``PytreeState``, Flax's own
  # bookkeeping, which ``nnx.split`` lists as a child with nothing in it;
  # asking Flax to list it costs as much as listing a module.
  _HOLDS_NOTHING = tuple(
      t for t in (getattr(getattr(_nnx, 'pytreelib', None), 'PytreeState',
                          None),) if isinstance(t, type))

  @functools.lru_cache(maxsize=None)
  def _lists_attributes(ty: type) -> bool:
    """Whether ``ty`` flattens as Flax's own ``Pytree`` does in Flax >=
    0.12.1: its attributes, sorted by name."""
    return (_PYTREE_FLATTEN is not None and
            getattr(ty, '_graph_node_flatten', None) is _PYTREE_FLATTEN and
            hasattr(ty, '_pytree__has_int_keys'))

  def nnx_node_items(node) -> list:
    """``[(key, child)]`` of an NNX graph node or pytree, in the order
    ``nnx.split`` lists them; [] for a leaf or a Variable.

    Static attributes are listed too: a Variable that a model caches in
    one during a call (``functools.cached_property`` writes the instance
    dict directly, as EasyDeL's RoPE table does) is a state update, as
    when the model is called. A module is listed straight from its
    attributes: Flax's own listing wraps each one, which made listing
    children a third of YAX's NNX tracing overhead."""
    ty = type(node)
    if _lists_attributes(ty) and not node._pytree__has_int_keys:
      return sorted(vars(node).items(), key=_by_key)
    if ty is tuple or ty is list:  # Flax lists their items by position
      return list(enumerate(node))
    impl = _nnx_graph.get_node_impl(node)
    if impl is None:
      return []
    items, _ = impl.flatten(node)
    return [(key, value.value if isinstance(value, _ELEMS) else value)
            for key, value in items]

  # Why the registries: whether NNX looks into a value depends only on its
  # type (``get_node_impl`` reads these three tables), so YAX decides it
  # once per type instead of per value; Flax asks only with a value. (A type
  # is registered when it is defined, before any value of it is traced.)
  _REGISTRIES = tuple(getattr(_nnx_graph, name, None) for name in (
      'GRAPH_REGISTRY', 'PYTREE_REGISTRY', 'JAX_PYTREE_REGISTRY'))

  def nnx_is_node_type(ty: type) -> bool:
    """Whether values of type ``ty`` can have children in an NNX graph (as
    ``nnx.split`` decides: registered graph nodes, NNX and JAX pytrees).
    True when this Flax keeps its registries elsewhere."""
    if ty in _HOLDS_NOTHING:
      return False
    if any(r is None for r in _REGISTRIES):
      return True
    return any(ty in r for r in _REGISTRIES) or issubclass(ty, tuple)
except ImportError:  # pragma: no cover - flax without nnx
  nnx_node_items = nnx_is_node_type = None


# A rewrite that threads new inputs into a ``scan`` body (LoRA adapters or
# new variables of a module inside ``nn.scan``) must say in the equation's
# params how many loop constants it has. JAX up to 0.11 counts them in
# ``num_consts``/``num_carry``; JAX 0.12 replaced those by ``ft_in``/``ft_out``.
try:
  # Why: ``ft_in`` is a flat tree of (consts, carry, xs), whose type and
  # constructors (``jax._src.flattree``) have no public name.
  from jax._src import flattree as _flattree
except ImportError:  # pragma: no cover - JAX without flat-tree scan params
  _flattree = None


def scan_num_consts(params) -> int:
  """The number of loop constants of a ``scan`` equation."""
  if 'num_consts' in params:
    return params['num_consts']
  consts, _, _ = params['ft_in'].unpack()
  return len(consts)


def scan_params_with_inputs(params, new_consts: int, new_xs: int) -> dict:
  """``scan`` params for ``new_consts`` more loop constants (after the
  existing ones) and ``new_xs`` more scanned inputs (after the existing
  ones)."""
  if 'num_consts' in params:
    num_consts = params['num_consts']
    params = dict(params, num_consts=num_consts + new_consts)
    if 'linear' in params:  # dropped from scan in newer JAX
      lin = list(params['linear'])
      params['linear'] = (*lin[:num_consts], *[False] * new_consts,
                          *lin[num_consts:], *[False] * new_xs)
    return params
  consts, carry, xs = params['ft_in'].unpack()
  return dict(params, ft_in=_flattree.pack((
      (consts, _flattree.nones(new_consts)), carry,
      (xs, _flattree.nones(new_xs)))))


def linen_rng_draws(scope) -> dict[str, int]:
  """How many keys a bound Linen module's scope has drawn so far from each
  RNG stream (its ``make_rng`` calls), by stream name.

  Why: a module call that draws a key reads the key passed to ``apply``
  (``rngs={'dropout': key}``), so that key is an input of the call; only
  the scope's counters tell which streams a call drew from.
  ``Scope.rng_counters`` (``flax.core.scope``) maps a stream to its count
  (a lifted transform keeps dicts of counters there too: left out)."""
  counters = getattr(scope, 'rng_counters', None) or {}
  return {k: v for k, v in counters.items() if isinstance(v, int)}


def linen_rng_key(scope, name: str):
  """The key behind RNG stream ``name`` of a bound Linen module's scope
  (what ``apply`` was given), or None. Why: ``Scope.rngs`` holds it in a
  ``LazyRng`` (``flax.core.scope``), whose ``rng`` is that key."""
  lazy = (getattr(scope, 'rngs', None) or {}).get(name)
  return getattr(lazy, 'rng', None)


def linen_variable_names(scope) -> list[tuple[str, str]]:
  """``(collection, name)`` of every variable a bound Linen module's scope
  has reserved so far (``self.param``/``self.variable`` calls), submodule
  scopes left out.

  Why: a variable whose value is a dict looks, in ``module.variables``,
  exactly like a submodule's scope; only the scope's reservations tell the
  two apart. ``Scope.reservations`` (``flax.core.scope``) maps a name to
  the collections it was reserved in, ``None`` for a submodule."""
  reserved = getattr(scope, 'reservations', None)
  if not reserved:
    return []
  return [(col, name) for name, cols in reserved.items() for col in cols
          if col is not None]



def name_stack_text(eqn) -> str:
  """The ``jax.named_scope`` stack an equation of a ``jax.make_jaxpr``
  result was traced under, as text (``jvp(yax.call3)/yax.call5``).

  Why: ``JaxprEqn.source_info.name_stack`` is where JAX records named
  scopes (its own ``saved_residuals`` and profiler names read it); no
  public function returns it. ``yax.memory_report`` attributes residuals
  to module calls by the scopes it opens around them. ``''`` when absent.
  """
  info = getattr(eqn, 'source_info', None)
  stack = getattr(info, 'name_stack', None)
  return '' if stack is None else str(stack)
