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

The rewrite goes through the substitution engine (``substitute``): the
replacement of a call is the call itself with its body moved into the
``checkpoint`` equation, and the names of ``save`` are spliced into that
body by the engine as well.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import jax
import jax.ad_checkpoint
from jax import tree_util as jtu

from yax._src.errors import SubstitutionError
from yax._src.ir import lower as _lower
from yax._src.ir.nodes import (Equation, Expr, Literal, Mox, Symbol, Var,
                               leaf_equations)
from yax._src.rewrite.engine import (describe, non_literals, read_outside,
                                     reads_from_enclosing, select, substitute)


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


def _policy_factories() -> dict[str, Callable]:
  """The functions of ``jax.checkpoint_policies`` that make a policy from
  arguments (names, memory kinds, other policies), by name."""
  return {name: getattr(jax.checkpoint_policies, name)
          for name in dir(jax.checkpoint_policies)
          if not name.startswith('_')
          and callable(getattr(jax.checkpoint_policies, name))
          and not _is_ready_policy(getattr(jax.checkpoint_policies, name))}


def _is_ready_policy(fn) -> bool:
  """A policy answers ``(prim, *avals, **params) -> bool`` (JAX annotates
  each one so); a factory takes names, memory kinds or other policies and
  returns a policy."""
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):  # a builtin without a signature: no policy
    return False
  if sig.return_annotation in (bool, 'bool'):
    return True
  params = list(sig.parameters.values())
  return bool(params) and params[0].name == 'prim'


def resolve_policy(policy) -> tuple[Callable | None, str]:
  """``policy`` -> (the function JAX takes, the name XML shows)."""
  if policy is None:
    return None, 'nothing_saveable'
  names = _policy_names()
  factories = _policy_factories()
  # A factory's name (but offload_dot_with_no_batch_dims, which names the
  # policy it makes with JAX's usual memory kinds), or the factory itself.
  factory = policy if isinstance(policy, str) and policy not in names else \
      next((k for k, f in factories.items() if f is policy), None)
  if factory in factories:
    raise SubstitutionError(
        f'remat: jax.checkpoint_policies.{factory} makes a policy from its '
        'arguments; it is no policy itself. Pass the policy it returns, '
        f'e.g. policy=jax.checkpoint_policies.{factory}(...), or keep named '
        "outputs with save=xpath; the ready policies' names are "
        f'{", ".join(sorted(names))}')
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
  # JAX keeps aliases (checkpoint_dots is dots_saveable): the function's
  # own name first, as the SPEC names the policies.
  own = getattr(policy, '__name__', None)
  if names.get(own) is policy:
    return policy, own
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


def _name_after(node: Expr, prefix: str, names: list[str]) -> Expr:
  """The save target ``node`` with a ``checkpoint_name`` on each output,
  as a replacement the engine splices: a module call names its outputs as
  its last equations (the engine wires its own variables back); an
  equation, or a call with no Flax module of its own, is followed by the
  names. The names given are appended to ``names``."""
  equations, outputs = [], []
  for i, sym in enumerate(node.outputs):
    if isinstance(sym, Literal) or sym.aval is None or sym.dropped:
      outputs.append(sym)
      continue
    eqn, named = _name_equation(sym, f'{prefix}:{i}')
    names.append(f'{prefix}:{i}')
    equations.append(eqn)
    outputs.append(named)
  if isinstance(node, Mox) and not node.is_ephemeral:
    return node.replace(children=[*node.children, *equations],
                        outputs=outputs)
  inputs = non_literals(node.inputs)
  return Mox(inputs, outputs, {}, children=[node, *equations],
             in_tree=jtu.tree_structure(tuple(inputs)),
             out_tree=jtu.tree_structure(tuple(outputs)),
             debug_info=_lower.new_debug_info(f'yax.remat.{prefix}'))


def _outer_inputs(node: Mox) -> list[Symbol]:
  """The call's dynamic inputs, each once, in order."""
  return list(dict.fromkeys(non_literals(node.inputs)))


def remat_template(node: Mox, policy_fn, label: str,
                   save: dict[int, tuple[Expr, str]],
                   read_elsewhere: set[Symbol] = frozenset()) -> Mox:
  """``node`` with its body inside one ``checkpoint`` equation, and a
  ``checkpoint_name`` on each output of the ``save`` nodes of its body
  (``id(node) -> (node, name prefix)``). ``read_elsewhere``: the symbols
  the tree reads outside ``node``; those its body computes are outputs of
  the ``checkpoint`` equation as well (state a call updates).
  The template reads the node's own symbols; the engine copies it (the
  ``checkpoint`` body with symbols of its own)."""
  sample, _ = _sample_equations()
  outer = _outer_inputs(node)
  # Values of the enclosing body the body reads (a constant of the tree,
  # a PRNG key of the traced arguments, what the caller computed) are
  # inputs of the checkpoint too.
  outer += [s for s in reads_from_enclosing(node) if s not in set(outer)]
  dynamic_outs = non_literals(node.outputs)
  shown = set(dynamic_outs)
  dynamic_outs += [s for e in leaf_equations(node) for s in e.outputs
                   if s in read_elsewhere and s not in shown]
  body = Mox(outer, dynamic_outs, {}, children=list(node.children),
             in_tree=jtu.tree_structure(tuple(outer)),
             out_tree=jtu.tree_structure(tuple(dynamic_outs)),
             debug_info=_lower.new_debug_info('yax.remat'))
  if save:  # the engine names them, inside the body
    names: list[str] = []
    body = substitute([n for n, _ in save.values()],
                      lambda path, n: _name_after(n, save[id(n)][1], names),
                      body).mox
    only = jax.checkpoint_policies.save_only_these_names(*names)
    policy_fn = only if policy_fn is None else \
        jax.checkpoint_policies.save_from_both_policies(policy_fn, only)
  # The values read elsewhere keep their symbols: the readers outside
  # this call read them from the ``checkpoint`` equation now.
  n_own = len(non_literals(node.outputs))
  outs = [Var(s.aval) for s in dynamic_outs[:n_own]] + dynamic_outs[n_own:]
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

def _save_targets(save, mox: Mox, calls) -> dict[int, dict]:
  """For each selected call, the nodes of its body that ``save`` selects:
  ``id(call) -> {id(node): (node, checkpoint name prefix)}``."""
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
    by_call.setdefault(id(owner), {})[id(target)] = (
        target, f'yax.save:{where}:{k}')
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
    return remat_template(node, policy_fn, label, saves.get(id(node), {}),
                          read_outside(mox, node))

  return substitute(chosen, replace, mox).mox

