"""Boundary markers: identity primitives bound at the entry and exit of a call.

While tracing, every intercepted Flax method call binds ``yax_enter`` on the
module variables and the dynamic call arguments, and ``yax_exit`` on the
dynamic outputs. Both are identities on the values they return, so they
survive any JAX transformation (``jit``, ``vmap``, ``grad``, ``scan``) and
show up in the traced Jaxpr, in call order, nested. The tree builder turns
each enter/exit pair into a ``module_call`` node and drops the markers, so
they never reach evaluation or compilation.

Only the documented extension points for new primitives are used
(``jax.extend.core.Primitive`` and the rule tables of ``jax.interpreters``,
imported through ``compat.py``, the one module that touches JAX internals).
"""

from __future__ import annotations

from jax.extend.core import Primitive
from yax._src.compat import ad, batching, mlir

enter_p = Primitive('yax_enter')
enter_p.multiple_results = True
exit_p = Primitive('yax_exit')
exit_p.multiple_results = True


# yax_enter(*variables, *args) -> args. Variables ride along so that the
# Jaxpr records which symbols the module reads as its variables; those that
# are inputs of the root trace are named by position in the call's record
# instead (``_calls.CallRecord.var_refs``), and ride along only in a nested
# JAX trace (a ``jit``, ``vmap`` or ``scan`` body), where JAX must see them.
def _enter_impl(*vals, call_id, num_vars):
  del call_id
  return list(vals[num_vars:])


def _enter_abstract_eval(*avals, call_id, num_vars):
  del call_id
  return list(avals[num_vars:])


def _enter_batch(vals, dims, *, call_id, num_vars):
  outs = enter_p.bind(*vals, call_id=call_id, num_vars=num_vars)
  return outs, list(dims[num_vars:])


def _enter_jvp(primals, tangents, *, call_id, num_vars):
  outs = enter_p.bind(*primals, call_id=call_id, num_vars=num_vars)
  return outs, list(tangents[num_vars:])


enter_p.def_impl(_enter_impl)
enter_p.def_abstract_eval(_enter_abstract_eval)
batching.primitive_batchers[enter_p] = _enter_batch
ad.primitive_jvps[enter_p] = _enter_jvp
mlir.register_lowering(
    enter_p, mlir.lower_fun(_enter_impl, multiple_results=True))


# yax_exit(*outputs) -> outputs.
def _exit_impl(*vals, call_id):
  del call_id
  return list(vals)


def _exit_abstract_eval(*avals, call_id):
  del call_id
  return list(avals)


def _exit_batch(vals, dims, *, call_id):
  return exit_p.bind(*vals, call_id=call_id), list(dims)


def _exit_jvp(primals, tangents, *, call_id):
  return exit_p.bind(*primals, call_id=call_id), list(tangents)


exit_p.def_impl(_exit_impl)
exit_p.def_abstract_eval(_exit_abstract_eval)
batching.primitive_batchers[exit_p] = _exit_batch
ad.primitive_jvps[exit_p] = _exit_jvp
mlir.register_lowering(exit_p, mlir.lower_fun(_exit_impl, multiple_results=True))

MARKERS = (enter_p, exit_p)
