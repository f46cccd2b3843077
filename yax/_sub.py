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
lists them among its inputs (and its ``var_tree``/``in_tree``), turns
ephemeral since its Flax class no longer describes it, and the root's
``in_tree`` describes the argument tree ``eval_mox`` now expects.

Nothing is mutated: on error the original tree is intact, and on success
unchanged subtrees are shared between the old and the new tree.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Sequence, Union

import jax
from jax import tree_util as jtu

from yax import _lower, _nnx, _rules
from yax._containers import set_in
from yax._errors import SubstitutionError
from yax._ir import Equation, Expr, Literal, Mox, Symbol, Var, iter_nodes

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


def _key_name(key) -> Any:
  """The dict key, attribute name or index of one step of a key path."""
  if isinstance(key, (jtu.DictKey, jtu.FlattenedIndexKey)):
    return key.key
  if isinstance(key, jtu.GetAttrKey):
    return key.name
  if isinstance(key, jtu.SequenceKey):
    return key.idx
  raise SubstitutionError(
      f'internal: a key path step of unknown kind {type(key).__name__} '
      f'({key!r}); expected DictKey, GetAttrKey, SequenceKey or '
      'FlattenedIndexKey')


# The variable group of NNX variables: an NNX model keeps all its Variables
# in one state (an ``nnx.State`` or the module itself), where Linen splits
# them into collections. A location ``('nnx', *module path, *name)`` is the
# Variable's place in that state.
NNX_GROUP = 'nnx'


def var_keys(mox: Mox) -> list[tuple]:
  """``(group, *name)`` of each variable input of a module call, Linen and
  NNX alike: ``('params', 'kernel')`` for a Linen Dense, ``('nnx',
  'kernel')`` for an NNX Linear, ``('nnx', 'lin', 'kernel')`` for a
  submodule's Variable an NNX call reads."""
  if mox.num_vars == 0:
    return []
  placeholders = jtu.tree_unflatten(mox.var_tree, range(mox.num_vars))
  keys = [tuple(str(_key_name(k)) for k in _unboxed_path(kp))
          for kp, _ in jtu.tree_flatten_with_path(placeholders)[0]]
  if isinstance(placeholders, _nnx.VariableTree):
    return [(NNX_GROUP, *k) for k in keys]
  return keys


def var_kind(mox: Mox, index: int) -> tuple[str, bool]:
  """``(kind, is_param)`` of variable input ``index``: the Linen
  collection, or the NNX Variable type (``nnx.Param`` subclasses are
  parameters)."""
  tree = jtu.tree_unflatten(mox.var_tree, [None] * mox.num_vars)
  if isinstance(tree, _nnx.VariableTree):
    return tree.kinds[index], tree.flags[index][0]
  col = var_keys(mox)[index][0]
  return col, col == 'params'


def _unboxed_path(keypath: tuple) -> tuple:
  """A key path without the ``value`` field of the box that holds the
  array (a Linen ``nn.Partitioned``, an NNX Variable)."""
  if keypath and isinstance(keypath[-1], jtu.GetAttrKey) and \
      keypath[-1].name == 'value':
    return keypath[:-1]
  return keypath


def root_keypaths(root: Mox) -> dict:
  """Root input symbol -> its key path in ``(args, kwargs)``. The value
  field of an NNX Variable is left out: the path is the Variable's."""
  placeholders = jtu.tree_unflatten(root.in_tree, range(len(root.inputs)))
  out = {}
  for keypath, i in jtu.tree_flatten_with_path(placeholders)[0]:
    out[root.inputs[i]] = tuple(_key_name(k) for k in _unboxed_path(keypath))
  return out


def _var_locs(mox: Mox) -> list[tuple[Loc, Symbol]]:
  """(location, symbol) for each variable input of a module call."""
  return [((keys[0], *mox.path, *keys[1:]), sym)
          for keys, sym in zip(var_keys(mox), mox.var_inputs, strict=True)]


def _insert(tree, keys: Sequence, value):
  """A copy of ``tree`` with ``value`` set at ``keys``; containers kept."""
  return set_in(tree, keys, value)


def _same_type(a: Symbol, b: Symbol) -> bool:
  if a.aval is None or b.aval is None:
    return a.aval is None and b.aval is None
  return (tuple(a.aval.shape) == tuple(b.aval.shape)
          and a.aval.dtype == b.aval.dtype)


def _same_nodes(new: Sequence, old: Sequence) -> bool:
  """The same nodes, in order: a splice that changes the number of children
  (a replacement with no equations, or with several) is a change."""
  return len(new) == len(old) and all(a is b for a, b in zip(new, old))


def non_literals(symbols) -> list[Symbol]:
  """The symbols that are not literals, in order."""
  return [s for s in symbols if not isinstance(s, Literal)]


@dataclasses.dataclass
class _Frame:
  """An enclosing module call being rebuilt; collects what propagates up."""
  node: Mox
  new_vars: list  # (loc, Var)
  new_args: list  # Var
  is_body: bool = False  # the body of an equation (nn.scan, nn.remat ...)
  # Constants of replacements, defined in this body (or the root).
  new_consts: list = dataclasses.field(default_factory=list)  # (Var, value)


class _Substitution:

  def __init__(self, root: Mox, targets: Sequence[Expr], repl: Replacement,
               *, retype: bool = False):
    self.root = root
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
    # NNX: the Variable type of each new variable, by location.
    self.kinds: dict[Loc, str] = {}
    # Per enclosing module call: how many sites of each replacement type.
    self.site_counts: dict[int, dict[str, int]] = {}
    self._index_root()

  # -- where variables live in the root arguments

  def _index_root(self):
    root = self.root
    self.keypaths = root_keypaths(root)
    self.locs: dict[Loc, Symbol] = {}
    self.prefix: dict[str, tuple] = {}  # collection -> root keypath prefix
    # Module calls inside bodies (nn.jit, nn.scan ...) count too: a body
    # input stands for the equation input it receives (``alias``).
    stack = [(c, {}) for c in root.children]
    # Where each collection sits: the prefix most variables agree on (the
    # root call of a nested Module.apply reads weights of another module
    # under a path of its own: it must not decide).
    votes: dict[str, collections.Counter] = {}
    all_locs: set = set()
    while stack:
      node, alias = stack.pop()
      if isinstance(node, Equation):
        for index, body in enumerate(node.children):
          outer = _rules.body_input_sources(node, index)
          inner = {b: alias.get(o, o) for b, o in zip(body.inputs, outer)}
          stack.extend((c, {**alias, **inner}) for c in body.children)
        continue
      stack.extend((c, alias) for c in node.children)
      if node.is_ephemeral:
        continue
      for loc, sym in _var_locs(node):
        all_locs.add(loc)
        keypath = self.keypaths.get(alias.get(sym, sym))
        if keypath is None:
          continue  # not read from the arguments (computed inside fn)
        if not alias:  # a symbol of the root scope
          self.locs.setdefault(loc, sym)
        tail = tuple(loc[1:])
        if len(keypath) > len(tail) and tuple(
            str(k) for k in keypath[len(keypath) - len(tail):]) == tail:
          votes.setdefault(loc[0], collections.Counter())[
              tuple(keypath[:len(keypath) - len(tail)])] += 1

    # Every module path in use: module calls and where variables sit.
    self.used_paths = {tuple(n.path) for n in iter_nodes(root)
                       if isinstance(n, Mox) and not n.is_ephemeral}
    for loc in all_locs:
      self.used_paths.update(tuple(loc[1:i]) for i in range(2, len(loc)))
    for collection, counts in votes.items():
      self.prefix[collection] = max(counts, key=lambda p: (counts[p], -len(p)))

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
    return out

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
                        module_ty=None)

  def _grow_vars(self, node: Mox, var_inputs, new_vars):
    tree = jtu.tree_unflatten(node.var_tree, var_inputs) if node.num_vars else {}
    n = len(node.path)
    if isinstance(tree, _nnx.VariableTree) or any(
        loc[0] == NNX_GROUP for loc, _ in new_vars):
      return self._grow_nnx_vars(node, var_inputs, new_vars)
    for loc, sym in new_vars:
      if tuple(loc[1:1 + n]) != node.path:
        continue  # the variable lives outside this module's scope
      tree = _insert(tree, (loc[0], *loc[1 + n:]), sym)
    leaves, var_tree = jtu.tree_flatten(tree, is_leaf=lambda x: isinstance(x, Symbol))
    return leaves, var_tree

  def _grow_nnx_vars(self, node: Mox, var_inputs, new_vars):
    """NNX: new Variables join the call's typed variable tree."""
    n = len(node.path)
    entries, leaves = [], []
    if node.num_vars:
      tree = jtu.tree_unflatten(node.var_tree, var_inputs)
      if not isinstance(tree, _nnx.VariableTree):
        raise SubstitutionError(
            f'{describe(node)} is a Linen call that runs NNX modules (a '
            'ToLinen bridge); the new variables of the NNX modules inside '
            'it cannot be added to its Linen variables yet. Trace the NNX '
            'model itself (its split form) to rewrite it')
      for keys, sym, kind, flags in zip(
          var_keys(node), var_inputs, tree.kinds, tree.flags, strict=True):
        entries.append((keys[1:], (kind, *flags)))
        leaves.append(sym)
    seen = {e[0] for e in entries}
    for loc, sym in new_vars:
      rel = tuple(loc[1 + n:])
      if loc[0] != NNX_GROUP or tuple(loc[1:1 + n]) != node.path or \
          rel in seen:
        continue
      seen.add(rel)
      kind = self.kinds.get(loc, 'Param')
      entries.append((rel, (kind, _nnx.is_param_kind(kind), len(rel) == 1)))
      leaves.append(sym)
    treedef = _nnx.variable_treedef(entries)
    order = {rel: i for i, (rel, _) in enumerate(entries)}
    flat = jtu.tree_flatten_with_path(
        jtu.tree_unflatten(treedef, range(len(entries))))[0]
    ordered = [leaves[order[tuple(str(_key_name(k)) for k in kp)]]
               for kp, _ in flat]
    return ordered, treedef

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
    for index, (body, form) in enumerate(zip(eqn.children, eqn.body_forms)):
      frame = _Frame(body, [], [], is_body=True)
      self.stack.append(frame)
      children = self.rebuild_children(body.children)
      self.stack.pop()
      if frame.new_args:
        raise SubstitutionError(
            f'the replacement inside the body of {where} needs '
            f'{len(frame.new_args)} extra arguments; inside lifted transforms '
            '(nn.scan, nn.remat, nn.jit ...) a replacement must take the '
            'arguments of the node it replaces')
      outputs = [self.rename(s) for s in body.outputs]
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
                for b, old in zip(done.bodies, bodies)]
      enclosing = next((f for f in reversed(self.stack) if f.is_body),
                       self.stack[0])
      outer_vars = []
      for key, var in done.outer:
        if isinstance(key, _rules.ConstKey):
          enclosing.new_consts.append((var, const_values[key]))
        else:
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
    return eqn.replace(inputs=inputs, children=bodies, params=dict(params))

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
      if isinstance(node, Equation) and template.num_vars:
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
      else:
        fresh = Var(sym.aval)
        wiring[sym] = fresh
        extra_args.append(fresh)

    copied = _Copier(wiring, node, _where(node, self.enclosing_path())).copy(
        template)
    old_outs = [s for s in node.outputs if not (isinstance(s, Literal) and
                                                 s.is_static)]
    new_outs = [s for s in copied.outputs if not (isinstance(s, Literal) and
                                                   s.is_static)]
    if len(old_outs) != len(new_outs):
      raise SubstitutionError(
          f'cannot substitute {_where(node, self.enclosing_path())}: it has {len(old_outs)} outputs '
          f'({", ".join(s.type_str for s in old_outs)}) but the replacement '
          f'has {len(new_outs)} ({", ".join(s.type_str for s in new_outs)})')
    for pos, (old, new) in enumerate(zip(old_outs, new_outs)):
      if not _same_type(old, new):
        raise SubstitutionError(
            f'cannot substitute {_where(node, self.enclosing_path())}: output {pos} has type '
            f'{old.type_str} but the replacement gives {new.type_str}')
    # Only now, when nothing can fail any more, record what the copy needs.
    for old, new in zip(old_outs, new_outs):
      self.ren[old] = new
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
      for keys, sym in zip(var_keys(node), node.var_inputs):
        own[keys] = self.rename(sym)
    for keys, sym in zip(var_keys(template), template.var_inputs):
      loc = (keys[0], *new_path, *keys[1:])
      existing = own.get(keys)
      body = next((f for f in reversed(self.stack) if f.is_body), None)
      if existing is None and body is not None:
        existing = dict(body.new_vars).get(loc) or dict(new_vars).get(loc)
      elif existing is None:
        existing = self.locs.get(loc) or self.added.get(loc) or dict(
            new_vars).get(loc)
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
      if keys[0] not in self.prefix:
        raise SubstitutionError(
            f"cannot substitute {_where(node, self.enclosing_path())}: the replacement needs a new "
            f"variable '{'/'.join(loc)}' but the traced arguments hold no "
            f"'{keys[0]}' collection to put it in")
      fresh = Var(sym.aval)
      wiring[sym] = fresh
      new_vars.append((loc, fresh))
      if loc[0] == NNX_GROUP:
        self.kinds[loc] = var_kind(template, template.var_inputs.index(sym))[0]

  # -- the root

  def finish_root(self, children, frame: _Frame) -> Mox:
    root = self.root
    inputs = [self.rename(s) for s in root.inputs]  # retyped variables
    in_tree = root.in_tree
    if frame.new_vars or frame.new_args:
      placeholders = jtu.tree_unflatten(in_tree, inputs)
      seen = set()
      for loc, sym in frame.new_vars:
        if loc in seen:
          continue
        seen.add(loc)
        prefix = self.prefix[loc[0]]
        value = sym
        if loc[0] == NNX_GROUP:  # a Variable of its type in the NNX state
          value = _nnx.variable_holding(self.kinds.get(loc, 'Param'), sym)
        placeholders = _insert(placeholders, (*prefix, *loc[1:]), value)
      if frame.new_args:
        args, kwargs = placeholders
        placeholders = (tuple(args) + tuple(frame.new_args), kwargs)
      inputs, in_tree = jtu.tree_flatten(
          placeholders, is_leaf=lambda x: isinstance(x, Symbol))
    outputs = [self.rename(s) for s in root.outputs]
    constvars = list(root.constvars) + [v for v, _ in frame.new_consts]
    consts = list(root.consts) + [c for _, c in frame.new_consts]
    return root.replace(inputs=inputs, outputs=outputs, children=children,
                        in_tree=in_tree, constvars=constvars, consts=consts)


def _unwrap_traced_module(root: Mox):
  """``make_mox(m.apply)(v, x)`` -> its one module call; else the root."""
  consts = list(zip(root.constvars, root.consts))
  if len(root.children) == 1 and isinstance(root.children[0], Mox):
    child = root.children[0]
    if (not child.is_ephemeral and
        set(non_literals(root.outputs)) == set(non_literals(child.outputs)) and
        set(non_literals(child.inputs)) <= set(non_literals(root.inputs))):
      return child, consts
  return root, consts


class _Copier:
  """Copies a replacement with fresh symbols, wired through ``wiring``."""

  def __init__(self, wiring: dict, node: Expr, where: str = ''):
    self.map = dict(wiring)
    self.node = node
    self.where = where or _where(node)

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
    new = Var(sym.aval, dropped=sym.dropped)
    self.map[sym] = new
    return new

  def copy(self, expr: Expr) -> Expr:
    if isinstance(expr, Equation):
      inputs = [self.read(s) for s in expr.inputs]
      # Bodies of sub-jaxprs are closed: copy them with their own symbols.
      bodies = [_Copier({}, self.node, self.where).copy_closed(b) for b in expr.children]
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


def select(selection, mox: Mox) -> Selection:
  """XPath string, node or node list -> an exact :class:`Selection`.

  Raises ``SubstitutionError`` naming the selection and the offending item
  when it matches nothing, matches something that is not a node of ``mox``
  (a number, a string, a symbol, a node of another tree or of an older
  version of this one), selects a node twice, selects the body of an
  equation, or selects a node together with one of its ancestors.
  """
  if isinstance(selection, str):
    from yax._query import query
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
  """
  mox: Mox
  replaced: tuple
  added: dict
  collections: dict


def collections_of(mox: Mox) -> dict:
  """Where each variable collection sits in the root arguments of ``mox``.

  ``collection -> key path prefix`` in ``(args, kwargs)``, e.g.
  ``{'params': (0, 0, 'params')}`` for ``make_mox(model.apply)(variables,
  x)``; what :attr:`Rewrite.collections` reports, without rewriting.
  """
  return dict(_Substitution(mox, (), None).prefix)


def substitute(selection, repl: Replacement, mox: Mox, *,
               retype: bool = False) -> Rewrite:
  """Like :func:`sub`, but returns a :class:`Rewrite` saying what it did.
  ``retype``: a replacement keeping a node's path may store the node's own
  variables in other types (the tree then reads the new types there)."""
  if not isinstance(mox, Mox):
    raise SubstitutionError(f'sub expects a Mox as the tree to rewrite, found '
                            f'{type(mox).__name__}')
  from yax._pattern import expand_matches  # matches -> grouped nodes
  mox, selection = expand_matches(selection, mox)
  if isinstance(selection, Selection) and selection.root is not mox:
    raise SubstitutionError(
        f'the selection {selection.description} was made on another tree')
  chosen = selection if isinstance(selection, Selection) else select(
      selection, mox)
  run = _Substitution(mox, chosen.targets, repl, retype=retype)
  new = run.run()
  run.check_visits(chosen)
  return Rewrite(new, tuple(run.replaced), dict(run.added),
                 dict(run.prefix))


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
