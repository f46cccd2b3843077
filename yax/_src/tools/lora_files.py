"""LoRA adapters as files: ``LoraResult.save`` and ``yax.load_lora``.

A file holds the leaves a ``lora`` result's ``.mask`` marks (the adapters,
and any other params ``lora`` was told to train), each under its params
path joined with ``'/'`` (``params/dense/lora_a``), and what made them:
the arguments of the ``lora`` call that ``load_lora`` re-runs (selection,
rank, alpha, ...; metadata ``lora``), the result's whole ``.config``
(variant, scale, init ...; ``config``), the adapted module paths
(``paths``), the YAX version, the adapters' dtypes (``dtype``) and types
(``adapters``), and the type of every other leaf of the params, the model
they were made for (``model``).

Two formats:

* ``'safetensors'`` (one file): the arrays, and that record as the file's
  string metadata (each value JSON). Every adapter is gathered to the host
  that writes it, so it suits adapters that fit one host.
* ``'orbax'`` (a directory, ``orbax-checkpoint``): the adapters stay
  sharded; each process writes and reads only its own shards, so nothing is
  gathered to one host. The same record goes to a JSON item beside them.

Loading traces nothing itself: the user traces the base model (in this or
another process), quantizes it first if the adapters were made over a
quantized base (QLoRA), and ``load_lora`` re-runs ``lora`` with the
recorded arguments, checks that the file fits (the model's params, then
each adapter: missing, extra, another shape or dtype, each named by its
path) and puts the saved values in place, on the devices and shardings the
adapters of the fresh ``lora`` call have.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping
from typing import Any, Callable

import jax
import numpy as np

from yax._src.errors import AdapterFileError, XPathError
from yax._src.ir.arguments import boxed_like, unboxed
from yax._src.ir.containers import set_many
from yax._src.ir.nodes import Mox
from yax._src.version import __version__
from yax._src.views.query import compile_xpath

FORMAT = 'yax.lora'
FORMAT_VERSION = '1'
FORMATS = ('safetensors', 'orbax')
_NOT_XPATH = object()

# safetensors' dtype names (its header) and numpy's; bfloat16 and the
# float8 types come from ml_dtypes, which JAX depends on.
_SAFETENSORS_DTYPES = {
    'F64': 'float64', 'F32': 'float32', 'F16': 'float16', 'BF16': 'bfloat16',
    'I64': 'int64', 'I32': 'int32', 'I16': 'int16', 'I8': 'int8',
    'U64': 'uint64', 'U32': 'uint32', 'U16': 'uint16', 'U8': 'uint8',
    'BOOL': 'bool', 'F8_E4M3': 'float8_e4m3fn', 'F8_E5M2': 'float8_e5m2',
}


# ------------------------------------------------------------ params walks

def leaves(tree, keys: tuple = ()) -> dict:
  """``{path: (keys, leaf)}`` for every leaf of a params tree, where a leaf
  is anything that is not a Mapping, list or tuple (an array, a Linen box,
  an NNX Variable) and ``path`` its keys joined with ``'/'``."""
  out: dict = {}
  if isinstance(tree, Mapping):
    items = tree.items()
  elif isinstance(tree, (list, tuple)) and not hasattr(tree, '_fields'):
    items = enumerate(tree)
  else:
    return {'/'.join(map(str, keys)): (keys, tree)}
  for key, child in items:
    out.update(leaves(child, (*keys, key)))
  return out


def type_str(x) -> str:
  """``float32[4,8]``: the dtype and shape of an array (or abstract one)."""
  shape = ','.join(str(d) for d in x.shape)
  return f'{np.dtype(x.dtype).name}[{shape}]'


def adapters_of(params, mask) -> tuple[dict, dict]:
  """``(adapters, others)``: ``{path: (keys, boxed leaf)}`` of the leaves
  of ``params`` that ``mask`` marks, and of the rest."""
  params, flags = leaves(params), leaves(mask)
  if params.keys() != flags.keys():
    only = sorted(params.keys() - flags.keys())
    missing = sorted(flags.keys() - params.keys())
    raise AdapterFileError(
        'save: the params do not have the lora result\'s structure (its '
        '.mask\'s): '
        + (f'params[{only[0]!r}] is not in it' if only else
           f'params[{missing[0]!r}] is missing'))
  marked = {p for p, (_, flag) in flags.items() if bool(unboxed(flag))}
  return ({p: v for p, v in params.items() if p in marked},
          {p: v for p, v in params.items() if p not in marked})


# ------------------------------------------------------------ the record

def _lora_arguments(lora: Callable, config: Mapping) -> dict:
  """The entries of ``config`` that are keyword arguments of ``lora``
  (all but the tree, the params and the PRNG key, which only draws
  values the file replaces)."""
  names = [n for n, p in inspect.signature(lora).parameters.items()
           if n not in ('mox', 'params', 'key')
           and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
  arguments = {n: config[n] for n in names if n in config}
  if 'dora' in names and 'dora' not in config and 'variant' in config:
    arguments['dora'] = config['variant'] == 'dora'
  return arguments


def record(res, lora: Callable, adapters: dict, others: dict) -> dict:
  """What made the adapters, as the file's string metadata (JSON values)."""
  config = dict(getattr(res, 'config', None) or {})
  arguments = _lora_arguments(lora, config)
  if 'selection' not in arguments:
    raise AdapterFileError(
        'save: this lora result does not record the arguments lora was '
        'called with (its .config has no selection), so a loader could not '
        'make the same adapters again')
  for name in ('selection', 'train'):
    value = arguments.get(name)
    if isinstance(value, str):
      try:
        compile_xpath(value)
      except XPathError:
        # lora records a selection given as nodes by its description.
        arguments[name] = _NOT_XPATH
  for name, value in arguments.items():
    if value is _NOT_XPATH:
      raise AdapterFileError(
          f'save: lora was called with {name}= nodes (or matches), which '
          'a file cannot record; call yax.lora with '
          f'{name} as an XPath string to save its adapters')
    try:
      json.dumps(value)
    except TypeError:
      raise AdapterFileError(
          f'save: lora was called with {name}={value!r:.200}, which a file '
          f'cannot record (a {type(value).__name__}); call yax.lora with '
          f'{name} as an XPath string or a number to save its adapters'
      ) from None
  for path, (_, leaf) in {**adapters, **others}.items():
    value = unboxed(leaf)
    if not hasattr(value, 'shape') or not hasattr(value, 'dtype'):
      raise AdapterFileError(
          f'save: params[{path!r}] is a {type(value).__name__}, not an array')
  paths = [p if isinstance(p, str) else '/'.join(map(str, p))
           for p in res.paths]
  dtypes = sorted({np.dtype(unboxed(leaf).dtype).name
                   for _, leaf in adapters.values()})
  try:
    made = json.dumps(config)
  except TypeError as e:
    raise AdapterFileError(
        f'save: the lora result\'s .config is not JSON-ready ({e})') from None
  return {
      'format': FORMAT,
      'format_version': FORMAT_VERSION,
      'yax_version': __version__,
      'lora': json.dumps(arguments),
      'config': made,
      'paths': json.dumps(paths),
      'dtype': ','.join(dtypes),
      'adapters': json.dumps({p: type_str(unboxed(leaf))
                              for p, (_, leaf) in adapters.items()}),
      'model': json.dumps({p: type_str(unboxed(leaf))
                           for p, (_, leaf) in others.items()}),
  }


def _read_record(meta: Mapping | None, where: str) -> dict:
  """The record's JSON values decoded; a file YAX did not write raises."""
  if not meta or meta.get('format') != FORMAT:
    raise AdapterFileError(
        f'{where} is not a file of YAX LoRA adapters (its metadata has no '
        f'format={FORMAT!r}; found {dict(meta or {})!r:.300}); save one with '
        'res.save(path), where res = yax.lora(...)')
  if meta.get('format_version') != FORMAT_VERSION:
    raise AdapterFileError(
        f'{where} has format version {meta.get("format_version")!r}; this '
        f'YAX ({__version__}) reads version {FORMAT_VERSION!r}')
  out = dict(meta)
  for key in ('lora', 'paths', 'adapters', 'model'):
    try:
      out[key] = json.loads(meta[key])
    except (KeyError, TypeError, ValueError) as e:
      raise AdapterFileError(
          f'{where}: its metadata entry {key!r} is missing or not JSON '
          f'({e})') from None
  return out


# ------------------------------------------------------------ saving

def save(res, path, params, *, format: str, lora: Callable) -> None:
  """Writes the adapters of ``params`` (the leaves ``res.mask`` marks) and
  their record (see the module doc)."""
  if format not in FORMATS:
    raise AdapterFileError(
        f'save: format must be one of {FORMATS}, found {format!r}')
  adapters, others = adapters_of(params, res.mask)
  if not adapters:
    raise AdapterFileError('save: the lora result\'s .mask marks no leaf')
  meta = record(res, lora, adapters, others)
  for p, (_, leaf) in adapters.items():
    if isinstance(unboxed(leaf), jax.ShapeDtypeStruct):
      raise AdapterFileError(
          f'save: the adapter params[{p!r}] is abstract '
          f'({type_str(unboxed(leaf))}, a ShapeDtypeStruct): there are no '
          'values to save')
  if format == 'safetensors':
    _save_safetensors(adapters, meta, os.fspath(path))
  else:
    _save_orbax(adapters, meta, os.fspath(path))


def _safetensors():
  try:
    import safetensors
    import safetensors.numpy
  except ImportError as e:
    raise AdapterFileError(
        'adapter files in the safetensors format need the safetensors '
        f'package: pip install safetensors ({e})') from None
  return safetensors


def _save_safetensors(adapters: dict, meta: dict, path: str) -> None:
  st = _safetensors()
  arrays = {}
  for p, (_, leaf) in adapters.items():
    value = unboxed(leaf)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
      raise AdapterFileError(
          f'save: the adapter params[{p!r}] is sharded over devices of '
          'several processes, so one safetensors file cannot hold it '
          'without gathering it to one host: save with format="orbax" (a '
          'directory each process writes its own shards to)')
    arrays[p] = np.ascontiguousarray(np.asarray(value))
  st.numpy.save_file(arrays, path, metadata=meta)


def _orbax():
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:
    raise AdapterFileError(
        'sharded adapter checkpoints need orbax-checkpoint: pip install '
        f'orbax-checkpoint ({e})') from None
  return ocp


def _save_orbax(adapters: dict, meta: dict, path: str) -> None:
  ocp = _orbax()
  path = os.path.abspath(path)
  if os.path.exists(path):
    raise AdapterFileError(
        f'save: {path} exists; orbax writes a new directory (remove it or '
        'pick another path)')
  # Items named by position: params keys may hold characters orbax gives
  # a meaning to ('.', '/'); the record lists the paths in that order.
  tree = {f'a{i}': unboxed(leaf)
          for i, (_, leaf) in enumerate(adapters.values())}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
    ckpt.save(path, args=ocp.args.Composite(
        adapters=ocp.args.StandardSave(tree),
        record=ocp.args.JsonSave(meta)))


# ------------------------------------------------------------ loading

def load(mox: Mox, params, path, *, lora: Callable):
  """``yax.load_lora`` (see its docstring in ``lora.py``)."""
  path = os.fspath(path)
  if os.path.isdir(path):
    kind, ocp = 'orbax', _orbax()
    try:
      with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
        meta = ckpt.restore(os.path.abspath(path), args=ocp.args.Composite(
            record=ocp.args.JsonRestore())).record
    except (KeyError, ValueError, FileNotFoundError) as e:
      raise AdapterFileError(
          f'load_lora: the directory {path} is not an orbax checkpoint of '
          f'YAX LoRA adapters (res.save(path, format="orbax")): {e}') from e
  elif os.path.isfile(path):
    kind, st = 'safetensors', _safetensors()
    try:
      with st.safe_open(path, framework='np') as f:
        meta = f.metadata()
    except st.SafetensorError as e:
      raise AdapterFileError(
          f'load_lora: {path} is not a safetensors file: {e}') from e
  else:
    raise AdapterFileError(f'load_lora: no file or directory at {path}')
  where = f'{kind} adapters {path}'
  rec = _read_record(meta, where)
  _check_model(params, rec, where)
  res = lora(mox, params, **rec['lora'])
  adapters, others = adapters_of(res.params, res.mask)
  _check_adapters(adapters, others, rec, where)
  for p, (_, leaf) in adapters.items():
    if isinstance(unboxed(leaf), jax.ShapeDtypeStruct):
      raise AdapterFileError(
          f'load_lora: params[{p!r}] is abstract (a ShapeDtypeStruct): '
          'load adapters onto params that hold arrays')
  if kind == 'safetensors':
    values = _read_safetensors(path, adapters, where)
  else:
    values = _read_orbax(path, adapters, list(rec['adapters']))
  items = [(keys, boxed_like(leaf, values[p]))
           for p, (keys, leaf) in adapters.items()]
  return res, set_many(res.params, items)


def _check_model(params, rec: dict, where: str) -> None:
  """The params given are those of the model the adapters were made for:
  each leaf of the file's model is here with its type, and no other (the
  leaves ``lora`` adds and those it trains are left to the adapter check)."""
  model, saved = rec['model'], rec['adapters']
  here = {p: type_str(unboxed(leaf)) for p, (_, leaf) in
          leaves(params).items()}
  quantized = sorted(p for p in model if p.endswith('_scale')
                     and p not in here)
  hint = ('; the file\'s model was quantized before lora (it holds '
          f'{quantized[0]}): quantize this model the same way first (q = '
          'yax.quantize(...)), then load_lora(q.mox, q.params, path)'
          if quantized else '')
  for p, t in here.items():
    want = model.get(p, saved.get(p))
    if want is None:
      raise AdapterFileError(
          f'load_lora: {where} was made for another model: these params '
          f'hold params[{p!r}] ({t}), which that model did not have{hint}')
    if want != t:
      raise AdapterFileError(
          f'load_lora: {where} was made for another model: params[{p!r}] '
          f'is {t} here and {want} in that model{hint}')


def _check_adapters(adapters: dict, others: dict, rec: dict,
                    where: str) -> None:
  """The adapters ``lora`` made again are the file's, path by path and
  type by type, and the rest of the params is the file's model's."""
  saved = rec['adapters']
  for p, (_, leaf) in adapters.items():
    if p not in saved:
      raise AdapterFileError(
          f'load_lora: the adapter params[{p!r}] '
          f'({type_str(unboxed(leaf))}) is missing from {where} (lora with '
          f'its recorded arguments {rec["lora"]} made it here; the file '
          f'holds {len(saved)} adapters)')
    if saved[p] != type_str(unboxed(leaf)):
      raise AdapterFileError(
          f'load_lora: the adapter params[{p!r}] is {saved[p]} in {where} '
          f'but lora made it {type_str(unboxed(leaf))} on this model')
  for p, t in saved.items():
    if p not in adapters:
      raise AdapterFileError(
          f'load_lora: {where} holds an adapter params[{p!r}] ({t}) that '
          f'lora with its recorded arguments {rec["lora"]} does not make '
          'on this model')
  for p, (_, leaf) in others.items():
    want = rec['model'].get(p)
    if want != type_str(unboxed(leaf)):
      raise AdapterFileError(
          f'load_lora: {where} was made for another model: after lora, '
          f'params[{p!r}] is {type_str(unboxed(leaf))} here and '
          f'{want or "absent"} in that model')


def _placed(value: np.ndarray, like):
  """``value`` on the devices (and sharding) of the leaf it replaces."""
  sharding = getattr(unboxed(like), 'sharding', None)
  return jax.device_put(value, sharding) if sharding is not None else (
      jax.device_put(value))


def _read_safetensors(path: str, adapters: dict, where: str) -> dict:
  st = _safetensors()
  with open(path, 'rb') as f:
    data = f.read()
  out = {}
  for name, info in st.deserialize(data):
    if name not in adapters:
      continue  # _check_adapters compared the record with the adapters
    dtype = _SAFETENSORS_DTYPES.get(info['dtype'])
    if dtype is None:
      raise AdapterFileError(
          f'load_lora: {where} holds {name!r} as {info["dtype"]}, a dtype '
          f'this reader does not know ({sorted(_SAFETENSORS_DTYPES)})')
    value = np.frombuffer(info['data'], dtype=jax.numpy.dtype(dtype))
    value = value.reshape(info['shape'])
    (_, leaf) = adapters[name]
    if type_str(value) != type_str(unboxed(leaf)):
      raise AdapterFileError(
          f'load_lora: in {where} the tensor {name!r} is {type_str(value)} '
          f'but its record says {type_str(unboxed(leaf))}')
    out[name] = _placed(value, leaf)
  missing = sorted(adapters.keys() - out.keys())
  if missing:
    raise AdapterFileError(
        f'load_lora: {where} records the adapter params[{missing[0]!r}] but '
        'holds no tensor under that name')
  return out


def _read_orbax(path: str, adapters: dict, names: list) -> dict:
  """The adapters, each process reading its own shards; ``names``: the
  params paths in the order the file's items are numbered."""
  ocp = _orbax()
  target = {}
  for i, p in enumerate(names):
    value = unboxed(adapters[p][1])
    target[f'a{i}'] = jax.ShapeDtypeStruct(value.shape, value.dtype,
                                           sharding=value.sharding)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
    got = ckpt.restore(os.path.abspath(path), args=ocp.args.Composite(
        adapters=ocp.args.StandardRestore(target))).adapters
  return {p: got[f'a{i}'] for i, p in enumerate(names)}
