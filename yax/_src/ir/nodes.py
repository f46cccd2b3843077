"""The MoX data model: symbols, equations and module calls.

A module expression is a tree. Its leaves are :class:`Equation` s (one JAX
primitive application each) and its inner nodes are :class:`Mox` es (one Flax
module method call each, or an *ephemeral* node that stands for a plain
function, e.g. the traced function itself).

Symbols are shared across the whole tree: the ``inputs`` of a module call are
the very symbols its body reads, and its ``outputs`` are the symbols its body
defines. A symbol therefore has one identity (and one printed name) in the
whole tree, and data flow can be followed through module boundaries.

Nodes are immutable by convention: rewrites build new nodes with
``.replace(...)`` and never modify a node in place.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterator, Sequence

import jax

from yax._src.errors import NotPicklableError, YaxError


class Symbol:
  """A value in a module expression. Symbols compare and hash by identity."""

  __slots__ = ('aval',)

  def __init__(self, aval):
    self.aval = aval

  def __eq__(self, other):
    return self is other

  # Identity, as ``__eq__``; the C slot rather than a Python method,
  # since every tree walk and rewrite hashes symbols.
  __hash__ = object.__hash__

  @property
  def type_str(self) -> str:
    """Short type, e.g. ``f32[1,10]``; the Python type name for a static value."""
    if self.aval is None:
      return type(getattr(self, 'value', None)).__name__
    return self.aval.str_short(short_dtypes=True)


class Var(Symbol):
  """A symbol whose value is computed (or passed in) at evaluation time.

  ``dropped`` marks an output that nothing reads (JAX prints it as ``_``).
  """

  __slots__ = ('dropped',)

  def __init__(self, aval, dropped: bool = False):
    self.aval = aval  # (Symbol.__init__, inlined: one per traced value)
    self.dropped = dropped

  def __repr__(self):
    return f'Var({self.type_str}, id={id(self):#x})'


class Literal(Symbol):
  """A constant known at trace time.

  Array literals carry an ``aval``. Static Python values (``bool``, ``None``,
  strings, other non-array objects passed to a module) have ``aval=None``.
  """

  __slots__ = ('value',)

  def __init__(self, value, aval=None):
    super().__init__(aval)
    self.value = value

  @property
  def is_static(self) -> bool:
    return self.aval is None

  def __repr__(self):
    return f'Literal({self.value!r})'


class Expr:
  """Base class of tree nodes: ``inputs``, ``outputs`` and ``params``."""

  __slots__ = ('inputs', 'outputs', 'params', '__weakref__')
  children: list['Expr']

  def __init__(self, inputs: Sequence[Symbol], outputs: Sequence[Symbol],
               params: dict | None = None):
    self.inputs = list(inputs)
    self.outputs = list(outputs)
    self.params = dict(params or {})

  def replace(self, **changes):
    """Returns a copy with the given fields changed.

    The copy shares no mutable container with ``self`` or with the values
    passed: every list, dict or set field (``inputs``, ``outputs``,
    ``params``, ``children`` ...) is a new container holding the same
    elements (the same symbols and child nodes), so editing one node's
    lists in place never changes another node.
    """
    cls = type(self)
    slots = _field_slots(cls)
    new = object.__new__(cls)
    for name in slots:
      if name in changes:
        continue  # set below, from the value passed
      try:
        value = getattr(self, name)
      except AttributeError:  # a field this node never set
        continue
      setattr(new, name, _fresh(value))
    for name, value in changes.items():
      if name not in slots and not hasattr(cls, name):
        raise AttributeError(f'{cls.__name__} has no field {name!r}')
      setattr(new, name, _fresh(value))
    return new

  def __str__(self):
    text = VIEWS.get('text')
    return text(self) if text is not None else repr(self)

  def __copy__(self):
    return self.replace()

  def __reduce_ex__(self, protocol):
    # pickle and copy.deepcopy come here (copy.copy uses __copy__). The
    # equations hold JAX primitives, parameters JAX does not pickle (jaxprs
    # with source tracebacks, functions) and tracebacks: a tree cannot be
    # pickled, so say so, and what keeps a rewritten model instead.
    raise NotPicklableError(
        f'a {type(self).__name__} cannot be pickled or deep-copied: its '
        'equations hold JAX primitives, source tracebacks and parameters '
        '(jaxprs, functions) that JAX does not serialize. Keep what the '
        'tree is made from instead: trace the model again and re-run the '
        'rewrite (LoRA adapters: res.save(path), then yax.load_lora(mox, '
        'params, path) on the fresh trace), or serialize the computation '
        'with jax.export')


_SLOTS: dict = {}


def _field_slots(cls) -> tuple:
  """The data fields of a node class, in ``__mro__`` order (cached: every
  rewrite copies nodes with :meth:`Expr.replace`)."""
  slots = _SLOTS.get(cls)
  if slots is None:
    slots = _SLOTS[cls] = tuple(dict.fromkeys(
        n for c in cls.__mro__ for n in getattr(c, '__slots__', ())
        if n != '__weakref__'))
  return slots


def _fresh(value):
  """A new container for a mutable field value (same type, same elements,
  not copied deeper); any other value as it is."""
  kind = type(value)
  if kind is list:
    return value[:]
  if kind is dict:
    return value.copy()
  if isinstance(value, (list, dict, set)):
    return copy.copy(value)
  return value


class Equation(Expr):
  """One application of a JAX primitive.

  ``prim`` is the primitive and ``params`` its parameters, exactly as in a
  Jaxpr (for ``jit``: ``name``, ``jaxpr``, ...), with one exception: a
  body in which Flax modules were called (``nn.scan``, ``nn.remat``,
  ``nn.jit``, ``cond``/``while`` over modules) lives only in ``children``,
  one ephemeral :class:`Mox` per body, and its key is not in ``params``.
  ``body_keys`` names where each body goes (``'jaxpr'``, or
  ``('branches', 0)`` for an element of a tuple parameter) and
  ``body_forms`` which Jaxpr form the primitive takes there (``'closed'``
  or ``'open'``). ``yax._src.ir.lower.equation_params`` gives the parameters
  with the bodies lowered, as JAX needs them.
  """

  __slots__ = ('prim', 'children', 'body_keys', 'body_forms', 'effects',
               'source_info', 'ctx')

  def __init__(self, prim, inputs, outputs, params=None, *, children=(),
               body_keys=(), body_forms=(), effects=frozenset(),
               source_info=None, ctx=None):
    super().__init__(inputs, outputs, params)
    self.prim = prim
    self.children = list(children)
    self.body_keys = list(body_keys)
    self.body_forms = list(body_forms)
    self.effects = effects
    self.source_info = source_info
    self.ctx = ctx

  @classmethod
  def _taking(cls, prim, inputs: list, outputs: list, params: dict, effects,
              source_info, ctx) -> 'Equation':
    """An equation without bodies that takes ``inputs`` and ``outputs``
    as they are (lists the caller made for it and never touches again):
    the tree builder's constructor, one per traced equation."""
    new = object.__new__(cls)
    new.inputs = inputs
    new.outputs = outputs
    new.params = dict(params)
    new.prim = prim
    new.children = []
    new.body_keys = []
    new.body_forms = []
    new.effects = effects
    new.source_info = source_info
    new.ctx = ctx
    return new

  @property
  def name(self) -> str | None:
    """The function name JAX shows for this equation, if any.

    ``params['name']`` for ``jit``; for ``custom_jvp_call`` and friends the
    name of the wrapped function (``relu``), from its Jaxpr's debug info.
    """
    name = self.params.get('name')
    if isinstance(name, str):
      return name
    infos = [getattr(getattr(value, 'jaxpr', value), 'debug_info', None)
             for value in self.params.values()]
    infos += [body.debug_info for body in self.children]
    for info in infos:
      src = getattr(info, 'func_src_info', None)
      # Skip JAX's placeholder for a Jaxpr built without debug info.
      if isinstance(src, str) and src and src != '<missing_debug_info>':
        return src.split(' ')[0]
    return None

  def __repr__(self):
    return (f'Equation({self.prim.name}, {len(self.inputs)} inputs, '
            f'{len(self.outputs)} outputs)')


class Mox(Expr):
  """A module call (``module_call``): a Flax module method and its body.

  Attributes:
    children: the body, a list of :class:`Equation` and :class:`Mox`.
    module_ty: the Flax module class; ``None`` for an ephemeral node (the
      traced function itself, a spliced function, or a module whose class no
      longer describes it after a rewrite).
    entrypoint: the method name (``'__call__'``).
    params: module dataclass fields except ``parent``, including ``name``.
    path: Flax scope path, e.g. ``('encoder', 'layer', '0')``.
    in_tree: treedef of the call arguments ``(args, kwargs)``.
    out_tree: treedef of the result.
    var_tree: treedef of the module variables read by the call; the first
      ``var_tree.num_leaves`` inputs are these variables.
    constvars, consts: constants captured by the trace (the root and
      bodies of equations only).
    debug_info: JAX's ``DebugInfo`` of the traced function or body (function
      and argument names), kept for lowering; ``None`` for a module call.
    inits: how the variables a rewrite added to this call get their first
      values (``yax.init_params``), or None: ``(group, *rel_path)`` (a
      variable's place relative to the call, as ``VarEntry.keys``) ->
      ``init(key, aval, read)``, which returns ``{keys: array}`` for that
      variable and any other of the call it stores anew (a kernel stored
      quantized with its new scale); ``aval`` is the variable's type as the
      traced arguments hold it (stacked, in a scan body), ``read(keys)``
      the array they hold at another place of the call.
  """

  __slots__ = ('children', 'module_ty', 'entrypoint', 'path', 'in_tree',
               'out_tree', 'var_tree', 'constvars', 'consts', 'debug_info',
               'inits')

  def __init__(self, inputs, outputs, params=None, *, children=(),
               module_ty=None, entrypoint=None, path=(), in_tree=None,
               out_tree=None, var_tree=None, constvars=(), consts=(),
               debug_info=None, inits=None):
    super().__init__(inputs, outputs, params)
    self.children = list(children)
    self.module_ty = module_ty
    self.entrypoint = entrypoint
    self.path = tuple(path)
    self.in_tree = in_tree
    self.out_tree = out_tree
    self.var_tree = var_tree if var_tree is not None else EMPTY_TREE
    self.constvars = list(constvars)
    self.consts = list(consts)
    self.debug_info = debug_info
    self.inits = inits

  @property
  def is_ephemeral(self) -> bool:
    return self.module_ty is None

  @property
  def num_vars(self) -> int:
    return self.var_tree.num_leaves

  @property
  def var_inputs(self) -> list[Symbol]:
    return self.inputs[:self.num_vars]

  @property
  def arg_inputs(self) -> list[Symbol]:
    return self.inputs[self.num_vars:]

  @property
  def name(self) -> str | None:
    return self.params.get('name')

  @property
  def type_name(self) -> str | None:
    return self.module_ty.__name__ if self.module_ty is not None else None

  def __repr__(self):
    kind = self.type_name or 'ephemeral'
    where = '/'.join(self.path) or '<root>'
    return (f'Mox({kind} at {where}, {len(self.inputs)} inputs, '
            f'{len(self.outputs)} outputs, {len(self.children)} children)')

  def to_dict(self) -> dict:
    """The tree as JSON-ready dicts (same content as the XML view)."""
    return _view('dict')(self)

  def to_json(self, indent: int | None = None) -> str:
    """The tree as JSON text (same content as the XML view)."""
    return _view('json')(self, indent=indent)


EMPTY_TREE = jax.tree_util.tree_structure(())


# The views behind ``str(expr)``, ``Mox.to_dict`` and ``Mox.to_json`` live in
# higher layers (``views/printing.py``, ``views/serialize.py``), which register them here when
# they are imported (``yax/__init__`` imports both), so the data model imports
# no module above it.
VIEWS: dict[str, Callable[..., Any]] = {}


def register_view(kind: str, fn: Callable[..., Any]) -> None:
  """Sets the function behind a view of a node: ``'text'`` (``str``),
  ``'dict'`` (``Mox.to_dict``) or ``'json'`` (``Mox.to_json``)."""
  VIEWS[kind] = fn


def _view(kind: str) -> Callable[..., Any]:
  fn = VIEWS.get(kind)
  if fn is None:
    raise YaxError(f'no {kind!r} view of a MoX is registered; it is '
                   'registered when yax is imported (import yax)')
  return fn


def iter_nodes(expr: Expr) -> Iterator[Expr]:
  """Pre-order traversal of every node under (and including) ``expr``."""
  stack = [expr]
  while stack:
    node = stack.pop()
    yield node
    stack.extend(reversed(getattr(node, 'children', ())))


def leaf_equations(expr: Expr) -> Iterator[Equation]:
  """Equations in evaluation order, descending into module calls only."""
  for child in expr.children:
    if isinstance(child, Mox):
      yield from leaf_equations(child)
    else:
      yield child
