"""yax.to_model_explorer and `yax explorer`: the graph built with Model
Explorer's own classes, and the package's server showing it in Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from yax._src.ir.nodes import Literal, leaf_equations
from yax._src.report import explorer as _explorer
from yax._src.report import summary as _summary

graph_builder = pytest.importorskip(
    'model_explorer.graph_builder',
    reason='the explorer extra (ai-edge-model-explorer) is not installed')

FACTORY = '''
import jax.numpy as jnp
from transformers import BertConfig, FlaxBertModel


def factory():
  model = FlaxBertModel(BertConfig(
      vocab_size=99, hidden_size=16, num_hidden_layers=12, num_attention_heads=2,
      intermediate_size=20, max_position_embeddings=32), seed=0)
  ids = jnp.ones((1, 8), jnp.int32)
  return model.__call__, (ids,), {'params': model.params}
'''


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(5, name='hidden')(x))
    return nn.Dense(3, name='out')(h) * 2.0


@pytest.fixture(scope='module')
def mlp():
  m = MLP()
  x = jnp.ones((2, 4))
  variables = m.init(jax.random.key(0), x)
  return yax.make_mox(m.apply)(variables, x), variables


def test_graph_nodes_namespaces_edges_and_attributes(mlp):
  mox, variables = mlp
  graph = yax.to_model_explorer(mox)
  assert isinstance(graph, graph_builder.Graph)
  assert all(isinstance(n, graph_builder.GraphNode) for n in graph.nodes)
  by_id = {n.id: n for n in graph.nodes}
  # One node per equation, in the namespace of its module call.
  eqns = list(leaf_equations(mox))
  ops = [n for n in graph.nodes if n.namespace not in ('inputs', 'outputs')
         and not any(a.key == 'variable' for a in n.attrs)]
  assert [n.label.split('[')[0] for n in ops] == [e.prim.name for e in eqns]
  owner = {}
  for call in _summary.module_calls(mox):
    for e in leaf_equations(call):
      owner[id(e)] = '/'.join(call.path)  # pre-order: innermost wins
  # Equations of the outermost module have namespace '' (its path is ()).
  assert [n.namespace for n in ops] == [owner.get(id(e), '') for e in eqns]
  assert {n.namespace for n in ops} == {'', 'hidden', 'out'}
  # Variables: one node each, labelled by name, in their module's namespace.
  var_nodes = {(n.namespace, n.label) for n in graph.nodes
               if any(a.key == 'variable' for a in n.attrs)}
  assert var_nodes == {(m, k) for m, d in variables['params'].items() for k in d}
  # Edges follow the data: every non-literal input of an equation comes
  # from the node that produced it, at the right output index.
  made = {}
  for n in graph.nodes:
    for meta in n.outputsMetadata:
      made[(n.id, meta.id)] = {a.key: a.value for a in meta.attrs}
  for node, e in zip(ops, eqns):
    wanted = [k for k, s in enumerate(e.inputs) if not isinstance(s, Literal)]
    assert [int(edge.targetNodeInputId) for edge in node.incomingEdges] == wanted
    for edge in node.incomingEdges:
      s = e.inputs[int(edge.targetNodeInputId)]
      assert made[(edge.sourceNodeId, edge.sourceNodeOutputId)]['shape'] == s.type_str
      assert edge.sourceNodeId in by_id
  # The dot_general of `hidden` reads the input node and the kernel node.
  (dot,) = [n for n in ops if n.label == 'dot_general' and n.namespace == 'hidden']
  sources = {by_id[e.sourceNodeId].label for e in dot.incomingEdges}
  assert sources == {'input', 'kernel'}
  attrs = {a.key: a.value for a in dot.attrs}
  assert attrs['primitive'] == 'dot_general' and 'dimension_numbers' in attrs
  # Layers carry the module's type, parameter count and attributes.
  groups = graph.groupNodeAttributes
  assert groups['hidden']['type'] == 'Dense' and groups['hidden']['features'] == '5'
  assert groups['hidden']['params'] == str(4 * 5 + 5)
  assert groups['hidden']['kernel_init'] == \
      "variance_scaling(1.0, 'fan_in', 'truncated_normal')"
  # The output node reads the last multiply.
  (out,) = [n for n in graph.nodes if n.namespace == 'outputs']
  assert by_id[out.incomingEdges[0].sourceNodeId].label == 'mul'


TABLE = np.arange(4.0, dtype=np.float32)  # closed over: a root constant


class Scaled(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name='fc')(x) * TABLE


def test_every_value_has_its_producer_root_constants_included():
  m, closure = Scaled(), nn.Dense(4)
  x = jnp.ones((2, 4))
  variables = m.init(jax.random.key(0), x)
  closed = closure.init(jax.random.key(1), x)  # its weights: constants too
  mox = yax.make_mox(lambda v, x: closure.apply(closed, m.apply(v, x)))(
      variables, x)
  assert len(mox.consts) == 3
  graph = yax.to_model_explorer(mox)
  by_id = {n.id: n for n in graph.nodes}
  made = {(n.id, meta.id) for n in graph.nodes for meta in n.outputsMetadata}
  # Independently of the graph: every (equation, input position) that reads
  # a value (not a literal), and every root output.
  reads = [(e, k) for e in leaf_equations(mox)
           for k, s in enumerate(e.inputs) if not isinstance(s, Literal)]
  ops = [n for n in graph.nodes if 'primitive' in {a.key for a in n.attrs}]
  assert len(ops) == len(list(leaf_equations(mox)))
  edges = [(n.id, int(edge.targetNodeInputId)) for n in ops
           for edge in n.incomingEdges]
  assert len(edges) == len(reads)
  for n in graph.nodes:
    for edge in n.incomingEdges:
      assert (edge.sourceNodeId, edge.sourceNodeOutputId) in made
  (out,) = [n for n in graph.nodes if n.namespace == 'outputs']
  assert len(out.incomingEdges) == 1
  # The closed-over array is a node of its own, with its values; the
  # closure module's weights are variable nodes.
  (const,) = [n for n in graph.nodes if n.namespace == 'constants']
  attrs = {a.key: a.value for a in const.attrs}
  assert attrs['type'] == 'f32[4]' and attrs['value'] == '[0., 1., 2., 3.]'
  (reader,) = [e for e, _ in reads if mox.constvars[0] in e.inputs]
  (node,) = [n for n, e in zip(ops, leaf_equations(mox)) if e is reader]
  assert const.id in {e.sourceNodeId for e in node.incomingEdges}
  const_vars = sorted(n.label for n in graph.nodes
                      if {'variable', 'constant'} <= {a.key for a in n.attrs})
  assert const_vars == ['bias', 'kernel']
  assert all(by_id[e.sourceNodeId] for n in ops for e in n.incomingEdges)


def test_graph_json_is_a_graph_collection(mlp, tmp_path):
  mox, _ = mlp
  path = _explorer.write_graph(mox, tmp_path / 'mlp.json', graph_id='mlp')
  data = json.loads(open(path).read())
  assert data['label'] == 'mlp' and data['graphs'][0]['id'] == 'mlp'
  assert len(data['graphs'][0]['nodes']) == len(yax.to_model_explorer(mox).nodes)


# ------------------------------------------------------------ the server

def _chromium():
  for name in ('/usr/bin/chromium', 'chromium', 'chromium-browser'):
    if shutil.which(name):
      return shutil.which(name)
  return None


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def test_explorer_server_renders_top_level_layers(tmp_path):
  sync_api = pytest.importorskip('playwright.sync_api')
  exe = _chromium()
  if exe is None:
    pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
  pytest.importorskip('transformers')
  (tmp_path / 'bert12.py').write_text(FACTORY)
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS='cpu', USE_TORCH='0', USE_FLAX='1',
             PYTHONWARNINGS='ignore', PYTHONUNBUFFERED='1')
  proc = subprocess.Popen(
      [sys.executable, '-m', 'yax', 'explorer', '--no-browser', '--host',
       '127.0.0.1', '--port', str(port), 'bert12.py'],
      cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True)
  try:
    url, lines = None, []
    deadline = time.monotonic() + 300
    while url is None and time.monotonic() < deadline:
      line = proc.stdout.readline()
      if not line:
        break
      lines.append(line)
      m = re.match(r'(http://127\.0\.0\.1:\d+/\S*)', line.strip())
      if m:
        url = m.group(1)
    assert url is not None, ''.join(lines)
    with sync_api.sync_playwright() as p:
      browser = p.chromium.launch(executable_path=exe, args=[
          '--headless', '--no-sandbox', '--disable-gpu', '--no-first-run',
          '--disable-background-networking', '--disable-component-update',
          '--disable-sync', '--enable-unsafe-swiftshader'])
      page = browser.new_page(viewport={'width': 1400, 'height': 860})
      page.goto(url)
      page.wait_for_selector('text=GRAPH INFO', timeout=120_000)
      # The graph info panel shows the graph yax built.
      info = page.locator('text=GRAPH INFO').locator('xpath=../..').inner_text()
      assert 'module calls' in info and '239' in info
      page.screenshot(path=str(tmp_path / 'explorer.png'))
      keep = os.environ.get('YAX_EXPLORER_PNG')
      if keep:
        shutil.copyfile(tmp_path / 'explorer.png', keep)
      # Every top-level module is a layer at the top of the graph: Model
      # Explorer's search finds it as a group node directly under <root>.
      for name in ('embeddings', 'encoder', 'pooler'):
        page.fill('input[placeholder*="Search nodes"]', f'^{name}$')
        item = page.locator(f'mat-tree-node[data-id="{name}___group___"]')
        item.wait_for(timeout=30_000)
        assert item.get_attribute('aria-level') == '2'  # under <root>
      browser.close()
  finally:
    proc.terminate()
    proc.wait(timeout=30)
