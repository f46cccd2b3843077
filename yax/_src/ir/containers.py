"""Params containers: edited copies that keep the container type at every level.

Rewrites add variables to the argument tree a model was traced with (LoRA
adapters next to a kernel, the ``scale`` of a replacement module) and
``LoraResult.merge`` removes them again. The argument tree may be made of
plain dicts, ``flax.core.FrozenDict`` s or any other ``Mapping`` registered as
a pytree; whatever it is made of, the edited copy is made of the same types,
level by level, so the rewritten tree's ``in_tree`` matches the params the
user actually holds and ``eval_mox`` accepts them.

A Mapping type is rebuilt from a plain dict of its items by the builder
registered for it with :func:`register_mapping` (``dict`` and
``OrderedDict`` are registered here; another module can register its own,
e.g. ``nnx.State``). Any other Mapping type (``flax.core.FrozenDict``, a
user's own) is rebuilt by calling ``type(m)(items)``, and the result is
checked: the same type, the same keys, the same leaves. If it is not, a
``SubstitutionError`` says which type needs a builder. New levels take the
type of the level that holds them.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, Callable, Sequence

from yax._src.errors import SubstitutionError

Builder = Callable[[Mapping, dict], Mapping]

_BUILDERS: dict[type, Builder] = {
    dict: lambda like, items: dict(items),
    collections.OrderedDict: lambda like, items: collections.OrderedDict(items),
}


def register_mapping(cls: type, build: Builder) -> None:
  """Registers how to rebuild a Mapping of type ``cls`` from a dict.

  ``build(like, items)`` returns a container of the same type as ``like``
  (whose metadata it may copy) holding exactly ``items``.
  """
  _BUILDERS[cls] = build


# Records: objects whose named fields hold the params (Equinox modules),
# registered by the frontend that knows them: ``(is_record, items, build)``,
# ``items(record) -> dict`` and ``build(like, items) -> record``.
_RECORDS: list[tuple[Callable, Callable, Callable]] = []


def register_record(is_record: Callable, items: Callable,
                    build: Callable) -> None:
  """Registers a kind of object whose fields hold params (an Equinox
  module): ``items(record)`` gives its fields as a dict and
  ``build(like, items)`` a record like ``like`` holding exactly ``items``
  (new fields included)."""
  _RECORDS.append((is_record, items, build))


def is_record(tree) -> bool:
  """Whether ``tree`` is a registered record (an Equinox module): its
  params are its fields, read by name."""
  return _record(tree) is not None


def _record(tree):
  """``(items, build)`` of a registered record, else None."""
  for is_record, items, build in _RECORDS:
    if is_record(tree):
      return items, build
  return None


def _keystr(keys: Sequence) -> str:
  return ''.join(f'[{k!r}]' for k in keys)


def rebuild(like: Mapping, items: dict) -> Mapping:
  """A Mapping of ``like``'s type holding ``items``."""
  build = _BUILDERS.get(type(like))
  if build is not None:
    return build(like, items)
  try:
    new = type(like)(items)
  except Exception as e:  # noqa: BLE001 - reported below with the type
    problem = f'calling {type(like).__qualname__}(dict) raised {e!r}'
  else:
    if type(new) is type(like) and _same_items(new, items):
      return new
    problem = (f'{type(like).__qualname__}(dict) did not give back a '
               f'{type(like).__qualname__} with the same items')
  raise SubstitutionError(
      f'cannot add to or remove from a {type(like).__module__}.'
      f'{type(like).__qualname__} in the params tree: {problem}. Register a '
      'builder with yax._src.ir.containers.register_mapping(cls, build) or pass '
      'plain dicts')


def _same_items(new, items: dict) -> bool:
  """Same keys; leaves identical, sub-Mappings (which a container such as
  FrozenDict may re-wrap) with the same keys."""
  try:
    if set(new.keys()) != set(items):
      return False
    for key, value in items.items():
      got = new[key]
      if isinstance(value, Mapping):
        if not isinstance(got, Mapping) or set(got) != set(value):
          return False
      elif got is not value:
        return False
  except Exception:  # noqa: BLE001 - a broken Mapping is reported as such
    return False
  return True


def set_in(tree, keys: Sequence, value, *, _done: Sequence = ()):
  """A copy of ``tree`` with ``value`` at ``keys``; missing levels created.

  Mappings keep their type; a new level takes the type of its parent
  (a plain dict under ``None``). Tuples and lists are indexed by position
  (one past the end appends).
  """
  if not keys:
    return value
  key, rest = keys[0], keys[1:]
  here = (*_done, key)
  if isinstance(tree, (tuple, list)) and not hasattr(tree, '_fields'):
    items = list(tree)
    if isinstance(key, str) and key.isdigit():  # a module path's step
      key = int(key)
    if not isinstance(key, int) or not 0 <= key <= len(items):
      raise SubstitutionError(
          f'cannot set {_keystr(here)} in the argument tree: '
          f'{type(tree).__name__} of length {len(items)} has no position '
          f'{key!r}')
    if key == len(items):
      items.append(None)
    items[key] = set_in(items[key], rest, value, _done=here)
    return type(tree)(items)
  if tree is None:
    tree = {}
  record = _record(tree)
  if record is not None:
    items = record[0](tree)
    key = same_key(items, key)
    # A missing field is a new one; below it, new levels are dicts (the
    # variables of a module a rewrite added: ``PReLU_0/negative_slope``).
    items[key] = set_in(items.get(key), rest, value, _done=(*_done, key))
    return record[1](tree, items)
  if isinstance(tree, Mapping):
    key = same_key(tree, key)
    here = (*_done, key)
    child = tree[key] if key in tree else (
        rebuild(tree, {}) if rest else None)
    items = dict(tree.items())
    items[key] = set_in(child, rest, value, _done=here)
    return rebuild(tree, items)
  raise SubstitutionError(
      f'cannot set {_keystr(here)} in the argument tree: '
      f'{_keystr(_done) or "the argument"} is a {type(tree).__name__}, '
      'expected a Mapping (dict, FrozenDict ...), tuple or list')


def set_many(tree, items: Sequence, *, _done: Sequence = ()):
  """:func:`set_in` for several ``(keys, value)`` pairs at once: every
  Mapping on the way is rebuilt once, not once per pair."""
  if not items:
    return tree
  if any(not keys for keys, _ in items):
    return [value for keys, value in items if not keys][-1]
  if tree is None:
    tree = {}
  if not isinstance(tree, Mapping):  # sequences (and errors): one at a time
    for keys, value in items:
      tree = set_in(tree, keys, value, _done=_done)
    return tree
  groups: dict = {}
  for keys, value in items:
    groups.setdefault(same_key(tree, keys[0]), []).append((keys[1:], value))
  new = dict(tree.items())
  for key, sub in groups.items():
    child = tree[key] if key in tree else (
        rebuild(tree, {}) if any(rest for rest, _ in sub) else None)
    new[key] = set_many(child, sub, _done=(*_done, key))
  return rebuild(tree, new)


def same_key(tree: Mapping, key):
  """``key``, or the key of ``tree`` that prints as ``key``: module paths
  are strings, while an NNX state keys list items by int (``layers/0``)."""
  if key in tree or not isinstance(key, str):
    return key
  return next((k for k in tree.keys() if str(k) == key), key)


def get_in(tree, keys: Sequence, *, what: str = 'params') -> Any:
  """``tree[k0][k1]...``; a missing key raises ``SubstitutionError``."""
  for i, key in enumerate(keys):
    record = _record(tree)
    if record is not None:
      tree = record[0](tree)
    elif isinstance(tree, (tuple, list)) and (
        isinstance(key, int) or (isinstance(key, str) and key.isdigit())) \
        and 0 <= int(key) < len(tree):
      tree = tree[int(key)]  # a step into a sequence (``layers/0``)
      continue
    if isinstance(tree, Mapping):
      key = same_key(tree, key)
    if not isinstance(tree, Mapping) or key not in tree:
      found = (sorted(map(str, tree.keys())) if isinstance(tree, Mapping)
               else type(tree).__name__)
      raise SubstitutionError(
          f"{what}{_keystr(keys[:i + 1])} is missing (found {found} at "
          f"{what}{_keystr(keys[:i]) or ''})")
    tree = tree[key]
  return tree


def without(tree: Mapping, names: Sequence) -> Mapping:
  """A copy of the Mapping (or registered record) ``tree`` without the
  entries ``names``."""
  record = _record(tree)
  if record is not None:
    return record[1](tree, {k: v for k, v in record[0](tree).items()
                            if k not in names})
  return rebuild(tree, {k: v for k, v in tree.items() if k not in names})
