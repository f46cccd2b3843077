"""Errors raised on purpose by YAX. Every one derives from :class:`YaxError`."""

from __future__ import annotations


class YaxError(Exception):
  """Base class of every error that YAX raises on purpose."""


class TraceError(YaxError):
  """A function could not be traced into a module expression."""


class SignatureError(YaxError, TypeError):
  """`eval_mox` got arguments that do not match the traced signature."""


class XPathError(YaxError, ValueError):
  """An XPath expression could not be compiled or evaluated."""


class SubstitutionError(YaxError, ValueError):
  """A replacement does not fit the node it should replace."""


class EvaluationError(YaxError):
  """An equation failed while a module expression was evaluated; the message
  names the module path and the equation, ``__cause__`` is the original."""


class PatternError(YaxError, ValueError):
  """A pattern cannot be used for matching (see ``yax.match``)."""


class AdapterFileError(YaxError, ValueError):
  """A file of LoRA adapters cannot be written, or does not fit the model it
  is loaded onto (``LoraResult.save``, ``yax.load_lora``); the message names
  the params path and what the file and the model hold there."""


class NotPicklableError(YaxError, TypeError):
  """``pickle.dumps`` (or ``copy.deepcopy``) of a tree node: its equations
  hold JAX objects that JAX does not serialize."""


class TraceWarning(UserWarning):
  """A module call was seen while tracing but could not be recorded as a
  ``module_call`` node (it ended in an exception the model caught, or it
  started and ended in two different JAX traces). Its equations stay in the
  enclosing body, so the tree still computes what the function computes;
  the message names the module path and why."""
