"""``yax.remat``: run selected module calls under ``jax.checkpoint``.

Rematerialization (gradient checkpointing, Chen et al. 2016, "Training
Deep Nets with Sublinear Memory Cost") keeps only a call's inputs between
the forward and the backward pass and recomputes its intermediates when the
gradient needs them. Flax users get it by editing the model
(``nn.remat(Block)``, ``nnx.remat``); Hugging Face's Flax models by a config
flag (``gradient_checkpointing=True``) that covers whole layers only. Here
it is a rewrite of a traced tree: each selected call keeps its type, path
and variables, and its body moves into one ``checkpoint`` equation, the
equation ``nn.remat`` itself puts around a module (same primitive, same
``prevent_cse``, same policy), so gradients, saved residuals and XLA's
memory are those of the model written with ``nn.remat``.

``save=xpath`` names outputs to keep: each selected node inside a
rematerialized call gets a ``checkpoint_name`` on each output, and the
call's policy also saves those names (``save_only_these_names``).

The rewrite goes through the substitution engine (``_engine.substitute``):
the replacement of a call is the call itself with the new body.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import jax
import jax.ad_checkpoint
from jax import tree_util as jtu

from yax._src.errors import SubstitutionError
from yax._src.ir import lower as _lower
from yax._src.ir.nodes import Equation, Expr, Literal, Mox, Symbol, Var
from yax._src.rewrite.engine import describe, select, substitute


# --------------------------------------------------------------- policies

def _policy_names() -> dict[str, Callable]:
  """The ready policies of ``jax.checkpoint_policies`` by name. Factories
  (``save_only_these_names`` ...) take arguments and are passed called;
  the offloading one is named with JAX's usual memory kinds."""
  out = {}
  for name in dir(jax.checkpoint_policies):
    fn = getattr(jax.checkpoint_policies, name)
    if not name.startswith('_') and callable(fn) and _is_ready_policy(fn):
      out[name] = fn
  offload = getattr(jax.checkpoint_policies, 'offload_dot_with_no_batch_dims',
                    None)
  if offload is not None:
    out['offload_dot_with_no_batch_dims'] = offload('device', 'pinned_host')
  return out


def _is_ready_policy(fn) -> bool:
  """A policy takes ``(prim, *avals, **params)`` (or anything); a factory
  takes names or other policies."""
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    return False
  return bool(params) and (params[0].name == 'prim' or
                           params[0].kind is inspect.Parameter.VAR_POSITIONAL)


def resolve_policy(policy) -> tuple[Callable | None, str]:
  """``policy`` -> (the function JAX takes, the name XML shows)."""
  if policy is None:
    return None, 'nothing_saveable'
  names = _policy_names()
  if isinstance(policy, str):
    if policy not in names:
      raise SubstitutionError(
          f'remat: unknown policy {policy!r}; expected one of '
          f'{", ".join(sorted(names))}, a function of '
          'jax.checkpoint_policies, or None (keep only the call inputs)')
    return names[policy], policy
  if not callable(policy):
    raise SubstitutionError(
        f'remat: a policy is a name, a jax.checkpoint_policies function or '
        f'None; found {describe(policy)}')
  for name, fn in names.items():
    if fn is policy:
      return fn, name
  return policy, getattr(policy, '__name__', type(policy).__name__)


# ------------------------------------------------- JAX's own primitives

@functools.lru_cache(maxsize=None)
def _sample_equations():
  """One ``checkpoint`` and one ``name`` equation as JAX traces them (their
  primitives are not public API; the traced equations are)."""
  remat = jax.make_jaxpr(jax.checkpoint(lambda x: x + 1))(1.0).eqns[0]
  named = jax.make_jaxpr(
      lambda x: jax.ad_checkpoint.checkpoint_name(x, 'yax'))(1.0).eqns[0]
  return remat, named


def _name_equation(sym: Symbol, name: str) -> tuple[Equation, Var]:
  _, named = _sample_equations()
  out = Var(sym.aval)
  eqn = Equation(named.primitive, [sym], [out], {**named.params, 'name': name},
                 effects=named.effects, source_info=named.source_info,
                 ctx=named.ctx)
  return eqn, out


# ---------------------------------------------------------- the new body

class Remat:
  """The type of a rematerialized call that was no longer one Flax
  module's call (a rewrite that added variables or inputs, such as
  ``lora`` or ``quantize``, made it ephemeral): only its path is left."""

class _BodyCopy:
  """A copy of a call's body with fresh symbols (a closed body of its own)
  and a ``checkpoint_name`` after each output of a node to save."""

  def __init__(self, node: Mox, save: dict[int, str]):
    self.node = node
    self.save = save  # id(node) -> name prefix
    self.env: dict[Symbol, Symbol] = {}
    self.names: list[str] = []

  def read(self, sym: Symbol) -> Symbol:
    if isinstance(sym, Literal):
      return sym
    try:
      return self.env[sym]
    except KeyError:
      raise SubstitutionError(
          f'remat: the body of {describe(self.node)} reads a value of type '
          f'{sym.type_str} that is neither an input of the call nor computed '
          'in it; the call cannot be rematerialized on its own') from None

  def define(self, sym: Symbol) -> Symbol:
    if isinstance(sym, Literal):
      return sym
    new = Var(sym.aval, dropped=sym.dropped)
    self.env[sym] = new
    return new

  def copy(self, expr: Expr) -> list[Expr]:
    if isinstance(expr, Equation):
      inputs = [self.read(s) for s in expr.inputs]
      bodies = [self.copy_closed(b) for b in expr.children]
      outputs = [self.define(s) for s in expr.outputs]
      new = expr.replace(inputs=inputs, outputs=outputs, children=bodies)
      old_outputs = expr.outputs
    else:
      inputs = [self.read(s) for s in expr.inputs]
      children = [c for child in expr.children for c in self.copy(child)]
      outputs = [self.read(s) for s in expr.outputs]
      new = expr.replace(inputs=inputs, outputs=outputs, children=children)
      old_outputs = expr.outputs
    out = [new]
    prefix = self.save.get(id(expr))
    if prefix is not None:
      for i, old in enumerate(old_outputs):
        if isinstance(old, Literal) or old.aval is None:
          continue
        name = f'{prefix}:{i}'
        eqn, named = _name_equation(self.env[old], name)
        self.env[old] = named  # later readers read the named value
        self.names.append(name)
        out.append(eqn)
    return out

  def copy_closed(self, body: Mox) -> Mox:
    constvars = [self.define(s) for s in body.constvars]
    inputs = [self.define(s) for s in body.inputs]
    children = [c for child in body.children for c in self.copy(child)]
    outputs = [self.read(s) for s in body.outputs]
    return body.replace(inputs=inputs, outputs=outputs, children=children,
                        constvars=constvars)


def _outer_inputs(node: Mox) -> list[Symbol]:
  """The call's dynamic inputs, each once, in order."""
  seen, out = set(), []
  for s in node.inputs:
    if isinstance(s, Literal) or s in seen:
      continue
    seen.add(s)
    out.append(s)
  return out


def remat_template(node: Mox, policy_fn, label: str,
                   save: dict[int, str]) -> Mox:
  """``node`` with its body inside one ``checkpoint`` equation."""
  sample, _ = _sample_equations()
  copy = _BodyCopy(node, save)
  outer = _outer_inputs(node)
  body_inputs = [copy.define(s) for s in outer]
  children = [c for child in node.children for c in copy.copy(child)]
  dynamic_outs = [s for s in node.outputs
                  if not isinstance(s, Literal)]
  body_outputs = [copy.read(s) for s in dynamic_outs]
  if copy.names:
    only = jax.checkpoint_policies.save_only_these_names(*copy.names)
    policy_fn = only if policy_fn is None else \
        jax.checkpoint_policies.save_from_both_policies(policy_fn, only)
  body = Mox(body_inputs, body_outputs, {}, children=children,
             in_tree=jtu.tree_structure(tuple(body_inputs)),
             out_tree=jtu.tree_structure(tuple(body_outputs)),
             debug_info=_lower.new_debug_info('yax.remat'))
  outs = [Var(s.aval) for s in dynamic_outs]
  params = {k: v for k, v in sample.params.items() if k != 'jaxpr'}
  params.update(policy=policy_fn, prevent_cse=True, differentiated=False)
  eqn = Equation(sample.primitive, list(outer), outs, params,
                 children=[body], body_keys=['jaxpr'],
                 body_forms=[_lower.OPEN], effects=sample.effects,
                 source_info=sample.source_info, ctx=sample.ctx)
  by_old = dict(zip(dynamic_outs, outs, strict=True))
  outputs = [by_old.get(s, s) for s in node.outputs]
  if node.is_ephemeral:  # a module again, so the engine wires its variables
    return node.replace(children=[eqn], outputs=outputs, module_ty=Remat,
                        entrypoint='__call__',
                        params={'name': node.path[-1], 'remat': label})
  return node.replace(children=[eqn], outputs=outputs,
                      params={**node.params, 'remat': label})


# ------------------------------------------------------------- the rewrite

def _save_targets(save, mox: Mox, calls) -> dict[int, dict[int, str]]:
  """For each selected call, the nodes of its body that ``save`` selects:
  ``id(call) -> {id(node): checkpoint name prefix}``."""
  if save is None:
    return {}
  chosen = select(save, mox)
  by_call: dict[int, dict[int, str]] = {}
  call_ids = {id(c) for c in calls}
  outside = []
  for k, target in enumerate(chosen.targets):
    owner = next((a for a in chosen.ancestors[id(target)]
                  if id(a) in call_ids), None)
    if owner is None:
      outside.append(target)
      continue
    where = '/'.join(getattr(target, 'path', ()) or ()) or str(k)
    by_call.setdefault(id(owner), {})[id(target)] = f'yax.save:{where}:{k}'
  if outside and len(outside) == len(chosen.targets):
    raise SubstitutionError(
        f'remat: save={chosen.description} selects no node inside the '
        f'rematerialized calls (it matched {describe(outside[0])}, outside '
        'them); save names outputs inside the selected calls')
  return by_call


def remat(mox: Mox, selection, *, policy=None, save=None) -> Mox:
  """Rematerializes the selected module calls: each runs under
  ``jax.checkpoint``, so its intermediates are recomputed in the backward
  pass instead of being kept.

  **Arguments:**
  - ``mox``: the traced tree (left unchanged).
  - ``selection``: XPath or node list of module calls, e.g.
    ``'//module_call[@type="FlaxBertLayer"]'``.
  - ``policy``: ``None`` (keep only each call's inputs), a
    ``jax.checkpoint_policies`` function or its name
    (``'dots_with_no_batch_dims_saveable'``).
  - ``save``: XPath or node list of nodes inside the selected calls whose
    outputs are kept (named with ``checkpoint_name`` and saved by the
    policy), e.g. ``'//module_call[@type="Dense"]'``.

  **Returns:** the new tree; each selected call shows ``remat="<policy>"``
  in XML. Gradients equal the original's; saved residuals and memory equal
  the model written with ``nn.remat``/``nnx.remat`` on the same modules.

  Example::

      new = yax.remat(mox, '//module_call[@type="Block"]',
                      policy='dots_with_no_batch_dims_saveable')
  """
  if not isinstance(mox, Mox):
    raise SubstitutionError(
        f'remat expects a Mox as the tree to rewrite, found '
        f'{type(mox).__name__}')
  policy_fn, label = resolve_policy(policy)
  chosen = select(selection, mox)
  for target in chosen.targets:
    if not isinstance(target, Mox) or (target.is_ephemeral and
                                       not target.path):
      raise SubstitutionError(
          f'remat: the selection {chosen.description} matched '
          f'{describe(target)}; remat applies to module calls, e.g. '
          '//module_call[@type="Block"] (or, after lora or quantize, '
          '//module_call[@path="block0"])')
  saves = _save_targets(save, mox, chosen.targets)
  if saves:
    label = f'{label}+save' if policy is not None else 'save'

  def replace(path, node):
    del path
    return remat_template(node, policy_fn, label, saves.get(id(node), {}))

  return substitute(chosen, replace, mox).mox

