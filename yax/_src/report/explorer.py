"""A MoX as a Google Model Explorer graph (the ``explorer`` extra).

:func:`to_model_explorer` builds the graph with the classes of the
``ai-edge-model-explorer`` package (``model_explorer.graph_builder``):

* one node per equation (``dot_general``, ``add``, ``jit`` ...; an equation
  with a body, such as ``jit`` or ``scan``, is one node), in evaluation
  order; its ``namespace`` is the path of the module call it belongs to
  (``encoder/layer/0/attention/self/query``), so Model Explorer nests the
  nodes in collapsible layers, one per module;
* one node per input of the traced function (namespace ``inputs``), per
  constant it closes over (namespace ``constants``) and per output
  (namespace ``outputs``); one node per module variable (an input, or a
  constant for a module reached through a closure), in the namespace of the
  module that owns it and labelled with its name (``kernel``): every value
  an edge carries has the node that produces it;
* data-flow edges: an edge from the node that computes a value to every
  node that reads it (values that only cross module boundaries go straight
  from producer to consumer);
* attributes: each node's primitive params (formatted as in the XML view)
  and its output types as output metadata (``shape``: ``f32[1,8,32]``);
  each layer's module type, method, parameter count and module attributes
  as group attributes (shown when the layer is selected).

:func:`serve` starts Model Explorer's local web server on the graph (what
``yax explorer`` runs).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

from yax._src.errors import YaxError
from yax._src.ir.nodes import Equation, Expr, Literal, Mox
from yax._src.ir.text import format_value
from yax._src.report import summary as _summary

_MAX_ATTR = 2000  # characters of an attribute value (Jaxprs can be long)


class ExplorerError(YaxError):
  """The ``explorer`` extra (``ai-edge-model-explorer``) is missing."""


def _graph_builder():
  try:
    from model_explorer import graph_builder
  except ImportError as e:
    raise ExplorerError(
        'Model Explorer needs the explorer extra: expected the '
        "ai-edge-model-explorer package, found none (pip install "
        "'yax-mox[explorer]')") from e
  return graph_builder


def _attr_text(value) -> str | None:
  text = format_value(value, bools='python')
  if text is not None and len(text) > _MAX_ATTR:
    text = text[:_MAX_ATTR] + ' ...'
  return text


def _const_text(value) -> str | None:
  """A constant's values when it is small (16 elements at most), else what
  the XML view shows for it (its type)."""
  try:
    import numpy as np
    array = np.asarray(value)
    if array.size <= 16 and array.dtype.kind in 'biufc':
      return np.array2string(array, separator=', ', threshold=16)
  except Exception:  # noqa: BLE001 - a PRNG key or other odd constant
    pass
  return _attr_text(value)


def _walk(node: Expr, path: str, out: list):
  """(equation, namespace) pairs in evaluation order."""
  for child in node.children:
    if isinstance(child, Mox):
      sub = '/'.join(child.path) if not child.is_ephemeral else path
      _walk(child, sub, out)
    else:
      out.append((child, path))


def to_model_explorer(mox: Mox, *, graph_id: str = 'yax'):
  """The tree as a ``model_explorer.graph_builder.Graph`` (see the module
  doc). Raises :class:`ExplorerError` when the extra is not installed."""
  gb = _graph_builder()
  graph = gb.Graph(id=graph_id)
  producer: dict[int, tuple[str, int]] = {}  # id(symbol) -> (node, output)
  names = {}
  counter = iter(range(1 << 62))

  def new_id():
    return str(next(counter))

  def metadata(symbols):
    items = []
    for k, s in enumerate(symbols):
      names.setdefault(id(s), f'%{len(names)}')
      items.append(gb.MetadataItem(id=str(k), attrs=[
          gb.KeyValue('tensor_name', names[id(s)]),
          gb.KeyValue('shape', s.type_str)]))
    return items

  def add_node(label, namespace, outputs, attrs=(), inputs=()):
    node = gb.GraphNode(id=new_id(), label=label, namespace=namespace)
    node.attrs = [gb.KeyValue(k, v) for k, v in attrs if v is not None]
    node.outputsMetadata = metadata(outputs)
    for k, s in enumerate(outputs):
      producer.setdefault(id(s), (node.id, k))
    literals = []
    for k, s in enumerate(inputs):
      if isinstance(s, Literal):
        literals.append(f'{k}: {_attr_text(s.value)}')
        continue
      source = producer.get(id(s))
      if source is not None:
        node.incomingEdges.append(gb.IncomingEdge(
            sourceNodeId=source[0], sourceNodeOutputId=str(source[1]),
            targetNodeInputId=str(k)))
    if literals:
      node.attrs.append(gb.KeyValue('literal inputs', ', '.join(literals)))
    graph.nodes.append(node)
    return node

  # Variables: a node in the namespace of the module that owns each one.
  owner: dict[int, tuple[str, str]] = {}
  for call in _summary.module_calls(mox):
    for collection, own in _summary.own_variables(call).items():
      for name, sym in own.items():
        key = name if collection == _summary.PARAMS else f'{collection}/{name}'
        owner.setdefault(id(sym), ('/'.join(call.path), key))
  var_ids = set(owner)
  for s in mox.inputs:
    if isinstance(s, Literal) or id(s) in producer:
      continue
    if id(s) in var_ids:
      namespace, key = owner[id(s)]
      add_node(key, namespace, [s], attrs=[('variable', key),
                                           ('type', s.type_str)])
    else:
      add_node('input', 'inputs', [s], attrs=[('type', s.type_str)])
  # Constants of the root (arrays the traced function closes over; the
  # variables of a module reached only through a closure): every value
  # has the node that produces it.
  for k, (s, value) in enumerate(zip(mox.constvars, mox.consts, strict=True)):
    if id(s) in producer:
      continue
    if id(s) in var_ids:
      namespace, key = owner[id(s)]
      add_node(key, namespace, [s], attrs=[('variable', key),
                                           ('constant', str(k)),
                                           ('type', s.type_str)])
    else:
      add_node('constant', 'constants', [s],
               attrs=[('constant', str(k)), ('type', s.type_str),
                      ('value', _const_text(value))])

  equations: list[tuple[Equation, str]] = []
  _walk(mox, '', equations)
  for eqn, namespace in equations:
    attrs = [('primitive', eqn.prim.name)]
    attrs += [(str(k), _attr_text(v)) for k, v in eqn.params.items()]
    label = eqn.prim.name
    if eqn.name and eqn.prim.name != eqn.name:
      label = f'{eqn.prim.name}[{eqn.name}]'
    add_node(label, namespace, eqn.outputs, attrs, eqn.inputs)

  for k, s in enumerate(mox.outputs):
    add_node('output', 'outputs', [], attrs=[('type', s.type_str),
                                             ('index', str(k))], inputs=[s])

  groups: dict[str, dict[str, str]] = {}
  for call in _summary.module_calls(mox):
    key = '/'.join(call.path)
    if not key or key in groups:
      continue  # a module called again (shared, helper methods): first call
    attrs = {'type': call.type_name or '', 'method': call.entrypoint or ''}
    n = _summary.param_count(call)
    if n:
      attrs['params'] = f'{n:,}'
    for k, v in call.params.items():
      text = _attr_text(v)
      if text is not None and k != 'name':
        attrs[str(k)] = text
    groups[key] = attrs
  n, nbytes = _summary.total_params(mox)
  groups[''] = {'params': f'{n:,} ({_summary.human_bytes(nbytes)})',
                'module calls': str(sum(1 for _ in _summary.module_calls(mox))),
                'equations': str(len(equations))}
  graph.groupNodeAttributes = groups
  return graph


def graph_json(graph, label: str = 'yax') -> str:
  """The JSON file Model Explorer's JSON loader opens: a
  ``GraphCollection`` (``{"label": ..., "graphs": [...]}``)."""
  collection = _graph_builder().GraphCollection(label=label, graphs=[graph])
  return json.dumps(dataclasses.asdict(collection))


def write_graph(mox: Mox, path, *, graph_id: str = 'yax') -> str:
  """Writes :func:`to_model_explorer` as a JSON file Model Explorer opens
  (also through its "upload" button); returns the path."""
  text = graph_json(to_model_explorer(mox, graph_id=graph_id), label=graph_id)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text)
  return str(path)


def serve(mox: Mox, *, name: str = 'model', host: str = 'localhost',
          port: int = 8080, open_browser: bool = True, graph_file=None):
  """Starts Model Explorer's local server on ``mox`` and blocks until
  Ctrl+C. The graph is written to ``graph_file`` (default: a temporary
  ``NAME.json``) and opened with the package's public API
  (``model_explorer.config().add_model_from_path`` and
  ``visualize_from_config``); port 8080 means the first free one from 8080
  on, as in Model Explorer."""
  _graph_builder()
  import model_explorer
  if graph_file is None:
    folder = tempfile.mkdtemp(prefix='yax-explorer-')
    graph_file = os.path.join(folder, f'{name}.json')
  write_graph(mox, graph_file, graph_id=name)
  # Model Explorer guesses TF.js for a .json file: name its JSON loader.
  config = model_explorer.config().add_model_from_path(
      str(graph_file), adapterId='builtin_json')
  model_explorer.visualize_from_config(
      config, host=host, port=port, no_open_in_browser=not open_browser)
