"""Substitution: replace nodes of a module expression, get a new tree.

``sub(expr_or_nodes, repl, mox)`` walks the tree in evaluation order and
rebuilds it. Each selected node is replaced by a *copy* of the replacement
whose symbols are fresh, except where it is wired to the tree:

* its leading non-variable inputs read the replaced node's inputs;
* its variables reuse the replaced node's variables where the name, shape and
  dtype agree (a fresh trace of the same module reads the same weights);
  other variables are new, placed in the params tree at the module's path;
* everything downstream that read the node's outputs reads the copy's.

New variables and extra inputs propagate up: every enclosing module call
lists them among its inputs (and its ``var_tree``/``in_tree``) and is
marked ``rewritten`` (it keeps its type, path and fields for every view and
selection, but its Flax class no longer declares what it reads, so no
rewrite rebuilds it with that class), and the root's ``in_tree`` describes
the argument tree ``eval_mox`` now expects.

Nothing is mutated: on error the original tree is intact, and on success
unchanged subtrees are shared between the old and the new tree.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import weakref
from typing import Callable, Sequence, Union

import jax
from jax import tree_util as jtu

from yax._src.errors import SubstitutionError
from yax._src.ir import lower as _lower
from yax._src.ir import rules as _rules
from yax._src.ir.containers import set_in
from yax._src.ir.nodes import (Equation, Expr, Literal, Mox, Symbol, Var,
                               iter_nodes, leaf_equations)
from yax._src.ir.variables import (NNX_GROUP, VarEntry, key_name,
                                   leaf_keypaths, location, unboxed_path,
                                   var_entries, var_keys, var_kind,
                                   with_variables)
from yax._src.trace import systems as _systems

Replacement = Union[Expr, Callable[[tuple, Expr], Expr]]

# A variable location: (collection, *module path, *name inside the module).
Loc = tuple


def _where(node: Expr, path: tuple = ()) -> str:
  """How errors name a node: its type and module path."""
  if isinstance(node, Mox):
    kind = node.type_name or 'ephemeral module_call'
    return f"{kind} at path '{'/'.join(node.path) or '<root>'}'"
  name = f' ({node.name})' if node.name and node.name != node.prim.name else ''
  return (f"equation '{node.prim.name}'{name} in the module call at path "
          f"'{'/'.join(path) or '<root>'}'")


def root_keypaths(root: Mox) -> dict:
  """Root input symbol -> its key path in ``(args, kwargs)``. The value
  field of an NNX Variable is left out: the path is the Variable's."""
  keypaths = leaf_keypaths(root.in_tree)
  return {sym: tuple(key_name(k) for k in unboxed_path(keypath))
          for sym, keypath in zip(root.inputs, keypaths, strict=True)}


def _var_locs(mox: Mox) -> list[tuple[Loc, Symbol]]:
  """(location, symbol) for each variable input of a module call."""
  return [(location(mox, e), e.symbol) for e in var_entries(mox)]


def _same_type(a: Symbol, b: Symbol) -> bool:
  if a.aval is None or b.aval is None:
    return a.aval is None and b.aval is None
  return (tuple(a.aval.shape) == tuple(b.aval.shape)
          and a.aval.dtype == b.aval.dtype)


def _same_nodes(new: Sequence, old: Sequence) -> bool:
  """The same nodes, in order: a splice that changes the number of children
  (a replacement with no equations, or with several) is a change."""
  return len(new) == len(old) and all(
      a is b for a, b in zip(new, old, strict=True))


def non_literals(symbols) -> list[Symbol]:
  """The symbols that are not literals, in order."""
  return [s for s in symbols if not isinstance(s, Literal)]


@dataclasses.dataclass(frozen=True)
class Located:
  """Where a tree's variables sit in its root arguments, found once per
  tree (:func:`locate`).

  Attributes:
    keypaths: root input symbol -> its key path in ``(args, kwargs)``.
    locs: variable location ``(collection, *module path, *name)`` -> the
      root-scope symbol that module calls read it as.
    collections: collection -> the key path prefix it sits under
      (``(0, 0, 'params')`` for ``model.apply(variables, x)``).
    used_paths: every module path in use (calls and variable places).
  """
  keypaths: dict
  locs: dict
  collections: dict
  used_paths: frozenset


_located: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def locate(root: Mox) -> Located:
  """The :class:`Located` facts of ``root`` (cached: trees are
  immutable)."""
  found = _located.get(root)
  if found is None:
    found = _locate(root)
    _located[root] = found
  return found


def _locate(root: Mox) -> Located:
  keypaths = root_keypaths(root)
  locs: dict[Loc, Symbol] = {}
  prefix: dict[str, tuple] = {}
  # Module calls inside bodies (nn.jit, nn.scan ...) count too: a body
  # input stands for the equation input it receives (``alias``).
  stack = [(c, {}, {}, True) for c in root.children]
  # Where each collection sits: the prefix most variables agree on (the
  # root call of a nested Module.apply reads weights of another module
  # under a path of its own: it must not decide).
  votes: dict[str, collections.Counter] = {}
  all_locs: set = set()
  # A key path's steps as the strings a location holds, once per input.
  str_keypaths = {sym: tuple(map(str, kp)) for sym, kp in keypaths.items()}
  while stack:
    # ``moved``: in this scope, a param transposed before a scan slices
    # it (nn.scan with variable_axes={'params': 1}, MaxText's scanned
    # layers): the scanned slices are the param's.
    # ``root_scope``: the node reads symbols of the root scope.
    node, alias, moved, root_scope = stack.pop()
    if isinstance(node, Equation):
      for index, body in enumerate(node.children):
        outer = _rules.body_input_sources(node, index)
        if node.prim.name == 'scan':
          outer = [moved.get(o, o) for o in outer]
        inner = {b: alias.get(o, o)
                 for b, o in zip(body.inputs, outer, strict=True)}
        stack.extend((c, {**alias, **inner}, {}, False)
                     for c in body.children)
      continue
    inside = {c.outputs[0]: c.inputs[0] for c in node.children
              if isinstance(c, Equation) and c.prim.name == 'transpose'
              and not isinstance(c.inputs[0], Literal)}
    # A param passed through a sharding constraint is still that param
    # (Linen's LogicallyPartitioned.unbox under a mesh, before the NNX
    # modules a ToLinen bridge merges read it).
    constrained = {c.outputs[0]: alias.get(c.inputs[0], c.inputs[0])
                   for c in node.children if isinstance(c, Equation)
                   and c.prim.name == 'sharding_constraint'
                   and not isinstance(c.inputs[0], Literal)}
    scope = {**alias, **constrained} if constrained else alias
    stack.extend((c, scope, inside, root_scope) for c in node.children)
    if node.is_ephemeral:
      continue
    for loc, sym in _var_locs(node):
      all_locs.add(loc)
      source = alias.get(sym, sym)
      keypath = keypaths.get(source)
      if keypath is None:
        continue  # not read from the arguments (computed inside fn)
      if root_scope and sym in keypaths:  # a root argument itself
        locs.setdefault(loc, sym)
      cut = len(keypath) - len(loc) + 1  # where the location's tail starts
      if cut > 0 and str_keypaths[source][cut:] == loc[1:]:
        votes.setdefault(loc[0], collections.Counter())[keypath[:cut]] += 1
  used_paths = {tuple(n.path) for n in iter_nodes(root)
                if isinstance(n, Mox) and not n.is_ephemeral}
  for loc in all_locs:
    used_paths.update(tuple(loc[1:i]) for i in range(2, len(loc)))
  for collection, counts in votes.items():
    prefix[collection] = max(counts, key=lambda p: (counts[p], -len(p)))
  return Located(keypaths, locs, prefix, frozenset(used_paths))


# A replacement module call for an equation whose params hold this key
# (True) sits at the path of the module call around the equation, and its
# variables are that module's own; without it, it is a new child module.
IN_PLACE = 'in_place'
# Primitives that only move (or constrain the placement of) elements: a
# value they compute can be stored in another dtype with their input.
_RETYPABLE = frozenset({'transpose', 'reshape', 'squeeze', 'expand_dims',
                        'broadcast_in_dim', 'copy', 'copy_p', 'rev',
                        'sharding_constraint'})


@dataclasses.dataclass
class _Frame:
  """An enclosing module call being rebuilt; collects what propagates up."""
  node: Mox
  new_vars: list  # (loc, Var)
  new_args: list  # Var
  is_body: bool = False  # the body of an equation (nn.scan, nn.remat ...)
  # Constants of replacements, defined in this body (or the root).
  new_consts: list = dataclasses.field(default_factory=list)  # (Var, value)
  # Named inputs (see ``substitute``'s ``inputs``) read in this body (or
  # the root): one symbol per name, shared by every replacement here.
  named: dict = dataclasses.field(default_factory=dict)  # name -> Var


class _InputKey(_rules.ConstKey):
  """The key of a named input passed into a body: loop-invariant, like a
  constant (``scan`` passes it as a constant)."""

  @property
  def name(self) -> str:
    return self[1]


class _Substitution:

  def __init__(self, root: Mox, targets: Sequence[Expr], repl: Replacement,
               *, retype: bool = False, inputs: dict | None = None):
    self.root = root
    # Replacement input symbol -> the name of the root keyword argument it
    # reads (one symbol per name and scope, however many sites read it).
    self.named_inputs = {} if inputs is None else inputs
    # A replacement that keeps the node's path may store one of the node's
    # own variables in another type (yax.quantize: an int8 kernel); every
    # reader of the old variable is then renamed to the new one.
    self.retype = retype
    self.targets = {id(t): t for t in targets}
    self.visits = {id(t): 0 for t in targets}  # exactly once, checked after
    self.replaced: list[tuple[Expr, tuple]] = []  # (target, what replaced it)
    self.repl = repl
    self.ren: dict[Symbol, Symbol] = {}
    self.stack: list[_Frame] = []
    self.added: dict[Loc, Var] = {}  # new variables by location
    self.retyped: dict[tuple, Var] = {}  # by root key path, once finished
    # NNX: the Variable type of each new variable, by location.
    self.kinds: dict[Loc, str] = {}
    self._read: set | None = None
    # Per enclosing module call: how many sites of each replacement type.
    self.site_counts: dict[int, dict[str, int]] = {}
    found = locate(root)
    self.keypaths, self.locs = found.keypaths, found.locs
    self.prefix, self.used_paths = found.collections, found.used_paths

  def collection_prefix(self, collection: str) -> tuple | None:
    """Where ``collection`` sits in the root arguments, or where a rewrite
    creates it (a replacement may bring the first variable of a collection
    the arguments lack): next to another collection (``args[0]
    ['batch_stats']`` gives ``args[0]['params']``), else in a first
    argument that is an empty mapping (what ``Module.init`` gives a
    parameter-free Linen model). None when there is no such place."""
    found = self.prefix.get(collection)
    if found is not None:
      return found
    if self.root.in_tree is None:
      return None
    args, _ = jtu.tree_unflatten(self.root.in_tree,
                                 range(len(self.root.inputs)))
    first = args[0] if args else None
    if _systems.is_typed_state(first):
      # An NNX state holds NNX Variables at their module paths, never a
      # Linen collection; an empty one (a parameter-free model) gets its
      # first Variables in it, as a hand-written module would.
      empty = not jtu.tree_leaves(first)
      return (0, 0) if collection == NNX_GROUP and empty else None
    if collection == NNX_GROUP:
      return None
    for other, prefix in self.prefix.items():
      if prefix and prefix[-1] == other:
        return (*prefix[:-1], collection)
    if isinstance(first, collections.abc.Mapping) and not first:
      return (0, 0, collection)
    return None

  def _nnx_state_argument(self) -> bool:
    """True when the first traced argument is an ``nnx.State``."""
    if self.root.in_tree is None:
      return False
    args, _ = jtu.tree_unflatten(self.root.in_tree,
                                 range(len(self.root.inputs)))
    return bool(args) and _systems.is_typed_state(args[0])

  # -- the walk

  def run(self) -> Mox:
    if id(self.root) in self.targets:
      self.visits[id(self.root)] += 1
      self.replaced.append((self.root, (self.root,)))
      keeps = (callable(self.repl) and not isinstance(self.repl, Expr)
               and self.repl(self.root.path, self.root) is self.root)
      if not keeps:
          raise SubstitutionError('the root of a tree cannot be substituted; '
                                'trace the replacement function instead')
    frame = _Frame(self.root, [], [])
    self.stack.append(frame)
    children = self.rebuild_children(self.root.children)
    self.stack.pop()
    return self.finish_root(children, frame)

  def check_visits(self, chosen: 'Selection') -> None:
    """Every target was reached exactly once (Equinox ``tree_at`` style)."""
    for target in chosen.targets:
      n = self.visits[id(target)]
      if n != 1:
        raise SubstitutionError(
            f'internal: the rewrite reached {describe(target)} (selected by '
            f'{chosen.description}) {n} times instead of once; the tree '
            'holds that node object in more than one place')

  def rename(self, sym: Symbol) -> Symbol:
    # A symbol that no replacement redefined keeps its identity.
    return self.ren.get(sym, sym)

  def rebuild_children(self, children) -> list:
    out = []
    for child in children:
      if id(child) in self.targets:
        self.visits[id(child)] += 1
        new = self.replace(child)
        self.replaced.append((child, tuple(new)))
        out.extend(new)
      elif isinstance(child, Mox):
        out.append(self.rebuild_module(child))
      else:
        out.append(self.rebuild_equation(child))
    if self.retype:
      self._retype_producers(out)
    return out

  def _retype_producers(self, out: list) -> None:
    """An equation of this scope that defines a value a body now reads
    retyped (a stacked kernel that a transpose moved before the ``scan``
    slicing it, stored quantized) is retyped with it, when it only moves
    elements (``_RETYPABLE``), and so is its input, back to the variable.
    ``out`` (the scope's rebuilt children) is updated in place."""
    for i in range(len(out) - 1, -1, -1):
      eqn = out[i]
      if not isinstance(eqn, Equation) or eqn.children or \
          len(eqn.outputs) != 1:
        continue
      old = eqn.outputs[0]
      new = self.ren.get(old)
      if new is None or new is old or new.aval.dtype == old.aval.dtype:
        continue
      where = _where(eqn, self.enclosing_path())
      src = eqn.inputs[0]
      if eqn.prim.name not in _RETYPABLE or isinstance(src, Literal):
        raise SubstitutionError(
            f'cannot store the input of a body as {new.type_str}: it is '
            f'computed by {where}, which is not a layout change '
            f'({", ".join(sorted(_RETYPABLE))}) of a variable')
      # Other readers: module calls with no body may only list it (Flax's
      # ToLinen records its variables in a call '_update_variables').
      others = [j for j, c in enumerate(out) if c is not eqn and
                src in c.inputs]
      bad = [out[j] for j in others
             if not isinstance(out[j], Mox) or out[j].children]
      if bad:
        raise SubstitutionError(
            f'cannot store {src.type_str} as {new.aval.dtype}: {where} '
            f'moves it into a body that reads it retyped, and '
            f'{describe(bad[0])} reads it too')
      retyped = self.ren.get(src)
      if retyped is None or retyped is src:
        retyped = Var(src.aval.update(dtype=new.aval.dtype))
        self.ren[src] = retyped
      out[i] = eqn.replace(inputs=[retyped, *eqn.inputs[1:]], outputs=[new])
      for j in others:
        out[j] = out[j].replace(inputs=[retyped if s is src else s
                                        for s in out[j].inputs])

  def rebuild_module(self, node: Mox) -> Mox:
    frame = _Frame(node, [], [])
    self.stack.append(frame)
    children = self.rebuild_children(node.children)
    self.stack.pop()
    inputs = [self.rename(s) for s in node.inputs]
    outputs = [self.rename(s) for s in node.outputs]
    if not frame.new_vars and not frame.new_args:
      if (inputs == node.inputs and outputs == node.outputs and
          _same_nodes(children, node.children)):
        return node
      return node.replace(inputs=inputs, outputs=outputs, children=children)
    var_inputs, var_tree = self._grow_vars(
        node, inputs[:node.num_vars], frame.new_vars)
    arg_inputs, in_tree = self._grow_args(
        node.in_tree, inputs[node.num_vars:], frame.new_args)
    return node.replace(inputs=var_inputs + arg_inputs, outputs=outputs,
                        children=children, var_tree=var_tree, in_tree=in_tree,
                        rewritten=not node.is_ephemeral)

  def _grow_vars(self, node: Mox, var_inputs, new_vars):
    """The call's variables with the new ones of its scope added."""
    n = len(node.path)
    added = []
    for loc, sym in new_vars:
      if tuple(loc[1:1 + n]) != node.path:
        continue  # the variable lives outside this module's scope
      rel = tuple(loc[1 + n:])
      kind = self.kinds.get(loc, 'Param') if loc[0] == NNX_GROUP else loc[0]
      is_param = _systems.is_param(loc[0], kind)
      added.append(VarEntry(loc[0], kind, rel, is_param, len(rel) == 1, sym))
    return with_variables(node, var_inputs, added)

  def _grow_args(self, in_tree, arg_inputs, new_args):
    if not new_args:
      return arg_inputs, in_tree
    args, kwargs = jtu.tree_unflatten(in_tree, arg_inputs)
    args = tuple(args) + tuple(new_args)
    leaves, tree = jtu.tree_flatten((args, kwargs),
                                    is_leaf=lambda x: isinstance(x, Symbol))
    return leaves, tree

  def rebuild_equation(self, eqn: Equation) -> Equation:
    inputs = [self.rename(s) for s in eqn.inputs]
    if not eqn.children:
      if inputs == eqn.inputs:
        return eqn
      return eqn.replace(inputs=inputs)
    where = _where(eqn, self.enclosing_path())
    bodies, needed, const_values = [], [], {}
    retyped_out = {}  # output position -> its new dtype
    for index, (body, form) in enumerate(
        zip(eqn.children, eqn.body_forms, strict=True)):
      frame = _Frame(body, [], [], is_body=True)
      self.stack.append(frame)
      children = self.rebuild_children(body.children)
      self.stack.pop()
      body = self._retype_body_inputs(eqn, index, body, inputs)
      if frame.new_args:
        raise SubstitutionError(
            f'the replacement inside the body of {where} needs '
            f'{len(frame.new_args)} extra arguments; inside lifted transforms '
            '(nn.scan, nn.remat, nn.jit ...) a replacement must take the '
            'arguments of the node it replaces')
      outputs = [self.rename(s) for s in body.outputs]
      # A retyped variable the body returns (an NNX remat's state), where
      # the body's outputs are the equation's (remat, jit, scan, cond and
      # while bodies; not a custom_vjp's backward pass).
      if self.retype and len(body.outputs) == len(eqn.outputs):
        for j, (old, new) in enumerate(zip(body.outputs, outputs,
                                           strict=True)):
          if new is not old and new.aval is not None and \
              old.aval is not None and new.aval.dtype != old.aval.dtype:
            retyped_out[j] = new.aval.dtype
      if (not _same_nodes(children, body.children)
          or outputs != body.outputs or frame.new_consts):
        body = body.replace(children=children, outputs=outputs)
      if frame.new_consts:
        if form == _lower.CLOSED and eqn.prim.name in _rules.CONSTS_IN_BODY:
          body = body.replace(
              constvars=[*body.constvars, *(v for v, _ in frame.new_consts)],
              consts=[*body.consts, *(c for _, c in frame.new_consts)])
        else:  # passed in from outside, like a loop-invariant variable
          for var, value in frame.new_consts:
            key = _rules.ConstKey(('const', id(var)))
            const_values[key] = value
            needed.append(_rules.Needed(index, key, var))
      for name, inner in frame.named.items():
        needed.append(_rules.Needed(index, _InputKey(('input', name)), inner))
      seen = {}
      for loc, inner in frame.new_vars:
        seen.setdefault(loc, inner)
      for loc, inner in seen.items():
        needed.append(_rules.Needed(
            index, loc, inner, self._sibling_position(body, loc)))
      bodies.append(body)
    params = eqn.params
    if needed:
      done = _rules.thread(eqn, inputs, bodies, params, needed, where)
      inputs, params = done.inputs, done.params
      bodies = [b if b.inputs == old.inputs else
                b.replace(in_tree=jax.tree_util.tree_structure(list(b.inputs)))
                for b, old in zip(done.bodies, bodies, strict=True)]
      enclosing = next((f for f in reversed(self.stack) if f.is_body),
                       self.stack[0])
      outer_vars = []
      for key, var in done.outer:
        if isinstance(key, _InputKey):  # the enclosing scope's symbol
          shared = self._named_input(key.name, var.aval)
          self._register_named(key.name, shared)
          inputs = [shared if s is var else s for s in inputs]
        elif isinstance(key, _rules.ConstKey):
          enclosing.new_consts.append((var, const_values[key]))
        else:
          # A variable this rewrite already made in the enclosing scope (a
          # module called twice, each call reaching it through a jit body
          # of its own): the equation reads that symbol, not a second one.
          prior = (dict(enclosing.new_vars).get(key) if enclosing.is_body
                   else self.added.get(key))
          if prior is not None and prior is not var:
            if not _same_type(prior, var):
              raise SubstitutionError(
                  f"cannot substitute inside {where}: the new variable "
                  f"'{'/'.join(map(str, key))}' is passed in as "
                  f'{var.type_str} here and as {prior.type_str} at another '
                  'site')
            inputs = [prior if s is var else s for s in inputs]
            var = prior
          outer_vars.append((key, var))
      for f in reversed(self.stack):
        f.new_vars.extend(outer_vars)
        if f.is_body:
          break
      if not any(f.is_body for f in self.stack):
        for loc, var in outer_vars:
          self.added[loc] = var
    if inputs == eqn.inputs and _same_nodes(bodies, eqn.children):
      return eqn
    # A body output retyped: the equation's output at that position (its
    # bodies' outputs are its outputs, in order: carry then stacked ys for
    # a scan) holds the new dtype; its readers read the new symbol.
    outs = list(eqn.outputs)
    for j, dtype in retyped_out.items():
      if j < len(outs) and outs[j].aval.dtype != dtype:
        fresh = Var(outs[j].aval.update(dtype=dtype))
        self.ren[outs[j]] = fresh
        outs[j] = fresh
    return eqn.replace(inputs=inputs, outputs=outs, children=bodies,
                       params=dict(params))

  def _retype_body_inputs(self, eqn: Equation, index: int, body: Mox,
                          inputs: list) -> Mox:
    """A body input that a replacement inside retyped (a kernel stored
    quantized) makes the equation input it receives retyped too: same
    shape (stacked, for a scan), the new dtype. ``inputs`` (the
    equation's, renamed) is updated in place."""
    if not self.retype or not any(s in self.ren for s in body.inputs):
      return body
    positions = _rules.body_input_positions(eqn, index)
    new_inputs = []
    for sym, pos in zip(body.inputs, positions, strict=True):
      new = self.ren.get(sym)
      if new is None:
        new_inputs.append(sym)
        continue
      outer = eqn.inputs[pos]
      renamed = self.ren.get(outer)
      if renamed is None:
        renamed = Var(outer.aval.update(dtype=new.aval.dtype))
        self.ren[outer] = renamed
      elif renamed.aval.dtype != new.aval.dtype:
        raise SubstitutionError(
            f'cannot substitute inside {_where(eqn, self.enclosing_path())}: '
            f'its input {pos} is read as {renamed.type_str} and as '
            f'{new.type_str} by two replacements')
      inputs[pos] = renamed
      new_inputs.append(new)
    return body.replace(inputs=new_inputs)

  def _sibling_position(self, body: Mox, loc) -> int | None:
    """Position among the body inputs of a variable in the same module."""
    body_inputs = body.inputs
    module_path = tuple(loc[1:-1])
    for node in body.children:
      stack = [node]
      while stack:
        n = stack.pop()
        if isinstance(n, Mox):
          stack.extend(n.children)
          if n.path == module_path:
            for sym in n.var_inputs:
              if sym in body_inputs:
                return body_inputs.index(sym)
    return None

  # -- named inputs

  def _named_input(self, name: str, aval) -> Var:
    """The symbol of the named input in the innermost scope (a body or
    the root), fresh when this scope reads it for the first time."""
    home = next((f for f in reversed(self.stack) if f.is_body), self.stack[0])
    var = home.named.get(name)
    if var is None:
      return Var(aval)
    if not _same_type(var, Var(aval)):
      raise SubstitutionError(
          f'the named input {name!r} is read as {var.type_str} and as '
          f'{Var(aval).type_str}; one name holds one type')
    return var

  def _register_named(self, name: str, var: Var) -> None:
    """Every module call up to the scope takes ``var`` as an argument;
    the scope (a body, threaded out by its equation, or the root, a
    keyword argument) records it."""
    for frame in reversed(self.stack):
      if frame.is_body or frame is self.stack[0]:
        frame.named.setdefault(name, var)
        return
      if not any(a is var for a in frame.new_args):
        frame.new_args.append(var)

  # -- one replacement

  def enclosing_path(self) -> tuple:
    return next((f.node.path for f in reversed(self.stack) if not f.is_body),
                ())

  def replace(self, node: Expr) -> list[Expr]:
    template = self.repl
    if callable(template) and not isinstance(template, Expr):
      # An equation's path is the path of the module call it sits in.
      path = node.path if isinstance(node, Mox) else self.enclosing_path()
      template = template(path, node)
      if template is node:
        if isinstance(node, Mox):
          return [self.rebuild_module(node)]
        return [self.rebuild_equation(node)]
    if not isinstance(template, Expr):
      raise SubstitutionError(
          f'a replacement for {_where(node, self.enclosing_path())} must be a Mox, an Equation or a '
          f'callable returning one; found {type(template).__name__}')
    consts = []
    if isinstance(template, Mox) and template.is_ephemeral:
      template, consts = _unwrap_traced_module(template)
    if isinstance(node, Mox):
      node_args = non_literals(self.rename(s) for s in node.arg_inputs)
    else:
      node_args = non_literals(self.rename(s) for s in node.inputs)
    wiring: dict[Symbol, Symbol] = {}
    retyped: list[tuple[Symbol, Var]] = []
    extra_args: list[Var] = []
    named: list[tuple[str, Var]] = []
    new_vars: list[tuple[Loc, Var]] = []
    # Constants are defined in the innermost body (or the root) around the
    # node, since a body cannot read symbols of the scope outside it.
    home = next((f for f in reversed(self.stack) if f.is_body), self.stack[0])
    new_consts = []
    for const_var, value in consts:
      fresh = Var(const_var.aval)
      wiring[const_var] = fresh
      new_consts.append((fresh, value))

    is_module = isinstance(template, Mox) and not template.is_ephemeral
    if is_module:
      t_args = template.arg_inputs
      name = template.name if template.name is not None else getattr(
          node, 'name', None)
      node_path = getattr(node, 'path', ())
      if isinstance(node, Equation) and template.params.get(IN_PLACE):
        # In place of an equation, a module call at the enclosing module's
        # own path: its variables are that module's (LoRA's adapters of a
        # kernel the module contracts in its body).
        new_path = self.enclosing_path()
      elif isinstance(node, Equation) and template.num_vars:
        # A new module with variables in place of an equation: a child of
        # the enclosing module, one per site (PReLU_0, PReLU_1 ...).
        new_path = self._site_path(template)
        name = new_path[-1]
      elif template.name is not None and node_path and \
          template.name != getattr(node, 'name', None):
        new_path = (*node_path[:-1], template.name)
      else:
        new_path = node_path
      self._wire_variables(node, template, new_path, wiring, new_vars,
                           retyped)
    else:
      t_args = template.inputs
    for pos, sym in enumerate(non_literals(t_args)):
      if pos < len(node_args):
        target = node_args[pos]
        if not _same_type(sym, target):
          raise SubstitutionError(
              f'cannot substitute {_where(node, self.enclosing_path())}: input {pos} of the '
              f'replacement has type {sym.type_str} but the node passes '
              f'{target.type_str}')
        wiring[sym] = target
      elif sym in self.named_inputs:
        shared = self._named_input(self.named_inputs[sym], sym.aval)
        wiring[sym] = shared
        named.append((self.named_inputs[sym], shared))
      else:
        fresh = Var(sym.aval)
        wiring[sym] = fresh
        extra_args.append(fresh)

    if isinstance(node, Mox) and isinstance(template, Mox):
      # A module call is no scope: its body may read values of the
      # enclosing body (a constant of the tree, a PRNG key of the traced
      # arguments, an array the caller computed). A template that reads
      # the same values reads them where the node did.
      for sym in reads_from_enclosing(node):
        wiring.setdefault(sym, self.rename(sym))
    copier = _Copier(wiring, node, _where(node, self.enclosing_path()))
    copied = copier.copy(template)
    old_outs = [s for s in node.outputs if not (isinstance(s, Literal) and
                                                 s.is_static)]
    new_outs = [s for s in copied.outputs if not (isinstance(s, Literal) and
                                                   s.is_static)]
    if len(old_outs) != len(new_outs):
      raise SubstitutionError(
          f'cannot substitute {_where(node, self.enclosing_path())}: it has {len(old_outs)} outputs '
          f'({", ".join(s.type_str for s in old_outs)}) but the replacement '
          f'has {len(new_outs)} ({", ".join(s.type_str for s in new_outs)})')
    for pos, (old, new) in enumerate(zip(old_outs, new_outs, strict=True)):
      # An output nothing reads may change type (``retype``); inside a
      # body, the equation's output it becomes changes with it (see
      # rebuild_equation; yax.cast checks the chain before it asks).
      if not _same_type(old, new) and not (
          self.retype and old not in self.read_symbols()):
        raise SubstitutionError(
            f'cannot substitute {_where(node, self.enclosing_path())}: output {pos} has type '
            f'{old.type_str} but the replacement gives {new.type_str}')
    # Only now, when nothing can fail any more, record what the copy needs.
    for old, new in zip(old_outs, new_outs, strict=True):
      self.ren[old] = new
    if isinstance(node, Mox):
      # A value the node computes and the tree reads elsewhere without it
      # being an output (a Linen BatchNorm's new statistics under
      # ``mutable``, read by the root): where the template defines that
      # same symbol, its copy is what the readers read now.
      for old in defined_in(node):
        new = copier.map.get(old)
        if new is not None and old not in wiring:
          self.ren.setdefault(old, new)
    for old, new in retyped:
      self.ren[old] = new
    home.new_consts.extend(new_consts)
    if not any(f.is_body for f in self.stack):
      for loc, var in new_vars:
        self.added[loc] = var
    for frame in reversed(self.stack):
      frame.new_vars.extend(new_vars)
      frame.new_args.extend(extra_args)
      if frame.is_body:  # the equation holding the body threads them out
        break
    for name, var in named:
      self._register_named(name, var)
    if is_module:
      params = dict(copied.params)
      params['name'] = name
      return [copied.replace(path=tuple(new_path), params=params)]
    if isinstance(copied, Mox):  # an ephemeral function: splice its body
      return list(copied.children)
    return [copied]

  def _site_path(self, template: Mox) -> tuple:
    """``(*enclosing module path, f'{Type}_{k}')``: sites counted per call
    of the enclosing module in evaluation order (two calls of one module
    give the same paths, so they share the new variables, as Flax's
    submodules would), never a path the tree already uses."""
    frame = next((f for f in reversed(self.stack) if not f.is_body),
                 self.stack[0])
    base = template.type_name or 'Module'
    counts = self.site_counts.setdefault(id(frame.node), {})
    k = counts.get(base, 0)
    enclosing = tuple(frame.node.path)
    while (*enclosing, f'{base}_{k}') in self.used_paths:
      k += 1
    counts[base] = k + 1
    return (*enclosing, f'{base}_{k}')

  def _wire_variables(self, node, template: Mox, new_path, wiring, new_vars,
                      retyped=None):
    retyped = [] if retyped is None else retyped
    own = {}
    if isinstance(node, Mox) and tuple(new_path) == node.path:
      for keys, sym in zip(var_keys(node), node.var_inputs, strict=True):
        own[keys] = self.rename(sym)
    for keys, sym in zip(var_keys(template), template.var_inputs,
                         strict=True):
      loc = (keys[0], *new_path, *keys[1:])
      existing = own.get(keys)
      body = next((f for f in reversed(self.stack) if f.is_body), None)
      if existing is None and body is not None:
        existing = dict(body.new_vars).get(loc) or dict(new_vars).get(loc)
      elif existing is None:
        existing = self.locs.get(loc) or dict(new_vars).get(loc)
        if existing is None and loc in self.added:
          # New at another site of this rewrite (a module called twice):
          # the calls around this site list it too.
          existing = self.added[loc]
          new_vars.append((loc, existing))
      if existing is not None:
        if not _same_type(existing, sym) and self.retype and \
            keys in own and existing is own[keys]:
          fresh = Var(sym.aval)
          wiring[sym] = fresh
          retyped.append((existing, fresh))
          continue
        if not _same_type(existing, sym):
          raise SubstitutionError(
              f"cannot substitute {_where(node, self.enclosing_path())}: variable "
              f"'{'/'.join(loc)}' exists with type {existing.type_str} but "
              f'the replacement reads it as {sym.type_str}; give the '
              'replacement module another name')
        wiring[sym] = existing
        continue
      if self.collection_prefix(keys[0]) is None:
        hint = ''
        if keys[0] != NNX_GROUP and self._nnx_state_argument():
          hint = ('; the traced nnx.State holds NNX Variables only: write '
                  'the replacement as an NNX module')
        raise SubstitutionError(
            f"cannot substitute {_where(node, self.enclosing_path())}: the replacement needs a new "
            f"variable '{'/'.join(loc)}' but the traced arguments hold no "
            f"'{keys[0]}' collection to put it in{hint}")
      fresh = Var(sym.aval)
      wiring[sym] = fresh
      new_vars.append((loc, fresh))
      if loc[0] == NNX_GROUP:
        self.kinds[loc] = var_kind(template, template.var_inputs.index(sym))[0]

  def read_symbols(self) -> set:
    if self._read is None:
      self._read = read_symbols(self.root)
    return self._read

  # -- the root

  def finish_root(self, children, frame: _Frame) -> Mox:
    root = self.root
    inputs = [self.rename(s) for s in root.inputs]  # retyped variables
    in_tree = root.in_tree
    if frame.new_vars or frame.new_args or frame.named:
      placeholders = jtu.tree_unflatten(in_tree, inputs)
      box = _systems.new_variable_boxer(placeholders)
      seen = set()
      for loc, sym in frame.new_vars:
        if loc in seen:
          continue
        seen.add(loc)
        prefix = self.collection_prefix(loc[0])
        value = box(loc[0], self.kinds.get(loc, 'Param'), sym)
        placeholders = set_in(placeholders, (*prefix, *loc[1:]), value)
      if frame.new_args:
        args, kwargs = placeholders
        placeholders = (tuple(args) + tuple(frame.new_args), kwargs)
      if frame.named:  # keyword arguments of the root
        args, kwargs = placeholders
        taken = sorted(set(frame.named) & set(kwargs))
        if taken:
          raise SubstitutionError(
              f'the rewrite adds the keyword argument {taken[0]!r}, which the '
              'traced function already takes')
        placeholders = (args, {**kwargs, **frame.named})
      inputs, in_tree = jtu.tree_flatten(
          placeholders, is_leaf=lambda x: isinstance(x, Symbol))
    # Variables read in another type now (quantized kernels), by key path.
    self.retyped = {self.keypaths[old]: new for old, new in zip(
        root.inputs, (self.rename(s) for s in root.inputs), strict=True)
                    if new is not old and old in self.keypaths}
    outputs = [self.rename(s) for s in root.outputs]
    constvars = list(root.constvars) + [v for v, _ in frame.new_consts]
    consts = list(root.consts) + [c for _, c in frame.new_consts]
    return root.replace(inputs=inputs, outputs=outputs, children=children,
                        in_tree=in_tree, constvars=constvars, consts=consts)


def _unwrap_traced_module(root: Mox):
  """``make_mox(m.apply)(v, x)`` -> its one module call; else the root."""
  consts = list(zip(root.constvars, root.consts, strict=True))
  if len(root.children) == 1 and isinstance(root.children[0], Mox):
    child = root.children[0]
    if (not child.is_ephemeral and
        set(non_literals(root.outputs)) == set(non_literals(child.outputs)) and
        set(non_literals(child.inputs)) <= set(non_literals(root.inputs))):
      return child, consts
  return root, consts


class _Copier:
  """Copies a replacement with fresh symbols, wired through ``wiring``;
  ``fixed`` names the symbol a copy defines in place of a fresh one."""

  def __init__(self, wiring: dict, node: Expr, where: str = '',
               fixed: dict | None = None):
    self.map = dict(wiring)
    self.node = node
    self.where = where or _where(node)
    self.fixed = {} if fixed is None else fixed

  def read(self, sym: Symbol) -> Symbol:
    if isinstance(sym, Literal):
      return sym
    try:
      return self.map[sym]
    except KeyError:
      raise SubstitutionError(
          f'cannot substitute {self.where}: the replacement reads a '
          f'value of type {sym.type_str} that it neither computes nor takes '
          'as an input (a closure over another trace); trace the '
          'replacement as a function of all the values it reads') from None

  def define(self, sym: Symbol) -> Symbol:
    if isinstance(sym, Literal):
      return sym
    new = self.fixed.pop(sym, None)
    if new is None:
      new = Var(sym.aval, dropped=sym.dropped)
    self.map[sym] = new
    return new

  def copy(self, expr: Expr) -> Expr:
    if isinstance(expr, Equation):
      inputs = [self.read(s) for s in expr.inputs]
      # Bodies of sub-jaxprs are closed: copy them with their own symbols.
      bodies = [_Copier({}, self.node, self.where).copy_closed(b)
                for b in expr.children]
      outputs = [self.define(s) for s in expr.outputs]
      return expr.replace(inputs=inputs, outputs=outputs, children=bodies)
    inputs = [self.read(s) for s in expr.inputs]
    children = [self.copy(c) for c in expr.children]
    outputs = [self.read(s) for s in expr.outputs]
    return expr.replace(inputs=inputs, outputs=outputs, children=children)

  def copy_closed(self, body: Mox) -> Mox:
    for s in list(body.constvars) + list(body.inputs):
      self.define(s)
    return self.copy(body).replace(
        constvars=[self.map[s] for s in body.constvars])


def inline(traced: Mox, inputs, outputs=None) -> list[Expr]:
  """The nodes of ``traced`` (the root of ``make_mox(f)(...)``), copied
  with fresh symbols to be spliced into another scope: they read
  ``inputs`` where ``traced`` reads its non-literal inputs, and its
  constants as the same symbols (whoever splices them keeps
  ``traced.constvars``/``consts`` in scope). With ``outputs``, the copies
  define those symbols where ``traced`` defines its outputs (each output
  must be computed by ``traced``, not one of its inputs)."""
  params = non_literals(traced.inputs)
  if len(params) != len(inputs):
    raise SubstitutionError(
        f'internal: a traced function of {len(params)} inputs spliced with '
        f'{len(inputs)}')
  wiring = dict(zip(params, inputs, strict=True))
  wiring.update((v, v) for v in traced.constvars)
  fixed = {}
  if outputs is not None:
    fixed = {old: new for old, new in zip(traced.outputs, outputs,
                                          strict=True)
             if not isinstance(old, Literal)}
  copier = _Copier(wiring, traced, 'a traced function', fixed)
  nodes = [copier.copy(c) for c in traced.children]
  if copier.fixed:
    raise SubstitutionError(
        f'internal: {len(copier.fixed)} outputs of a spliced function are '
        'not computed by it')
  return nodes


def describe(item) -> str:
  """How errors name one selected item: a node, a symbol or a value."""
  if isinstance(item, Mox):
    kind = item.type_name or '(ephemeral)'
    return f"module_call {kind} at path '{'/'.join(item.path) or '<root>'}'"
  if isinstance(item, Equation):
    name = f' ({item.name})' if item.name and item.name != item.prim.name else ''
    return f"equation '{item.prim.name}'{name}"
  if isinstance(item, Symbol):
    return f'a {type(item).__name__} of type {item.type_str} (a symbol)'
  text = repr(item)
  if len(text) > 80:
    text = text[:77] + '...'
  return f'a {type(item).__name__} ({text})'


def _xpath_string(text: str) -> str:
  return f"'{text}'" if '"' in text else f'"{text}"'


def _excluding(node: Expr, others=()) -> str:
  """An XPath condition true exactly for ``node``'s call site(s); with
  its method when ``others`` (the rest of the selection) holds a call of
  another method at the same path (Embed's lookup next to its attend). A
  call without a path (a head run by a nested ``Module.apply``) is named
  by its type and name at an empty path; an equation by its primitive."""
  if isinstance(node, Equation):
    return f'self::{node.prim.name}'
  if node.path:
    condition = f"@path={_xpath_string('/'.join(node.path))}"
    if node.entrypoint and any(
        o.path == node.path and o.entrypoint != node.entrypoint
        for o in others if isinstance(o, Mox)):
      condition += f' and @method={_xpath_string(node.entrypoint)}'
    return condition
  parts = [f'@type={_xpath_string(node.type_name)}'] if node.type_name else []
  if node.name:
    parts.append(f'@name={_xpath_string(node.name)}')
  parts.append('string(@path)=""')
  return ' and '.join(parts)


def leave_out_hint(problems, selection, targets=(), root=None) -> str:
  """How a refusal ends: ``selection`` with a predicate that leaves out
  the refused nodes (``problems``: ``(node, wrapped)``, wrapped for a node
  inside a LoRA call), as ONE XPath on the last line. No XPath where it
  would select nothing: every target refused, or (given the tree
  ``root``) the XPath matching no node of it."""
  nothing_left = ('No selection is suggested: every module call it matches '
                  'is refused; select other module calls.')
  refused = {id(n) for n, _ in problems}
  if targets and all(id(t) in refused for t in targets):
    return nothing_left
  conditions = list(dict.fromkeys(
      'parent::module_call[@type="LoRA"]' if wrapped else _excluding(
          n, targets) for n, wrapped in problems))
  if len(conditions) > 1:
    conditions = [f'({c})' if ' and ' in c else c for c in conditions]
  predicate = f"[not({' or '.join(conditions)})]"
  if isinstance(selection, str):
    simple = '|' not in selection and not selection.rstrip().endswith(')')
    fixed = (selection + predicate if simple
             else f'({selection}){predicate}')
    them = 'it' if len(problems) == 1 else 'them'
    if root is not None and not _selects_any(fixed, root):
      return nothing_left
    return f'Leave {them} out of the selection, e.g.:\n  {fixed}'
  fixed = f'//module_call[@type="Dense"]{predicate}'
  if root is not None and not _selects_any(fixed, root):
    return 'Leave them out of the node list.'
  return ('Leave them out of the node list, or select with an XPath such '
          f'as:\n  {fixed}')


def _selects_any(xpath: str, root: Mox) -> bool:
  from yax._src.views.query import query  # as select() imports it
  return bool(query(xpath, root))


def _describe_selection(selection) -> str:
  if isinstance(selection, str):
    return repr(selection)
  if isinstance(selection, Expr):
    return describe(selection)
  return f'[{", ".join(describe(x) for x in selection[:3])}' + (
      f', ... {len(selection)} items]' if len(selection) > 3 else ']')


@dataclasses.dataclass(frozen=True)
class Selection:
  """The nodes a rewrite replaces, checked to be exact.

  Attributes:
    targets: the selected nodes, in the order selected.
    ancestors: ``id(target)`` -> the nodes from the root down to the
      target's parent (equations and the bodies they hold included).
    description: how error messages name the selection.
  """
  root: Mox
  targets: tuple
  ancestors: dict
  description: str

  @property
  def keypaths(self) -> dict:
    """Root input symbol -> its key path in ``(args, kwargs)``."""
    return locate(self.root).keypaths

  @property
  def collections(self) -> dict:
    """Collection -> the key path prefix it sits under."""
    return locate(self.root).collections


def select(selection, mox: Mox) -> Selection:
  """XPath string, node or node list -> an exact :class:`Selection`.

  Raises ``SubstitutionError`` naming the selection and the offending item
  when it matches nothing, matches something that is not a node of ``mox``
  (a number, a string, a symbol, a node of another tree or of an older
  version of this one), selects a node twice, selects the body of an
  equation, or selects a node together with one of its ancestors.
  """
  if isinstance(selection, str):
    from yax._src.views.query import query
    found = query(selection, mox)
    if not isinstance(found, list):  # count(...), name(...), a boolean
      found = [found]
  elif isinstance(selection, Expr):
    found = [selection]
  elif isinstance(selection, (list, tuple)):
    found = list(selection)
  else:
    raise SubstitutionError(
        'a selection is an XPath string, a node or a list of nodes of the '
        f'tree; found {describe(selection)}')
  what = _describe_selection(selection if not isinstance(selection, tuple)
                             else list(selection))
  if not found:
    raise SubstitutionError(
        f'the selection {what} matched no module call or equation of the '
        'tree, so nothing would be replaced')
  for item in found:
    if not isinstance(item, Expr):
      raise SubstitutionError(
          f'the selection {what} matched {describe(item)}; a selection must '
          'match module calls or equations. End the XPath at an element, '
          'e.g. //module_call[@type="Dense"]')
  wanted = {}
  for item in found:
    if id(item) in wanted:
      raise SubstitutionError(
          f'the selection {what} holds {describe(item)} twice; select each '
          'node once')
    wanted[id(item)] = item
  ancestors, bodies = {}, set()
  stack = [(mox, ())]
  while stack:  # one walk over every node, equation bodies included
    node, above = stack.pop()
    if id(node) in wanted:
      ancestors[id(node)] = above
    inner = (*above, node)
    for child in getattr(node, 'children', ()):
      if isinstance(node, Equation):
        bodies.add(id(child))
      stack.append((child, inner))
  # A call of another method of the same module, nested in a selected call
  # of one of its methods (nn.Einsum's helper, EasyDeL's native_forward),
  # belongs to that call. A function a lifted transform applies to a module
  # (nn.scan's body, method '<lambda>') is not the module's own call: the
  # method call inside it is kept instead.
  dropped = set()
  for item in found:
    for outer in ancestors.get(id(item), ()):
      if id(outer) in wanted and _same_module_call(outer, item):
        if _is_method_call(outer):
          dropped.add(id(item))
        elif _is_method_call(item):
          dropped.add(id(outer))
  found = [item for item in found if id(item) not in dropped]
  for key in dropped:
    del wanted[key]
  for item in found:
    if id(item) not in ancestors:
      raise SubstitutionError(
          f'the selection {what} matched {describe(item)}, which is not a '
          'node of this tree (a node of another tree, or of this tree before '
          'a rewrite: rewrites return new nodes, so query the new tree)')
    if id(item) in bodies:
      raise SubstitutionError(
          f'the selection {what} matched the body of an equation '
          f'({describe(ancestors[id(item)][-1])}); select the equation itself '
          'or nodes inside its body')
    outer = next((a for a in ancestors[id(item)] if id(a) in wanted), None)
    if outer is not None:
      raise SubstitutionError(
          f'the selection {what} matched {describe(item)} together with its '
          f'ancestor {describe(outer)}; replacing the ancestor would drop the '
          'inner node. Select only one of them, e.g. add '
          '[not(ancestor::*[...])] to the XPath')
  return Selection(mox, tuple(found), ancestors, what)


def _same_module_call(outer, inner) -> bool:
  return (isinstance(outer, Mox) and isinstance(inner, Mox)
          and not outer.is_ephemeral and not inner.is_ephemeral
          and outer.path == inner.path and outer.module_ty is inner.module_ty)


def _is_method_call(node: Mox) -> bool:
  return isinstance(node.module_ty, type) and callable(
      getattr(node.module_ty, node.entrypoint or '', None))


def resolve_targets(selection, mox: Mox) -> list[Expr]:
  """XPath string or node list -> the list of nodes to substitute."""
  return list(select(selection, mox).targets)


@dataclasses.dataclass(frozen=True)
class Rewrite:
  """What a substitution did.

  Attributes:
    mox: the new tree.
    replaced: ``(target, nodes that took its place)`` per target, in the
      order the walk reached them (a kept node maps to its rebuilt self).
    added: the variables the new tree reads that the old one did not, by
      location ``(collection, *module path, *name)``, as the root's new
      inputs (outside lifted-transform bodies: e.g. stacked over the scan
      length for a variable created inside an ``nn.scan`` body).
    collections: where each variable collection sits in the root arguments:
      ``collection -> key path prefix`` (``(0, 0, 'params')`` for
      ``model.apply(variables, x)``, ``(1, 'params')`` for HF style
      ``model(x, params=p)``).
    retyped: the variables the new tree reads in another type (``retype``:
      a kernel stored quantized), by key path in the root arguments, as
      the root's new inputs (stacked, for a variable of a scan body).
  """
  mox: Mox
  replaced: tuple
  added: dict
  collections: dict
  retyped: dict = dataclasses.field(default_factory=dict)


def defined_in(node: Mox) -> list[Symbol]:
  """The symbols the equations of ``node``'s body define (its module
  calls' bodies included; not those inside bodies held by equations)."""
  return [s for eqn in leaf_equations(node) for s in eqn.outputs]


def reads_from_enclosing(node: Mox) -> list[Symbol]:
  """The symbols ``node``'s body reads that are neither its inputs nor
  computed in it, each once, in order."""
  defined = set(node.inputs)
  found: dict[Symbol, None] = {}
  for eqn in leaf_equations(node):
    for sym in eqn.inputs:
      if not isinstance(sym, Literal) and sym not in defined:
        found[sym] = None
    defined.update(eqn.outputs)
  return list(found)


def read_outside(mox: Mox, node: Mox) -> set[Symbol]:
  """The symbols that ``mox`` reads outside ``node``'s subtree, its
  outputs included. A value ``node`` computes that is read there without
  being one of its outputs is state the call updates (a Linen BatchNorm's
  new statistics under ``mutable``, an NNX Variable's new value): a
  rewrite that moves the body keeps defining it."""
  found = {s for s in mox.outputs if not isinstance(s, Literal)}
  stack = [mox]
  while stack:
    current = stack.pop()
    for child in current.children:
      if child is node:
        continue
      found.update(s for s in child.inputs if not isinstance(s, Literal))
      stack.append(child)
  return found


def read_symbols(root: Mox) -> set:
  """Every symbol some equation or call under ``root`` reads (a call's
  output that none reads is only returned: its type may change)."""
  return {s for n in iter_nodes(root) if n is not root for s in n.inputs
          if not isinstance(s, Literal)}


def collections_of(mox: Mox) -> dict:
  """Where each variable collection sits in the root arguments of ``mox``.

  ``collection -> key path prefix`` in ``(args, kwargs)``, e.g.
  ``{'params': (0, 0, 'params')}`` for ``make_mox(model.apply)(variables,
  x)``; what :attr:`Rewrite.collections` reports, without rewriting.
  """
  return dict(locate(mox).collections)


def substitute(selection, repl: Replacement, mox: Mox, *,
               retype: bool = False, inputs: dict | None = None) -> Rewrite:
  """Like :func:`sub`, but returns a :class:`Rewrite` saying what it did.
  ``retype``: a replacement keeping a node's path may store the node's own
  variables in other types (the tree then reads the new types there).
  ``inputs``: replacement input symbol -> name: such an input beyond the
  node's arguments is the root keyword argument ``name`` (one symbol for
  every site, passed into lifted-transform bodies as a loop constant),
  e.g. a PRNG key every replacement reads. A callable replacement may add
  entries to the dict before it returns its template."""
  if not isinstance(mox, Mox):
    raise SubstitutionError(f'sub expects a Mox as the tree to rewrite, found '
                            f'{type(mox).__name__}')
  from yax._src.rewrite.pattern import expand_matches  # matches -> grouped nodes
  mox, selection = expand_matches(selection, mox)
  if isinstance(selection, Selection) and selection.root is not mox:
    raise SubstitutionError(
        f'the selection {selection.description} was made on another tree')
  chosen = selection if isinstance(selection, Selection) else select(
      selection, mox)
  run = _Substitution(mox, chosen.targets, repl, retype=retype,
                      inputs=inputs)
  new = run.run()
  run.check_visits(chosen)
  return Rewrite(new, tuple(run.replaced), dict(run.added),
                 dict(run.prefix), dict(run.retyped))


def sub(selection, repl: Replacement, mox: Mox) -> Mox:
  """Replaces nodes of ``mox`` and returns a new tree.

  **Arguments:**
  - ``selection``: an XPath expression (``'//*[@name="relu"]'``) or a list of
    nodes of ``mox`` (e.g. from ``yax.query``).
  - ``repl``: a module call (``Mox``), an ``Equation``, the ephemeral root of
    ``make_mox(f)(x)`` for any function ``f`` (its body is spliced in place of
    the node), or a callable ``(path, node) -> Expr`` (returning ``node``
    keeps it).
  - ``mox``: the tree. It is never modified, nor is ``repl``.

  **Returns:** the new tree. Raises ``yax.SubstitutionError`` (and changes
  nothing) when a replacement does not fit its node.

  Example::

      gelu = yax.make_mox(jax.nn.gelu)(jnp.zeros((1, 4)))
      new = yax.sub('//*[@name="relu"]', gelu, mox)
  """
  return substitute(selection, repl, mox).mox
