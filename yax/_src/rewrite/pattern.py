"""Pattern rewrites: find the equations that compute a function, group them.

JAX inlines many helpers into the module that calls them (``nn.gelu`` is a
handful of ``mul``/``erfc`` equations inside ``FlaxBertIntermediate``), so
they are not nodes that XPath can select. A *pattern* finds them by data
flow, much as torch.fx's ``replace_pattern`` does for PyTorch graphs.

How matching works:

1. The pattern (a Python function on arrays) is traced with ``make_mox`` at a
   probe shape. Its *anchor* is its equation whose primitive is rarest in the
   searched tree (``erfc`` for the exact GELU).
2. For every tree equation with the anchor's primitive (in evaluation order),
   the pattern's data flow is walked from the anchor: the producer of a
   bound value is unique; the consumers of a bound value are the candidates
   for an equation that reads it. This *loose* walk compares primitives and
   the places of literals only, and yields the tree values that play the
   pattern's inputs, hence their shapes and dtypes. When no trace known so
   far walks loosely from a candidate, the pattern is traced at the probe
   shape in each dtype found around the candidate (its anchor's dtypes
   first): JAX traces a bfloat16/float16 softmax or norm through float32
   upcasts, with ``convert_element_type`` equations the float32 probe lacks.
3. The pattern is traced again at exactly those shapes and dtypes (cached
   per signature) and walked again, now comparing params, literals, shapes
   and dtypes. A match must also be *closed*: no value computed inside it is
   read outside it, except its outputs; and *convex*: no node outside it
   both depends on one of its outputs and feeds one of its inputs, where a
   module call reads also what its body reads through closed-over values,
   and each earlier match counts as one node (so the matches returned can
   all be grouped: none reads another's output in a cycle).

Matches never overlap; earlier ones (by the anchor's place in evaluation
order) win. A match lives in one body: the children of one module call (or of
a ``scan``/``checkpoint`` body held in ``Equation.children``), never across
a ``module_call`` boundary.
"""

from __future__ import annotations

import inspect
import itertools
import math
import warnings
import weakref
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jex

from yax._src.errors import PatternError, SubstitutionError, XPathError
from yax._src.ir.nodes import (Equation, Expr, Literal, Mox, Symbol,
                               leaf_equations)
from yax._src.ir.variables import leaf_keypaths
from yax._src.trace.make import opened

__all__ = ['Match', 'match', 'group', 'explain_match', 'trace_like']


# ------------------------------------------------------------------ Match

class Match:
  """One occurrence of a pattern in a tree.

  Attributes:
    equations: the tree's own :class:`~yax.Equation` objects, in evaluation
      order.
    inputs: the tree symbols that play the pattern's inputs (in the
      pattern's argument order).
    outputs: the tree symbols that play the pattern's outputs.
    path: the module path of the module call whose body holds the match.
  """

  __slots__ = ('equations', 'inputs', 'outputs', 'path', '_body')

  def __init__(self, equations, inputs, outputs, path, body):
    self.equations = list(equations)
    self.inputs = list(inputs)
    self.outputs = list(outputs)
    self.path = tuple(path)
    self._body = body  # the Mox whose children hold the equations

  def __repr__(self):
    prims = ', '.join(e.prim.name for e in self.equations)
    where = '/'.join(self.path) or '<root>'
    ins = ', '.join(s.type_str for s in self.inputs)
    outs = ', '.join(s.type_str for s in self.outputs)
    return f'Match(at {where}: ({ins}) -> ({outs}) via [{prims}])'


# ------------------------------------------------------------- the tree

class _Index:
  """Producers, consumers, readers and bodies of a tree, built once."""

  def __init__(self, root: Mox):
    self.root = root
    self.order: dict[int, int] = {}      # id(node) -> pre-order position
    self.body_of: dict[int, Mox] = {}    # id(equation) -> its body
    self.path_of: dict[int, tuple] = {}  # id(body) -> enclosing module path
    self.producer: dict[Symbol, Equation] = {}
    self.consumers: dict[Symbol, list[tuple[Equation, int]]] = {}
    self.readers: dict[Symbol, list[Expr]] = {}
    self.consts: dict[Symbol, Any] = {}
    self.bodies: list[Mox] = []
    # id(node) -> the node whose children hold it (a body or module call
    # for a child; the equation for a body it holds), for top_child.
    self.parent: dict[int, Expr] = {}
    self._positions: dict[int, dict[int, int]] = {}
    counter = itertools.count()

    def add_reader(sym, node):
      if not isinstance(sym, Literal):
        self.readers.setdefault(sym, []).append(node)

    def visit_body(body: Mox, path: tuple):
      self.bodies.append(body)
      self.path_of[id(body)] = path
      self.order[id(body)] = next(counter)
      for sym, value in zip(body.constvars, body.consts, strict=True):
        self.consts[sym] = value
      for child in body.children:
        self.parent[id(child)] = body
        if isinstance(child, Mox):
          for sym in child.inputs:
            add_reader(sym, child)
          visit_body(child, child.path)
          continue
        self.order[id(child)] = next(counter)
        self.body_of[id(child)] = body
        for i, sym in enumerate(child.inputs):
          add_reader(sym, child)
          if not isinstance(sym, Literal):
            self.consumers.setdefault(sym, []).append((child, i))
        for sym in child.outputs:
          self.producer[sym] = child
        for inner in bodies_of(child):
          self.parent[id(inner)] = child
          visit_body(inner, path)
      for sym in body.outputs:
        add_reader(sym, body)

    visit_body(root, root.path)

  def top_child(self, node: Expr, body: Mox) -> Expr | None:
    """The child of ``body`` that is or holds ``node`` (a reader found
    inside a module call of the body, e.g. one that reads a value of the
    body through a closed-over field); None when ``node`` is not under
    ``body`` (or is ``body`` itself)."""
    while node is not body:
      parent = self.parent.get(id(node))
      if parent is None:
        return None
      if parent is body:
        return node
      node = parent
    return None

  def positions(self, body: Mox) -> dict[int, int]:
    """``id(child) -> its place`` among the children of ``body``."""
    pos = self._positions.get(id(body))
    if pos is None:
      pos = self._positions[id(body)] = {
          id(c): i for i, c in enumerate(body.children)}
    return pos

  def equations_in(self, bodies) -> list[Equation]:
    out = []
    for body in bodies:
      out.extend(c for c in body.children if isinstance(c, Equation))
    out.sort(key=lambda e: self.order[id(e)])
    return out


def _bodies_under(nodes: Sequence[Mox]) -> list[Mox]:
  """Every body under the given module calls: theirs and nested ones."""
  out, seen = [], set()
  stack = list(reversed(nodes))
  while stack:
    node = stack.pop()
    if id(node) in seen:
      continue
    seen.add(id(node))
    out.append(node)
    for child in reversed(node.children):
      if isinstance(child, Mox):
        stack.append(child)
      else:
        stack.extend(reversed(bodies_of(child)))
  return out


def bodies_of(eqn: Equation) -> list[Mox]:
  """The bodies a match may lie in: ``eqn.children``, or for an equation
  whose Jaxpr parameters call no module (a ``jit``-ed helper, a
  ``shard_map``), those Jaxprs built as bodies (``_make.opened``)."""
  if eqn.children:
    return eqn.children
  holder = opened(eqn)
  return holder.children if holder is not None else []


# ------------------------------------------------------- the pattern

def _is_static(sym: Symbol) -> bool:
  return isinstance(sym, Literal) and sym.is_static


def _avals_key(avals) -> tuple:
  return tuple((tuple(a.shape), np.dtype(a.dtype).name,
                bool(getattr(a, 'weak_type', False))) for a in avals)


class _Trace:
  """A traced pattern: its equations and the data flow between them."""

  def __init__(self, mox: Mox, what: str):
    self.mox = mox
    self.eqns: list[Equation] = list(leaf_equations(mox))
    self.inputs = [s for s in mox.inputs if not _is_static(s)]
    self.outputs = [s for s in mox.outputs if not _is_static(s)]
    self.consts = dict(zip(mox.constvars, mox.consts, strict=True))
    self.producer: dict[Symbol, int] = {}
    for i, eqn in enumerate(self.eqns):
      for sym in eqn.outputs:
        self.producer[sym] = i
    self.index_of = {id(e): i for i, e in enumerate(self.eqns)}
    self._plans: dict[int, list] = {}
    self._validate(what)

  def _validate(self, what: str):
    if not self.eqns:
      raise PatternError(
          f'{what} computes nothing (it has no equations); a pattern must '
          'apply at least one JAX primitive to its inputs')
    for pos, sym in enumerate(self.outputs):
      if isinstance(sym, Literal) or sym not in self.producer:
        kind = ('a constant' if isinstance(sym, Literal) or sym in self.consts
                else 'one of its inputs')
        raise PatternError(
            f'output {pos} of {what} is {kind}, not a value it computes; a '
            'pattern must compute each of its outputs')
    read = {s for e in self.eqns for s in e.inputs}
    for pos, sym in enumerate(self.inputs):
      if sym not in read:
        raise PatternError(
            f'input {pos} of {what} is not read by any of its equations; a '
            'pattern must use each of its inputs')
    for e in self.eqns:
      if any(_calls_modules(b) for b in e.children):
        raise PatternError(
            f'{what} contains a {e.prim.name} equation whose body calls Flax '
            'modules; patterns are plain functions on arrays')
    # Connected (refused here, before any search: a tree with no candidate
    # for its anchor would never plan a walk).
    self.plan(0)

  def signature(self) -> tuple:
    return _avals_key([s.aval for s in self.inputs])

  def plan(self, anchor: int) -> list[tuple]:
    """The order in which to visit pattern equations, from the anchor.

    Each step is ``('prod', eqn, sym)`` (the equation producing an already
    bound value: unique in the tree) or ``('cons', eqn, sym, k)`` (an
    equation reading an already bound value as its input ``k``: one of that
    value's consumers). Producers come first, since they do not branch.
    """
    steps = self._plans.get(anchor)
    if steps is not None:
      return steps
    steps = []
    visited = {anchor}
    bound = set(_vars(self.eqns[anchor].inputs) + _vars(self.eqns[anchor].outputs))
    while len(visited) < len(self.eqns):
      step = None
      for i, e in enumerate(self.eqns):
        if i not in visited:
          sym = next((s for s in e.outputs if s in bound), None)
          if sym is not None:
            step = ('prod', i, sym)
            break
      if step is None:
        for i, e in enumerate(self.eqns):
          if i not in visited:
            k = next((k for k, s in enumerate(e.inputs)
                      if not isinstance(s, Literal) and s in bound), None)
            if k is not None:
              step = ('cons', i, e.inputs[k], k)
              break
      if step is None:
        raise PatternError(
            'the pattern is not connected: some of its equations share no '
            'value (input or intermediate) with the others; match each part '
            'separately')
      steps.append(step)
      visited.add(step[1])
      e = self.eqns[step[1]]
      bound.update(_vars(e.inputs) + _vars(e.outputs))
    self._plans[anchor] = steps
    return steps


def _vars(symbols) -> list[Symbol]:
  return [s for s in symbols if not isinstance(s, Literal)]


_PROBE_SHAPES = ((), (4,), (4, 4), (2, 4, 4))


def _positional_arity(fn) -> int | None:
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return None
  n = 0
  for p in sig.parameters.values():
    if p.kind is p.VAR_POSITIONAL:
      return None
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and \
        p.default is p.empty:
      n += 1
  return n


# Traces of callable patterns, per function and input signature.
_TRACE_CACHE: 'weakref.WeakKeyDictionary[Any, dict]' = weakref.WeakKeyDictionary()


class _Pattern:
  """A pattern: a fixed traced ``Mox`` or a function traced per signature."""

  def __init__(self, pattern):
    self.fn = None
    if isinstance(pattern, Mox):
      self.fixed = _Trace(pattern, 'the pattern')
      self.probes = [self.fixed]
      return
    if not callable(pattern) or isinstance(pattern, Expr):
      raise PatternError(
          'a pattern must be a function on arrays or a traced Mox (from '
          f'yax.make_mox); found {type(pattern).__name__}')
    self.fixed = None
    self.fn = pattern
    try:
      self.cache = _TRACE_CACHE.setdefault(pattern, {})
    except TypeError:  # not weakly referenceable
      self.cache = {}
    self._dtype_probes: dict[str, _Trace | None] = {}
    # dtype name -> why the pattern cannot be traced with inputs of it.
    self.dtype_failures: dict[str, str] = {}
    self.probe_shape = None
    self.arity = _positional_arity(pattern)
    if self.arity is None:
      raise PatternError(
          f'cannot tell how many arrays the pattern {_fn_name(pattern)} takes '
          '(it takes *args or has no signature); pass a function with named '
          'parameters, or a pattern traced with yax.make_mox')
    if self.arity == 0:
      raise PatternError(f'the pattern {_fn_name(pattern)} takes no arrays')
    self.probes = [self._probe()]

  def _probe(self) -> _Trace:
    errors = []
    for shape in _PROBE_SHAPES:
      args = [jax.ShapeDtypeStruct(shape, np.float32)] * self.arity
      try:
        trace = self.at([a for a in args])
        self.probe_shape = shape
        self._dtype_probes[np.dtype(np.float32).name] = trace
        return trace
      except PatternError:
        raise
      except Exception as e:  # noqa: BLE001 - try the next probe shape
        errors.append(f'{shape}: {type(e).__name__}: {e}')
    raise PatternError(
        f'cannot trace the pattern {_fn_name(self.fn)} at any probe shape '
        '(float32 arrays of shapes ' + ', '.join(map(str, _PROBE_SHAPES)) +
        '); trace it yourself with yax.make_mox at the shapes you want and '
        'pass the traced Mox.\n  ' + '\n  '.join(errors))

  def at(self, avals) -> _Trace:
    """The pattern traced at these input shapes and dtypes (cached)."""
    if self.fixed is not None:
      return self.fixed
    key = _avals_key(avals)
    trace = self.cache.get(key)
    if trace is None:
      from yax._src.trace.make import make_mox
      args = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype,
                                   weak_type=bool(getattr(a, 'weak_type', False)))
              for a in avals]
      mox = make_mox(self.fn)(*args)
      trace = self.cache[key] = _Trace(
          mox, f'the pattern {_fn_name(self.fn)}')
    return trace

  def probe_at_dtype(self, dtype) -> _Trace | None:
    """The pattern traced at the probe shape with every input of ``dtype``
    (cached); None when it cannot be traced so.

    JAX traces some functions differently per dtype (a bfloat16 softmax or
    norm goes through float32 upcasts: extra ``convert_element_type``
    equations), so the float32 probe alone cannot find their half-precision
    occurrences in the loose walk.
    """
    if self.fixed is not None:
      return None
    try:
      name = np.dtype(dtype).name
    except TypeError:
      return None
    if name in self._dtype_probes:
      return self._dtype_probes[name]
    trace = None
    try:
      # A probe at a dtype the pattern was not written for (softmax's -inf
      # literal cast to int32) may warn; the probe is YAX's, not the user's.
      with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        trace = self.at([jax.ShapeDtypeStruct(self.probe_shape, dtype)]
                        * self.arity)
    except Exception as e:  # noqa: BLE001 - kept as the reason, see below
      # Named case: a pattern that cannot be traced with inputs of
      # ``dtype`` at the probe shape, where it was traced at float32 (a
      # softmax at int32: its -inf literal; a key dtype), has no
      # occurrence whose inputs are of that dtype, as the model's own code
      # would fail the same way. No trace: nothing matches at that dtype,
      # and ``explain_match`` gives this reason.
      trace = None
      self.dtype_failures[name] = f'{type(e).__name__}: {e}'
    self._dtype_probes[name] = trace
    return trace

  def traces(self) -> list[_Trace]:
    """Known traces, newest first: each is tried for the loose walk."""
    if self.fixed is not None:
      return [self.fixed]
    return list(reversed(list(self.cache.values())))


def _fn_name(fn) -> str:
  return getattr(fn, '__qualname__', None) or getattr(fn, '__name__', None) \
      or repr(fn)


# ---------------------------------------------------- param comparison

def _jaxpr_text(j, memo) -> str:
  key = id(j)
  text = memo.get(key)
  if text is None:
    text = memo[key] = str(j)
  return text


def _same_value(a, b, memo) -> bool:
  """Structural equality of equation params (Jaxprs by text)."""
  if a is b:
    return True
  if isinstance(a, (jex.Jaxpr, jex.ClosedJaxpr)) or isinstance(
      b, (jex.Jaxpr, jex.ClosedJaxpr)):
    if type(a) is not type(b):
      return False
    if _jaxpr_text(a, memo) != _jaxpr_text(b, memo):
      return False
    if isinstance(a, jex.ClosedJaxpr):
      return len(a.consts) == len(b.consts) and all(
          _same_array(x, y) for x, y in zip(a.consts, b.consts, strict=True))
    return True
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return (type(a) is type(b) and len(a) == len(b)
            and all(_same_value(x, y, memo) for x, y in zip(a, b, strict=True)))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(
        _same_value(a[k], b[k], memo) for k in a)
  if isinstance(a, (np.ndarray, jax.Array)) or isinstance(
      b, (np.ndarray, jax.Array)):
    return _same_array(a, b)
  if _is_function(a) and _is_function(b):
    # Derivative rules and thunks (custom_jvp's jvp, custom_vjp's fwd/bwd)
    # are new function objects on every trace and cannot be compared; the
    # primal computation (``call_jaxpr``) and the equation name are.
    return True
  try:
    return bool(a == b)
  except Exception:  # noqa: BLE001 - incomparable values differ
    return False


def _calls_modules(body: Mox, memo=None) -> bool:
  """Whether a body held by an equation contains a module call."""
  key = ('modules', id(body))
  if memo is not None and key in memo:
    return memo[key]
  found = False
  stack = list(body.children)
  while stack and not found:
    node = stack.pop()
    found = isinstance(node, Mox)
    stack.extend(node.children)
  if memo is not None:
    memo[key] = found
  return found


def _body_text(body: Mox, memo) -> str:
  """A body held by an equation, compared by its printed Jaxpr."""
  key = ('body', id(body))
  text = memo.get(key)
  if text is None:
    text = memo[key] = str(body)
  return text


def _is_function(x) -> bool:
  """A function object, or JAX's wrapper of one (``lu.WrappedFun``)."""
  return (callable(x) and not isinstance(x, type)) or hasattr(x, 'call_wrapped')


def _same_array(a, b) -> bool:
  try:
    a, b = np.asarray(a), np.asarray(b)
  except Exception:  # noqa: BLE001
    return False
  return a.shape == b.shape and a.dtype == b.dtype and bool(
      np.array_equal(a, b, equal_nan=a.dtype.kind in 'fc'))


def _param_diff(pe: Equation, te: Equation, memo) -> str | None:
  if pe.params.keys() != te.params.keys():
    return (f'params differ: pattern has {sorted(pe.params)}, tree has '
            f'{sorted(te.params)}')
  for key in pe.params:
    if not _same_value(pe.params[key], te.params[key], memo):
      return (f'param {key!r} differs: pattern has '
              f'{_short(pe.params[key])}, tree has {_short(te.params[key])}')
  if pe.name != te.name:
    return f'function name differs: pattern has {pe.name!r}, tree has {te.name!r}'
  return None


def _short(value) -> str:
  text = repr(value) if not isinstance(value, (jex.Jaxpr, jex.ClosedJaxpr)) \
      else str(value)
  text = ' '.join(text.split())
  return text if len(text) <= 120 else text[:117] + '...'


# --------------------------------------------------------------- search

class _Failure(Exception):
  pass


class _Search:
  """Backtracking walk of one pattern trace from one anchor pair.

  ``exact=False`` (the loose walk) compares primitives and where literals
  are; ``exact=True`` compares params, literal values, shapes and dtypes,
  and checks that the match is closed and convex.
  """

  def __init__(self, trace: _Trace, index: _Index, used: set, exact: bool,
               memo: dict, groups: dict | None = None):
    self.t = trace
    self.ix = index
    self.used = used
    self.groups = groups  # earlier matches, see _convexity
    self.exact = exact
    self.memo = memo
    self.best: tuple[int, str] = (-1, '')  # deepest failure, for explain

  def fail(self, depth: int, reason: str):
    if depth >= self.best[0]:
      self.best = (depth, reason)
    return None

  def run(self, anchor: int, te: Equation):
    self.body = self.ix.body_of.get(id(te))
    steps = self.t.plan(anchor)
    env: dict[Symbol, Symbol] = {}
    eqmap: dict[int, Equation] = {}
    if not self.unify(anchor, te, env, eqmap, 0):
      return None
    return self.walk(steps, 0, env, eqmap)

  def walk(self, steps, i, env, eqmap):
    if i == len(steps):
      return self.finish(env, eqmap)
    step = steps[i]
    pidx, psym = step[1], step[2]
    pe = self.t.eqns[pidx]
    tsym = env[psym]
    if step[0] == 'prod':
      te = self.ix.producer.get(tsym)
      if te is None:
        where = ('an input of the body' if not isinstance(tsym, Literal)
                 else f'the literal {tsym.value!r}')
        return self.fail(len(eqmap), (
            f'the pattern computes {_pdesc(self.t, pidx)} but in the tree '
            f'that value is {where}'))
      cands = [te]
    else:
      k = step[3]
      cands = [e for e, j in self.ix.consumers.get(tsym, ()) if j == k
               and e.prim.name == pe.prim.name]
      if not cands:
        return self.fail(len(eqmap), (
            f'no {pe.prim.name} equation reads the tree value that plays '
            f'{_psym(self.t, psym)} as input {k}, as '
            f'{_pdesc(self.t, pidx)} does'))
    for te in cands:
      env2, eqmap2 = dict(env), dict(eqmap)
      if self.unify(pidx, te, env2, eqmap2, len(eqmap)):
        found = self.walk(steps, i + 1, env2, eqmap2)
        if found is not None:
          return found
    return None

  def unify(self, pidx, te, env, eqmap, depth) -> bool:
    pe = self.t.eqns[pidx]
    fail = lambda why: self.fail(depth, f'{_pdesc(self.t, pidx)} vs tree '
                                 f'{_tdesc(te)}: {why}')
    if id(te) in self.used:
      return fail('that equation is part of an earlier match') or False
    if any(e is te for e in eqmap.values()):
      return fail('that equation already plays another pattern equation') \
          or False
    if self.ix.body_of.get(id(te)) is not self.body:
      return fail('it is in another body (a match never crosses a '
                  'module_call boundary)') or False
    if pe.prim.name != te.prim.name:
      return fail(f'primitive differs (pattern {pe.prim.name}, tree '
                  f'{te.prim.name})') or False
    if len(pe.children) != len(te.children) or any(
        _calls_modules(b, self.memo) for b in te.children):
      return fail('its body calls Flax modules') or False
    if self.exact and any(
        _body_text(a, self.memo) != _body_text(b, self.memo)
        for a, b in zip(pe.children, te.children, strict=True)):
      return fail('the bodies it holds differ') or False
    if len(pe.inputs) != len(te.inputs) or len(pe.outputs) != len(te.outputs):
      return fail(f'{len(pe.inputs)} inputs/{len(pe.outputs)} outputs in the '
                  f'pattern, {len(te.inputs)}/{len(te.outputs)} in the tree') \
          or False
    if self.exact:
      diff = _param_diff(pe, te, self.memo)
      if diff:
        return fail(diff) or False
    for k, (p, t) in enumerate(zip(pe.inputs, te.inputs, strict=True)):
      why = self.bind_input(p, t, env)
      if why:
        return fail(f'input {k}: {why}') or False
    for k, (p, t) in enumerate(zip(pe.outputs, te.outputs, strict=True)):
      if p in env and env[p] is not t:
        return fail(f'output {k} is not the value the rest of the pattern '
                    'reads there') or False
      if self.exact and not _same_aval(p, t):
        return fail(f'output {k} has type {t.type_str}, the pattern '
                    f'{p.type_str}') or False
      env[p] = t
    eqmap[pidx] = te
    return True

  def bind_input(self, p: Symbol, t: Symbol, env) -> str | None:
    if isinstance(p, Literal):
      if not isinstance(t, Literal):
        return (f'the pattern has the literal {_lit(p)} here, the tree a '
                f'computed value ({t.type_str})')
      if self.exact and not (_same_array(p.value, t.value)
                             and _same_aval(p, t)):
        return f'literal differs (pattern {_lit(p)}, tree {_lit(t)})'
      return None
    if p in self.t.consts:
      value = t.value if isinstance(t, Literal) else self.ix.consts.get(t)
      if value is None or (self.exact and not _same_array(
          self.t.consts[p], value)):
        return (f'the pattern reads a constant '
                f'({_short(self.t.consts[p])}) here, the tree '
                f'{_short(value) if value is not None else "a computed value"}')
      return None
    if isinstance(t, Literal):
      return (f'the pattern reads a value here, the tree the literal {_lit(t)} '
              '(pattern inputs stand for computed values, not literals)')
    if p in env and env[p] is not t:
      return (f'{_psym(self.t, p)} is already played by another tree value '
              f'(the pattern reads one value where the tree reads two)')
    if self.exact and not _same_aval(p, t):
      return f'type differs (pattern {p.type_str}, tree {t.type_str})'
    env[p] = t
    return None

  def finish(self, env, eqmap):
    t, ix = self.t, self.ix
    depth = len(eqmap)
    matched = {id(e) for e in eqmap.values()}
    outs = {env[s] for s in t.outputs}
    for pos, p in enumerate(t.inputs):
      sym = env.get(p)
      if sym is None:
        return self.fail(depth, f'input {pos} of the pattern is not bound')
      prod = ix.producer.get(sym)
      if prod is not None and id(prod) in matched:
        return self.fail(depth, (
            f'input {pos} of the pattern would be computed inside the match'))
    if not self.exact:
      return env, eqmap
    for e in eqmap.values():
      for sym in e.outputs:
        if sym in outs:
          continue
        for reader in ix.readers.get(sym, ()):
          if id(reader) not in matched:
            return self.fail(depth, (
                f'the value {sym.type_str} computed by {_tdesc(e)} inside '
                f'the match is also read by {_reader_desc(reader, self.body)}, so '
                'the match would not be closed (only outputs may escape)'))
    why = _convexity(self.body, matched, ix, self.groups)
    if why:
      return self.fail(depth, why)
    return env, eqmap


def _same_aval(p: Symbol, t: Symbol) -> bool:
  a, b = p.aval, t.aval
  if a is None or b is None:
    return a is None and b is None
  return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def _lit(sym: Literal) -> str:
  try:
    value = np.asarray(sym.value)
    text = repr(value.item()) if value.ndim == 0 else _short(value.tolist())
  except Exception:  # noqa: BLE001 - an odd literal: its repr
    text = _short(sym.value)
  return f'{text}:{sym.type_str}'


def _pdesc(trace: _Trace, i: int) -> str:
  e = trace.eqns[i]
  return f'pattern equation {i} ({e.prim.name})'


def _psym(trace: _Trace, sym: Symbol) -> str:
  if sym in trace.inputs:
    return f'pattern input {trace.inputs.index(sym)}'
  return f'a pattern value ({sym.type_str})'


def _tdesc(e: Equation) -> str:
  ins = ', '.join(s.type_str if not isinstance(s, Literal) else _lit(s)
                  for s in e.inputs)
  return f'{e.prim.name}({ins})'


def _reader_desc(reader, body: Mox) -> str:
  if isinstance(reader, Equation):
    return f'the equation {_tdesc(reader)}'
  if reader is body:
    return 'an output of the enclosing body'
  return f"the module call at '{'/'.join(reader.path) or '<root>'}'"


def _convexity(body: Mox, matched: set, ix: _Index,
               groups: dict | None = None) -> str | None:
  """Why the matched equations cannot become one node, or None.

  They cannot when some node of the body outside them depends on one of
  their outputs and feeds one of them: grouping would make a cycle. A node
  reads what its inputs name and, for a module call, whatever its body
  reads from outside it (a closed-over value). ``groups`` maps ``id`` of
  each equation of an earlier accepted match (in any body) to that match's
  outputs: an earlier match becomes one node too, so reaching any of its
  equations reaches all its outputs (two matches that read each other's
  outputs would group into a cycle).
  """
  groups = groups or {}
  pos = ix.positions(body)
  # A node after the match's last equation feeds none of it (a body is in
  # evaluation order); an earlier match may still, through an output made
  # before that point, so it is followed whatever its place.
  last = max(pos[i] for i in matched if i in pos)
  frontier = [s for c in body.children if id(c) in matched for s in c.outputs]
  seen_nodes: set[int] = set()
  seen_syms: set = set(frontier)
  while frontier:
    sym = frontier.pop()
    for reader in ix.readers.get(sym, ()):
      top = ix.top_child(reader, body)
      if top is None or id(top) in matched:
        continue
      key = id(top)
      outs = top.outputs
      group = groups.get(key)
      if group is not None:
        key, outs = id(group), group
      elif pos.get(key, last) > last:
        continue
      if key in seen_nodes:
        continue
      seen_nodes.add(key)
      for out in outs:
        for r in ix.readers.get(out, ()):
          t = ix.top_child(r, body)
          if t is not None and id(t) in matched:
            what = (_node_desc(top) if group is None else
                    f'an earlier match (at {_node_desc(top)})')
            return (f'{what} depends on an output of the match and feeds '
                    'one of its inputs, so the match cannot be one node')
        if out not in seen_syms:
          seen_syms.add(out)
          frontier.append(out)
  return None


def _node_desc(node) -> str:
  if isinstance(node, Equation):
    return f'the equation {_tdesc(node)}'
  return f"the module call at '{'/'.join(node.path) or '<root>'}'"


# ---------------------------------------------------------------- match

class WithinXPathError(PatternError, XPathError):
  """``within=`` is an XPath expression that does not compile or evaluate:
  both a :class:`PatternError` (a bad ``within``) and an
  :class:`XPathError` (a bad expression)."""


def _short_repr(value) -> str:
  try:
    text = repr(value)
  except Exception:  # noqa: BLE001 - an object whose repr fails
    text = f'<{type(value).__name__} object>'
  text = ' '.join(text.split())
  return text if len(text) <= 120 else text[:117] + '...'


def _a(value) -> str:
  name = type(value).__name__
  return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _searched_bodies(mox: Mox, within, index: _Index) -> list[Mox]:
  """The bodies that ``within=`` selects: module calls of this tree (given
  as an XPath expression, a node, or an iterable of nodes) and every body
  under them. Anything else raises ``PatternError`` naming what was
  selected."""
  if within is None:
    return index.bodies
  what = _short_repr(within)
  if isinstance(within, str):
    from yax._src.views.query import query
    try:
      nodes = query(within, mox)
    except XPathError as e:
      raise WithinXPathError(
          f'within= selects module calls, but {what} is not a usable XPath '
          f'expression: {e}') from e
    if not isinstance(nodes, list):
      raise PatternError(
          f'within= selects module calls, but {what} evaluates to '
          f'the {type(nodes).__name__} {_short_repr(nodes)}, not to nodes; '
          'end the XPath at a module_call element')
  elif isinstance(within, Expr):
    nodes = [within]
  elif isinstance(within, (bytes, bytearray, dict)) or not hasattr(
      within, '__iter__'):
    raise PatternError(
        f'within= selects module calls (an XPath expression, a Mox or a '
        f'list of them), but found {_a(within)}: {what}')
  else:
    try:
      nodes = list(within)
    except Exception as e:  # noqa: BLE001 - an iterable that fails
      raise PatternError(
          f'within= selects module calls, but iterating {what} failed: '
          f'{type(e).__name__}: {e}') from e
  if not nodes:
    raise PatternError(
        f'within= selects module calls, but {what} selected nothing; it '
        'must select the module calls of the tree to search in')
  calls, seen = [], set()
  for node in nodes:
    if not isinstance(node, Mox):
      raise PatternError(
          f'within= selects module calls, but {what} selected {_a(node)} '
          f'({_short_repr(node)}); end the XPath at a module_call element')
    if index.path_of.get(id(node)) is None and node is not index.root:
      raise PatternError(
          f'within= selects module calls of this tree, but {what} selected '
          f'{_short_repr(node)}, which is not a module call of this tree '
          '(of another tree, or of an older version of this one); select '
          'it in this tree')
    if id(node) not in seen:
      seen.add(id(node))
      calls.append(node)
  return _bodies_under(calls)


def _anchor(trace: _Trace, counts: dict) -> int:
  best = None
  for i, e in enumerate(trace.eqns):
    key = (counts.get(e.prim.name, 0), -i)
    if best is None or key < best[0]:
      best = (key, i)
  return best[1]


class _Matcher:
  def __init__(self, pattern, mox: Mox, within=None):
    if not isinstance(mox, Mox):
      raise PatternError(f'match expects a Mox as the tree, found '
                         f'{type(mox).__name__}')
    self.pattern = pattern if isinstance(pattern, _Pattern) else _Pattern(pattern)
    self.mox = mox
    self.ix = _Index(mox)
    self.bodies = _searched_bodies(mox, within, self.ix)
    self.body_ids = {id(b) for b in self.bodies}
    self.memo: dict = {}
    self.by_prim: dict[str, list[Equation]] = {}
    for e in self.ix.equations_in(self.bodies):
      self.by_prim.setdefault(e.prim.name, []).append(e)
    self.counts = {k: len(v) for k, v in self.by_prim.items()}
    # id(equation) -> outputs of the accepted match holding it: a later
    # match must stay groupable together with the earlier ones.
    self.groups: dict[int, list[Symbol]] = {}

  def _candidate_dtypes(self, te: Equation) -> list:
    """Dtypes to probe the pattern at for a candidate anchored at ``te``:
    those of the anchor's own values first, then every other dtype of the
    values in the body that holds it."""
    body = self.ix.body_of.get(id(te))
    key = ('dtypes', id(body))
    rest = self.memo.get(key)
    if rest is None:
      rest = []
      for e in (body.children if body is not None else ()):
        if isinstance(e, Equation):
          for s in (*e.inputs, *e.outputs):
            if s.aval is not None and hasattr(s.aval, 'dtype'):
              rest.append(s.aval.dtype)
      self.memo[key] = rest
    out, seen = [], set()
    for s in (*te.inputs, *te.outputs, None):
      dt = getattr(getattr(s, 'aval', None), 'dtype', None) if s is not None \
          else None
      for d in ([dt] if s is not None else rest):
        if d is None:
          continue
        try:
          name = np.dtype(d).name
        except TypeError:
          continue
        if name not in seen:
          seen.add(name)
          out.append(d)
    return out

  def loose(self, te: Equation, used: set, explain=None):
    """Input avals of a candidate anchored at ``te``, from any known trace,
    then from the pattern traced at the dtypes found around ``te``."""
    known = self.pattern.traces()
    tried = known + [p for p in self.pattern.probes if p not in known]
    found = self._loose_with(tried, te, used, explain)
    if found is not None or self.pattern.fixed is not None:
      return found
    own = {str(getattr(s.aval, 'dtype', None)) for s in te.inputs}
    for dtype in self._candidate_dtypes(te):
      trace = self.pattern.probe_at_dtype(dtype)
      name = np.dtype(dtype).name
      if trace is None and explain is not None and \
          name in self.pattern.dtype_failures:
        # First among the reasons where the equation reads that dtype.
        explain.append((math.inf if name in own else 0,
                        f'the pattern cannot be traced with {name} inputs '
                        'at the probe shape, so it has no form at '
                        f'{name}: {self.pattern.dtype_failures[name]}'))
      if trace is None or any(trace is t for t in tried):
        continue
      tried.append(trace)
      found = self._loose_with([trace], te, used, explain)
      if found is not None:
        return found
    return None

  def _loose_with(self, traces, te: Equation, used: set, explain):
    for trace in traces:
      for i, pe in enumerate(trace.eqns):
        if pe.prim.name != te.prim.name:
          continue
        search = _Search(trace, self.ix, used, False, self.memo)
        found = search.run(i, te)
        if found is not None:
          env, _ = found
          return [env[p].aval for p in trace.inputs]
        if explain is not None:
          explain.append(search.best)
    return None

  def exact(self, te: Equation, avals, used: set, explain=None):
    try:
      trace = self.pattern.at(avals)
    except PatternError:
      raise
    except Exception as e:  # noqa: BLE001 - the pattern fails at that shape
      if explain is not None:
        explain.append((0, f'the pattern cannot be traced at the candidate '
                           f'input types ({_avals_str(avals)}): '
                           f'{type(e).__name__}: {e}'))
      return None
    for i, pe in enumerate(trace.eqns):
      if pe.prim.name != te.prim.name:
        continue
      search = _Search(trace, self.ix, used, True, self.memo, self.groups)
      found = search.run(i, te)
      if found is not None:
        env, eqmap = found
        return self.make_match(trace, te, env, eqmap)
      if explain is not None:
        explain.append(search.best)
    if explain is not None and not any(
        pe.prim.name == te.prim.name for pe in trace.eqns):
      explain.append((0, f'traced at {_avals_str(avals)} the pattern has no '
                         f'{te.prim.name} equation'))
    return None

  def make_match(self, trace, te, env, eqmap) -> Match:
    body = self.ix.body_of[id(te)]
    eqns = sorted(eqmap.values(), key=lambda e: self.ix.order[id(e)])
    return Match(eqns, [env[p] for p in trace.inputs],
                 [env[p] for p in trace.outputs], self.ix.path_of[id(body)],
                 body)

  def run(self) -> list[Match]:
    probe = self.pattern.probes[0]
    anchor = probe.eqns[_anchor(probe, self.counts)]
    matches, used = [], set()
    for te in self.by_prim.get(anchor.prim.name, ()):
      if id(te) in used or id(self.ix.body_of[id(te)]) not in self.body_ids:
        continue
      avals = self.loose(te, used)
      if avals is None:
        continue
      m = self.exact(te, avals, used)
      if m is None:
        continue
      matches.append(m)
      used.update(id(e) for e in m.equations)
      outs = list(m.outputs)
      self.groups.update((id(e), outs) for e in m.equations)
    matches.sort(key=lambda m: self.ix.order[id(m.equations[0])])
    return matches


def _avals_str(avals) -> str:
  return ', '.join(a.str_short(short_dtypes=True) for a in avals)


def match(pattern, mox: Mox, *, within=None) -> list[Match]:
  """Finds where ``mox`` computes ``pattern``, by data flow.

  **Arguments:**
  - ``pattern``: a function on arrays (e.g.
    ``lambda x: jax.nn.gelu(x, approximate=False)``), traced by YAX at the
    shapes and dtypes of each candidate so that one pattern matches every
    shape and dtype; or a ``Mox`` from ``yax.make_mox`` (it matches its own
    shapes and dtypes only).
  - ``mox``: the tree to search. It is not modified.
  - ``within``: an XPath expression (or module calls) restricting the search
    to the bodies of the selected module calls and everything under them.

  **Returns:** the matches (:class:`yax.Match`), in evaluation order. A
  match is a set of equations in one body (a module call's children, or a
  ``scan``/``checkpoint`` body's) that compute the pattern's outputs from its
  inputs with the same primitives, params and literals, from which no value
  but the outputs escapes. Matches do not overlap, and the list can be
  grouped together (``yax.group``): no node outside a match (another match
  counting as one node, a module call counting what its body reads through
  closed-over values) both depends on its outputs and feeds it. Earlier ones
  in evaluation order win.

  Raises ``yax.PatternError`` when the pattern cannot be used (it computes
  nothing, is not connected, cannot be traced at any probe shape), and when
  ``within`` selects anything but module calls of this tree, or nothing
  (an XPath that does not compile raises an error that is both a
  ``PatternError`` and an ``XPathError``); the message names what was
  selected.

  Example::

      ms = yax.match(lambda x: jax.nn.gelu(x, approximate=False), mox)
      [m.path for m in ms]
  """
  return _Matcher(pattern, mox, within).run()


def explain_match(pattern, mox: Mox, equation: Equation) -> str:
  """Says whether ``pattern`` matches at ``equation`` of ``mox``, and if not,
  why: the first difference along the best partial match (a primitive,
  param or literal that differs, a value that escapes, a module boundary).

  ``equation`` is any equation of the tree (e.g. from ``yax.query``); the
  pattern is anchored there, at every pattern equation with the same
  primitive. Earlier matches are not taken into account (``match`` skips a
  candidate that overlaps an earlier match).

  **Returns:** a message that starts with ``'match'`` or ``'no match'``.
  """
  if not isinstance(equation, Equation):
    raise PatternError(f'explain_match expects an Equation of the tree, found '
                       f'{type(equation).__name__}')
  m = _Matcher(pattern, mox)
  if id(equation) not in m.ix.body_of:
    raise PatternError(f'{equation!r} is not an equation of this tree')
  where = (f"the {equation.prim.name} equation in the module call at "
           f"'{'/'.join(m.ix.path_of[id(m.ix.body_of[id(equation)])]) or '<root>'}'")
  prims = sorted({e.prim.name for p in m.pattern.probes for e in p.eqns})
  if equation.prim.name not in prims:
    return (f'no match at {where}: the pattern has no {equation.prim.name} '
            f'equation (its primitives: {", ".join(prims)})')
  reasons: list = []
  avals = m.loose(equation, set(), reasons)
  if avals is None:
    return f'no match at {where}: {_best(reasons)}'
  reasons = []
  found = m.exact(equation, avals, set(), reasons)
  if found is None:
    return (f'no match at {where} (pattern traced at {_avals_str(avals)}): '
            f'{_best(reasons)}')
  return f'match at {where}: {found!r}'


def _best(reasons) -> str:
  if not reasons:
    return 'the pattern does not match here'
  return max(reasons, key=lambda r: r[0])[1]


# ---------------------------------------------------------------- group

def _check_matches(matches: Sequence[Match], mox: Mox, what: str):
  ix = _Index(mox)
  seen = set()
  for pos, m in enumerate(matches):
    body = m._body
    for e in m.equations:
      if ix.body_of.get(id(e)) is not body:
        raise SubstitutionError(
            f'{what}: match {pos} ({m!r}) is not a match in this tree (its '
            'equations are not nodes of it; match again on this tree)')
      if id(e) in seen:
        raise SubstitutionError(
            f'{what}: match {pos} ({m!r}) overlaps an earlier one')
      seen.add(id(e))
  # Each match must become one node together with the earlier ones: no
  # node outside it (an earlier match counting as one node) both depends on
  # one of its outputs and feeds it, which would make the grouping cyclic.
  groups: dict[int, list[Symbol]] = {}
  for pos, m in enumerate(matches):
    why = _convexity(m._body, {id(e) for e in m.equations}, ix, groups)
    if why:
      raise SubstitutionError(
          f'{what}: match {pos} ({m!r}) cannot be grouped together with the '
          f'earlier ones: {why}')
    outs = list(m.outputs)
    groups.update((id(e), outs) for e in m.equations)
  return ix


def _str_keys(tree, n: int) -> list[tuple[str, ...]]:
  """Key paths (as strings) of the ``n`` leaves of a treedef; none when the
  treedef is missing or does not have ``n`` leaves."""
  if tree is None or getattr(tree, 'num_leaves', None) != n or n == 0:
    return []
  out = []
  for keypath in leaf_keypaths(tree):
    keys = []
    for k in keypath:
      for attr in ('key', 'name', 'idx'):
        if hasattr(k, attr):
          keys.append(str(getattr(k, attr)))
          break
      else:
        keys.append(str(k))
    out.append(tuple(keys))
  return out


class _TakenPaths:
  """Module paths a new group node must not take: every module call's path,
  the module paths of the variables they read, and every module path the
  root's arguments name (a params tree also holds modules that this call
  never runs). Reading any of them as a group's path would let a
  replacement with variables read that module's weights."""

  def __init__(self, root: Mox):
    self.paths: set[tuple] = set()
    self.root_keys = [k[:-1] for k in _str_keys(root.in_tree,
                                                  len(root.inputs))]
    for node in _iter_calls(root):
      if node is root:
        continue
      self.paths.add(tuple(node.path))
      for keys in _str_keys(node.var_tree, node.num_vars):
        # Linen: (collection, *submodule, name); NNX: (*submodule, name).
        for inner in (keys[1:-1], keys[:-1]):
          for i in range(1, len(inner) + 1):
            self.paths.add((*node.path, *inner[:i]))

  def taken(self, path: tuple) -> bool:
    if path in self.paths:
      return True
    n = len(path)
    return any(keys[i:i + n] == path for keys in self.root_keys
               for i in range(len(keys) - n + 1))

  def fresh(self, parent: tuple, name: str) -> tuple:
    """``(*parent, name)``, else ``name_1``, ``name_2`` ...: the first that
    is taken neither by the tree nor by an earlier group; it is taken."""
    for k in itertools.count():
      path = (*parent, name if k == 0 else f'{name}_{k}')
      if not self.taken(path):
        self.paths.add(path)
        return path
    raise AssertionError('unreachable')


def _iter_calls(root: Mox):
  stack = [root]
  while stack:
    node = stack.pop()
    if isinstance(node, Mox):
      yield node
    stack.extend(getattr(node, 'children', ()))


def _reads(node: Expr, memo: dict) -> set:
  """The symbols a child of a body reads from that body: an equation's
  inputs; for a module call, its inputs and whatever its body reads (a
  module call is not a scope: its body may read a value of the enclosing
  body that is not among its inputs, e.g. an array held in a module
  field). Bodies held by equations are scopes of their own."""
  if not isinstance(node, Mox):
    return set(node.inputs)
  out = memo.get(id(node))
  if out is None:
    out = set(node.inputs)
    for child in node.children:
      out |= _reads(child, memo)
    memo[id(node)] = out
  return out


def group_matches(mox: Mox, matches: Sequence[Match], name: str):
  """A new tree with each match wrapped in an ephemeral module call.

  Returns ``(new_tree, group_nodes)``, the nodes in the order of
  ``matches``.
  """
  _check_matches(matches, mox, 'group')
  by_body: dict[int, list[tuple[int, Match]]] = {}
  for pos, m in enumerate(matches):
    by_body.setdefault(id(m._body), []).append((pos, m))
  nodes: list[Mox | None] = [None] * len(matches)
  taken = _TakenPaths(mox)

  def group_node(m: Match, eqns) -> Mox:
    path = taken.fresh(tuple(m.path), name)
    return Mox(m.inputs, m.outputs, {'name': name}, children=eqns,
               module_ty=None, entrypoint=None, path=path,
               in_tree=jax.tree_util.tree_structure((tuple(m.inputs), {})),
               out_tree=jax.tree_util.tree_structure(tuple(m.outputs)))

  renamed: dict[int, Equation] = {}  # id(old equation) -> rebuilt one
  reads_memo: dict[int, set] = {}

  def regroup(children: list, ms) -> list:
    for pos, m in ms:
      eqns = [renamed.get(id(e), e) for e in m.equations]
      ids = {id(e) for e in eqns}
      at = [i for i, c in enumerate(children) if id(c) in ids]
      first, last = at[0], at[-1]
      outs = set(m.outputs)
      before, after = [], []
      tainted = set(outs)
      for c in children[first:last + 1]:
        if id(c) in ids:
          continue
        if any(s in tainted for s in _reads(c, reads_memo)):
          tainted.update(c.outputs)
          after.append(c)
        else:
          before.append(c)
      node = group_node(m, eqns)
      nodes[pos] = node
      children = children[:first] + before + [node] + after + children[last + 1:]
    return children

  def rebuild(body: Mox) -> Mox:
    children = []
    changed = False
    for c in body.children:
      if isinstance(c, Mox):
        new = rebuild(c)
      elif bodies_of(c):
        # An equation whose bodies were opened for matching (no children
        # in the tree) is put in the new tree opened, with its bodies
        # rewritten, only when something in them changed.
        holder = c if c.children else opened(c)
        bodies = [rebuild(b) for b in holder.children]
        same = all(a is b for a, b in zip(bodies, holder.children,
                                          strict=True))
        new = c if same else holder.replace(children=bodies)
        renamed[id(c)] = new
      else:
        new = c
      changed |= new is not c
      children.append(new)
    ms = by_body.get(id(body))
    if ms:
      children = regroup(children, ms)
      changed = True
    return body.replace(children=children) if changed else body

  return rebuild(mox), nodes


def group(pattern, mox: Mox, name: str, *, within=None) -> Mox:
  """Wraps each match of ``pattern`` in an ephemeral module call named ``name``.

  **Arguments:**
  - ``pattern``: as for :func:`match`, or a list of :class:`Match` objects of
    ``mox`` (e.g. a filtered ``yax.match`` result).
  - ``mox``: the tree; it is not modified.
  - ``name``: the ``name`` of the new nodes, so that
    ``//module_call[@name="gelu"]`` selects them.
  - ``within``: as for :func:`match`.

  **Returns:** a new tree in which each match is a ``module_call`` with
  ``module_ty=None``, ``params={'name': name}``, the match's inputs and
  outputs, the matched equations as children and the path
  ``(*enclosing path, name)``, or ``name_1``, ``name_2`` ... when that
  path is taken (by a module call of the tree, a module whose variables the
  tree reads or its arguments hold, or an earlier group): a group's path
  never equals an existing module's. Evaluation is unchanged. Equations of the body that depend
  on an output of a match but sit between its equations move after the new
  node.
  """
  if not isinstance(name, str) or not name:
    raise PatternError(f'group needs a non-empty string name, found {name!r}')
  if isinstance(pattern, (list, tuple)) and all(
      isinstance(m, Match) for m in pattern):
    matches = list(pattern)
  else:
    matches = match(pattern, mox, within=within)
  return group_matches(mox, matches, name)[0]


def expand_matches(selection, mox: Mox):
  """Hook for ``sub``: a list of matches -> (grouped tree, its group nodes).

  Any other selection is returned unchanged with ``mox``.
  """
  if isinstance(selection, Match):
    selection = [selection]
  if not isinstance(selection, (list, tuple)) or not selection:
    return mox, selection
  kinds = [isinstance(m, Match) for m in selection]
  if not any(kinds):
    return mox, selection
  if not all(kinds):
    raise SubstitutionError(
        'sub got a selection that mixes Match objects with other nodes; '
        'substitute the matches and the nodes in two calls')
  return group_matches(mox, selection, 'match')


# ------------------------------------------------------------ trace_like

def trace_like(fn: Callable) -> Callable[[tuple, Expr], Mox]:
  """A replacement for ``yax.sub`` that traces ``fn`` for each node.

  ``fn`` is a function on arrays; the returned callable ``(path, node)``
  traces it with ``make_mox`` at the shapes and dtypes of the node's
  (dynamic, non-variable) inputs, cached per signature. Use it where one
  replacement must fit nodes of several shapes, e.g. every match of a
  pattern::

      new = yax.sub(yax.match(gelu, mox), yax.trace_like(tanh_gelu), mox)
  """
  cache: dict = {}

  def repl(path, node):
    syms = node.arg_inputs if isinstance(node, Mox) else node.inputs
    avals = [s.aval for s in syms
             if not isinstance(s, Literal) and s.aval is not None]
    key = _avals_key(avals)
    traced = cache.get(key)
    if traced is None:
      from yax._src.trace.make import make_mox
      traced = cache[key] = make_mox(fn)(*[
          jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in avals])
    return traced

  repl.__name__ = repl.__qualname__ = f'trace_like({_fn_name(fn)})'
  return repl
