"""The HTML viewer, end to end in a real headless Chromium.

Needs Debian's ``chromium`` (``apt-get install -y chromium``) and the Python
``playwright`` package (``pip install playwright``; its own browser download,
``playwright install``, is never used). Skipped, with the reason, when either
is missing. Set ``YAX_VIEWER_PNG=/some/path.png`` to keep a screenshot.
"""

from __future__ import annotations

import os
import re
import shutil

import hypothesis
import pytest
from hypothesis import strategies as st

import yax
from yax._src.report import html as _html
from yax._src.report import summary as _summary
from yax._src.views import query as _query

CHROMIUM_ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic',
                 '--no-first-run', '--disable-background-networking',
                 '--disable-component-update', '--disable-sync']


def _chromium() -> str | None:
  for name in ('/usr/bin/chromium', 'chromium', 'chromium-browser'):
    found = shutil.which(name)
    if found:
      return found
  return None


@pytest.fixture(scope='module')
def browser():
  sync_api = pytest.importorskip(
      'playwright.sync_api',
      reason='the playwright Python package is not installed (pip install playwright)')
  exe = _chromium()
  if exe is None:
    pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
  with sync_api.sync_playwright() as p:
    b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
    try:
      yield b
    finally:
      b.close()


@pytest.fixture(scope='module')
def bert():
  os.environ.setdefault('USE_TORCH', '0')
  transformers = pytest.importorskip('transformers')
  import jax.numpy as jnp
  config = transformers.BertConfig(
      vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=37, max_position_embeddings=64)
  model = transformers.FlaxBertModel(config, seed=0)
  ids = jnp.ones((1, 8), dtype=jnp.int32)
  return yax.make_mox(model.__call__)(ids, params=model.params)


def _open(browser, path):
  page = browser.new_page(viewport={'width': 1400, 'height': 860})
  errors, requests = [], []
  page.on('pageerror', lambda e: errors.append(str(e)))
  page.on('console', lambda m: errors.append(m.text) if m.type == 'error' else None)
  page.on('request', lambda r: requests.append(r.url))
  page.goto(path.as_uri())
  page.wait_for_selector('body[data-ready="true"]', timeout=30_000)
  return page, errors, requests


def _search(page, xpath):
  page.fill('#search', xpath)
  page.press('#search', 'Enter')
  page.wait_for_function(
      '() => document.getElementById("count").textContent !== ""')
  return page.text_content('#count')


def _row(page, i):
  return page.locator(f'li[data-id="{i}"] > .row')


@pytest.mark.parametrize('compress', [True, False], ids=['gzip', 'plain'])
def test_viewer_tree_details_and_search(browser, bert, tmp_path, compress):
  path = tmp_path / 'bert.html'
  _html.write_html(bert, path, title='FlaxBertModel', compress=compress)
  page, errors, requests = _open(browser, path)
  nodes = _html._nodes(bert)

  # The root and the single top module are open; the encoder is not.
  (encoder,) = [i for i, n in enumerate(nodes)
                if isinstance(n, yax.Mox) and n.path == ('encoder',)]
  assert _row(page, encoder).is_visible()
  assert page.locator(f'li[data-id="{encoder}"] li').count() == 0

  # Expanding renders the children (module calls only by default).
  _row(page, encoder).locator('.tw').click()
  children = [i for i, n in enumerate(nodes) if n in nodes[encoder].children
              and isinstance(n, yax.Mox)]
  for i in children:
    assert _row(page, i).is_visible()

  # Selecting a node shows its attributes and its Jaxpr text, str(node).
  (layer0,) = [i for i, n in enumerate(nodes) if isinstance(n, yax.Mox)
               and n.path == ('encoder', 'layer', '0')]
  _row(page, children[0]).locator('.tw').click()
  _row(page, layer0).click()
  assert page.text_content('#details pre.jaxpr') == str(nodes[layer0])
  assert 'encoder/layer/0' in page.text_content('#details table.kv')

  # XPath in the browser: the same matches as yax.query on the same tree.
  dense = '//module_call[@type="Dense"]'
  count = _search(page, dense)
  n = len(yax.query(dense, bert))
  assert n > 0
  assert count == f'1 of {n}'  # Enter ran the search and went to match 1
  assert int(page.get_attribute('#count', 'data-count')) == n
  assert page.locator('#results .item').count() == n
  # Enter revealed the first match: selected, highlighted, scrolled to.
  first = nodes.index(yax.query(dense, bert)[0])
  assert 'hit' in _row(page, first).get_attribute('class')
  assert 'sel' in _row(page, first).get_attribute('class')
  assert page.locator('.row.hit').count() >= 1
  page.screenshot(path=str(tmp_path / 'viewer.png'))
  keep = os.environ.get('YAX_VIEWER_PNG')
  if keep and compress:
    shutil.copyfile(tmp_path / 'viewer.png', keep)

  # Equations appear when asked for; an equation match switches them on.
  assert page.locator('.row.eq').count() == 0
  _search(page, '//dot_general')
  assert page.is_checked('#show-eqns')
  assert page.locator('.row.eq.hit').count() >= 1

  for xpath in ['//dot_general', '//input[@var]', '//*[@name="gelu"]',
                '//module_call[@type="Dense"]/@features', '//[@method="__call__"]',
                '//module_call[@path="encoder/layer/1"]//output']:
    want = len(yax.query(xpath, bert))
    _search(page, xpath)
    assert int(page.get_attribute('#count', 'data-count')) == want, xpath

  # Atomic results are shown as values; invalid expressions as errors.
  assert _search(page, 'count(//module_call)') == \
      f'= {yax.query("count(//module_call)", bert):g}'
  assert _search(page, '//module_call[') == 'invalid XPath'
  assert 'bad' in page.get_attribute('#search', 'class').split()

  assert errors == []
  assert all(u.startswith(('file:', 'data:', 'blob:')) for u in requests), requests
  page.close()


def _scan_mox():
  """A model with module calls inside an nn.scan body, and one after it."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  class Cell(nn.Module):
    @nn.compact
    def __call__(self, c, x):
      c = nn.Dense(4)(nn.relu(nn.Dense(4)(c))) + x
      return c, c

  class Model(nn.Module):
    @nn.compact
    def __call__(self, xs):
      scan = nn.scan(Cell, variable_broadcast='params',
                     split_rngs={'params': False}, length=3)
      return nn.Dense(2)(scan(name='rnn')(xs[0], xs)[0])

  m = Model()
  xs = jnp.ones((3, 4))
  return yax.make_mox(m.apply)(m.init(jax.random.key(0), xs), xs)


def test_viewer_nested_bodies(browser, tmp_path):
  """Module calls inside nn.scan bodies (equation children) are in the tree."""
  mox = _scan_mox()
  path = tmp_path / 'scan.html'
  _html.write_html(mox, path)
  page, errors, _ = _open(browser, path)
  dense = '//module_call[@type="Dense"]'
  assert _search(page, dense) == f'1 of {len(yax.query(dense, mox))}'
  nodes = _html._nodes(mox)
  (cell,) = [i for i, n in enumerate(nodes) if isinstance(n, yax.Mox)
             and n.path == ('rnn', 'Dense_0')]
  assert _row(page, cell).is_visible()  # revealed through the scan body
  assert errors == []
  page.close()


# --------------------------------------------- any title, any field text

ODD_TEXTS = [
    '</script><script>throw new Error("x")</script>',
    '<!-- a comment that never ends',
    '<!--<script>',
    '@@TITLE@@ @@CSS@@ @@JS@@ @@DATA@@',
    '"quotes" \'and\' \\backslashes\\ & &amp; ]]> <![CDATA[',
    'controls \x00\x01\x08\x0b\x1f\x7f and lines \u2028\u2029',
    'lone surrogate \udc80 and \ud83d',
    'emoji \U0001F600 and \ufeff BOM',
]


def _odd_mox(text):
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  class Labelled(nn.Module):
    label: str = ''

    @nn.compact
    def __call__(self, x):
      return nn.Dense(2)(x)

  m = Labelled(label=text)
  x = jnp.ones((1, 3))
  return yax.make_mox(m.apply)(m.init(jax.random.key(0), x), x)


@pytest.mark.parametrize('compress', [True, False], ids=['gzip', 'plain'])
@pytest.mark.parametrize('text', ODD_TEXTS, ids=range(len(ODD_TEXTS)))
def test_viewer_loads_for_any_title_and_field_text(browser, tmp_path, text,
                                                   compress):
  mox = _odd_mox(text)
  path = tmp_path / 'odd.html'
  _html.write_html(mox, path, title=text, compress=compress)
  page, errors, requests = _open(browser, path)  # waits for data-ready
  assert errors == []
  # The title is shown as the text it is, never read as markup or template
  # (characters a document cannot hold, such as NUL or a lone surrogate,
  # as Python escapes: \x00, \udc80).
  shown = re.sub('[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]',
                 lambda m: m.group().encode('unicode_escape').decode(), text)
  assert page.text_content('#title') == shown
  assert page.locator('#yax-data').count() == 1
  assert page.locator('script').count() == 2  # the data and the viewer
  # The page holds the data: its XPath finds the module and the field
  # (as dump_xml wrote it).
  assert _search(page, '//module_call[@type="Labelled"]') == '1 of 1'
  label = 'string(//module_call[@type="Labelled"]/@label)'
  assert _search(page, label) == f'= "{yax.query(label, mox)}"'
  assert all(u.startswith(('file:', 'data:', 'blob:')) for u in requests)
  page.close()


def test_embedded_json_is_json_and_never_markup():
  """Without a browser: the plain payload parses as JSON to the same data,
  and holds no character the HTML parser reads inside <script>."""
  import json
  mox = _odd_mox(ODD_TEXTS[0] + ODD_TEXTS[1])
  for text in ODD_TEXTS:
    page = _html.render_html(mox, title=text, compress=False)
    (body,) = re.findall(r'<script id="yax-data"[^>]*>(.*?)</script>', page,
                         re.S)
    assert not set('<>&') & set(body)
    assert json.loads(body) == json.loads(json.dumps(
        _html.payload(mox, title=text)))
    # The template markers appear once each in the template, and a title
    # that spells them is not substituted again.
    assert page.count('<style>') == 1 and page.count('id="yax-data"') == 1


def test_payload_counts_each_nodes_flops():
  """The payload's FLOPs, summed bottom-up, are each node's own count
  (:func:`yax._src.report.summary.flops`, which walks the node's subtree)."""
  mox = _scan_mox()
  nodes = _html._nodes(mox)
  flops = _html.payload(mox)['flops']
  assert flops == [_summary.flops(n) for n in nodes]
  assert flops[0] > 0 and len(set(flops)) > 2


# ------------------------------------------ one shorthand rule, both sides

def _js_function(name: str) -> str:
  """The source of a top-level function of viewer.js (and the constants it
  reads), to run on its own in a blank page."""
  js = _html.viewer_file('viewer.js')
  (space,) = re.findall(r'^const XPATH_SPACE = .*;$', js, re.M)
  (body,) = re.findall(rf'^function {name}\(.*?^}}$', js, re.M | re.S)
  return space + '\n' + body


@pytest.fixture(scope='module')
def blank_page(browser):
  page = browser.new_page()
  yield page
  page.close()


# Characters that matter to the rule (quotes, slashes, brackets, XPath
# white space) and some that white space rules disagree on: Python's
# str.isspace takes \x1c and \x85, JavaScript's trim takes \ufeff, neither
# is XPath white space.
_SHORTHAND_TEXT = st.text(st.sampled_from(
    list('/[]*@"\'ab=1 \t\r\n') + ['\x0b', '\x1c', '\x85', '\xa0',
                                   '\u2028', '\ufeff']), max_size=12)


@hypothesis.settings(max_examples=60, deadline=None,
                     suppress_health_check=[
                         hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.example(queries=['//[@a="1"]', "a / [1]", '//*[@a="/["]',
                             "x/\x1c[1]", "x/\ufeff[1]", "x/\n\t[1]"])
@hypothesis.given(queries=st.lists(_SHORTHAND_TEXT, min_size=1, max_size=20))
def test_rewrite_shorthand_is_the_same_in_the_browser(blank_page, queries):
  """viewer.js's ``rewriteShorthand`` and ``yax._src.views.query.rewrite_shorthand``
  rewrite every text alike."""
  source = _js_function('rewriteShorthand')
  in_browser = blank_page.evaluate(
      f'(qs) => {{ {source}\n return qs.map(rewriteShorthand); }}', queries)
  assert in_browser == [_query.rewrite_shorthand(q)[0] for q in queries]


# ------------------------------------------------- navigation and data flow

def _index(mox):
  """(nodes in page order, parent index of each) as the viewer numbers them."""
  nodes = _html._nodes(mox)
  where = {id(n): i for i, n in enumerate(nodes)}
  parent = [-1] * len(nodes)
  for i, n in enumerate(nodes):
    for c in getattr(n, 'children', ()):
      if id(c) in where:
        parent[where[id(c)]] = i
  return nodes, parent


def _ids(page, selector):
  return {int(x) for x in page.eval_on_selector_all(
      selector, 'els => els.map(e => e.closest("li").dataset.id)')}


def _selected(page):
  (i,) = _ids(page, '#tree .row.sel')
  return i


@pytest.fixture(scope='module')
def bert_page(browser, bert, tmp_path_factory):
  path = tmp_path_factory.mktemp('viewer') / 'bert.html'
  _html.write_html(bert, path, title='FlaxBertModel')
  page, errors, _ = _open(browser, path)
  yield page
  assert errors == []
  page.close()


def test_expand_all_and_collapse_all(bert_page, bert):
  page = bert_page
  nodes, _ = _index(bert)
  n_moxes = sum(isinstance(n, yax.Mox) for n in nodes)
  page.click('#expand')
  # Every module call (and the root) is a row, all of them visible.
  assert page.locator('#tree li').count() == n_moxes
  assert page.locator('#tree li[aria-expanded="false"]').count() == sum(
      isinstance(n, yax.Mox) and not any(isinstance(c, yax.Mox) for c in n.children)
      for n in nodes)
  page.click('#collapse')
  root_children = [c for c in bert.children if isinstance(c, yax.Mox)]
  assert page.locator('#tree li').count() == 1 + len(root_children)


def test_keyboard_navigation(bert_page, bert):
  page = bert_page
  nodes, parent = _index(bert)
  page.click('#collapse')
  _row(page, 0).click()
  (top,) = [i for i, n in enumerate(nodes) if parent[i] == 0 and isinstance(n, yax.Mox)]
  page.keyboard.press('ArrowDown')
  assert _selected(page) == top
  page.keyboard.press('ArrowRight')  # expands the top module
  kids = [i for i, n in enumerate(nodes) if parent[i] == top and isinstance(n, yax.Mox)]
  assert _ids(page, '#tree li') == {0, top, *kids}
  page.keyboard.press('ArrowRight')  # expanded: moves to the first child
  assert _selected(page) == kids[0]
  page.keyboard.press('End')
  assert _selected(page) == kids[-1]
  page.keyboard.press('ArrowLeft')   # a leaf: goes to its parent
  assert _selected(page) == top
  page.keyboard.press('Enter')       # collapses it again
  assert _ids(page, '#tree li') == {0, top}
  page.keyboard.press('ArrowUp')
  assert _selected(page) == 0
  page.keyboard.press('/')
  assert page.evaluate('document.activeElement.id') == 'search'


def test_shorthand_search_finds_what_yax_query_finds(bert_page, bert):
  """``//[@k=v]`` (a step with no node test) works in the page as in
  :func:`yax.query`."""
  n = len(yax.query('//*[@type="Dense"]', bert))
  assert n > 0
  assert _search(bert_page, '//[@type="Dense"]') == f'1 of {n}'
  assert len(yax.query('//[@type="Dense"]', bert)) == n


def test_match_counter_k_of_n(bert_page, bert):
  page = bert_page
  nodes, _ = _index(bert)
  dense = '//module_call[@type="Dense"]'
  matches = [nodes.index(m) for m in yax.query(dense, bert)]
  n = len(matches)
  assert _search(page, dense) == f'1 of {n}'  # Enter ran it and went to #1
  page.press('#search', 'Enter')
  assert page.text_content('#count') == f'2 of {n}'
  assert _ids(page, '#tree .row.cur') == {matches[1]}
  assert _selected(page) == matches[1]
  assert page.text_content('#results .item.cur').startswith('Dense ')
  page.press('#search', 'Shift+Enter')
  page.press('#search', 'Shift+Enter')
  assert page.text_content('#count') == f'{n} of {n}'  # wraps around
  assert _ids(page, '#tree .row.cur') == {matches[-1]}
  # The details header stays in view while the details scroll.
  page.evaluate('document.getElementById("details").scrollTop = 100000')
  head = page.locator('#details .head').bounding_box()
  pane = page.locator('#details').bounding_box()
  assert pane['y'] - 1 <= head['y'] <= pane['y'] + 1


def _expected_flow(nodes, parent, s):
  def related(a, b):
    def chain(k):
      while k >= 0:
        yield k
        k = parent[k]
    return a in chain(b) or b in chain(a)

  def outermost(ids):
    return {j for j in ids if not any(p in ids for p in _up(parent, j))}

  ins = {id(x) for x in nodes[s].inputs}
  outs = {id(x) for x in nodes[s].outputs}
  src = {j for j, n in enumerate(nodes)
         if not related(s, j) and ins & {id(x) for x in n.outputs}}
  dst = {j for j, n in enumerate(nodes)
         if not related(s, j) and outs & {id(x) for x in n.inputs}}

  def shown(j):  # everything expanded, equations hidden: nearest module call
    while not isinstance(nodes[j], yax.Mox):
      j = parent[j]
    return None if related(s, j) else j
  return ({shown(j) for j in outermost(src)} - {None},
          {shown(j) for j in outermost(dst)} - {None})


def _up(parent, j):
  j = parent[j]
  while j >= 0:
    yield j
    j = parent[j]


def test_data_flow_marks_producers_and_consumers(bert_page, bert):
  page = bert_page
  nodes, parent = _index(bert)
  page.fill('#search', '')
  page.click('#expand')
  by_path = {n.path: i for i, n in enumerate(nodes) if isinstance(n, yax.Mox)}
  for path in [('encoder', 'layer', '0', 'attention'),
               ('encoder', 'layer', '1'), ('embeddings', 'LayerNorm'),
               ('encoder', 'layer', '0', 'intermediate', 'dense')]:
    s = by_path[path]
    _row(page, s).click()
    src, dst = _expected_flow(nodes, parent, s)
    assert src or dst, path
    assert _ids(page, '#tree .row.prod') == src, path
    assert _ids(page, '#tree .row.cons') == dst, path
  # Layer 1 reads what layer 0 wrote, and layer 0 what the embeddings wrote.
  _row(page, by_path[('encoder', 'layer', '1')]).click()
  assert by_path[('encoder', 'layer', '0')] in _ids(page, '#tree .row.prod')
  # With the encoder collapsed, the encoder row stands for its hidden layers.
  _row(page, by_path[('encoder',)]).locator('.tw').click()
  _row(page, by_path[('embeddings',)]).click()
  cons = _ids(page, '#tree .row.cons')
  assert by_path[('encoder',)] in cons
  assert not cons & {by_path[('encoder', 'layer', '0')]}  # not rendered


@pytest.fixture(scope='module')
def bert12():
  transformers = pytest.importorskip('transformers')
  import jax.numpy as jnp
  config = transformers.BertConfig(
      vocab_size=99, hidden_size=16, num_hidden_layers=12, num_attention_heads=2,
      intermediate_size=20, max_position_embeddings=32)
  model = transformers.FlaxBertModel(config, seed=0)
  ids = jnp.ones((1, 8), dtype=jnp.int32)
  return yax.make_mox(model.__call__)(ids, params=model.params)


def test_screenshot_of_a_12_layer_model(browser, bert12, tmp_path):
  PIL = pytest.importorskip('PIL.Image')
  path = tmp_path / 'bert12.html'
  _html.write_html(bert12, path, title='FlaxBertModel (12 layers)')
  page, errors, _ = _open(browser, path)
  page.click('#expand')
  nodes, parent = _index(bert12)
  layers = [i for i, n in enumerate(nodes) if isinstance(n, yax.Mox)
            and n.path[:2] == ('encoder', 'layer') and len(n.path) == 3]
  assert len(layers) == 12
  _row(page, layers[5]).click()
  png = tmp_path / 'viewer12.png'
  page.screenshot(path=str(png))
  keep = os.environ.get('YAX_VIEWER_PNG')
  if keep:
    shutil.copyfile(png, keep)
  image = PIL.open(png).convert('L')
  lo, hi = image.getextrema()
  assert hi - lo > 100  # not blank: dark text on a light page
  # Rows fill the tree pane, each one line high and inside the viewport.
  pane = page.locator('#tree-pane').bounding_box()
  boxes = page.eval_on_selector_all('#tree li > .row', """rows => rows.map(r => {
      const b = r.getBoundingClientRect();
      return {y: b.y, height: b.height, text: r.textContent};})""")
  assert len(boxes) == sum(isinstance(n, yax.Mox) for n in nodes)
  inside = [b for b in boxes if pane['y'] <= b['y'] and
            b['y'] + b['height'] <= pane['y'] + pane['height']]
  assert len(inside) >= 20
  assert all(12 <= b['height'] <= 40 and b['text'].strip() for b in inside)
  # The deepest row is reachable: revealed, its type name is inside the pane.
  depth = [len(list(_up(parent, i))) for i in range(len(nodes))]
  deepest = max((i for i, n in enumerate(nodes) if isinstance(n, yax.Mox)),
                key=lambda i: depth[i])
  path_attr = '/'.join(nodes[deepest].path)
  _search(page, f'//module_call[@path="{path_attr}"]')
  assert _selected(page) == deepest
  ty = _row(page, deepest).locator('.ty').bounding_box()
  assert pane['x'] <= ty['x'] and ty['x'] + ty['width'] <= pane['x'] + pane['width']
  assert pane['y'] <= ty['y'] <= pane['y'] + pane['height']
  assert errors == []
  page.close()


# ------------------------------------------------ the memory report column

def _memory_model():
  """A Linen MLP block (LayerNorm, Dense, GELU, Dense) called twice, plain
  Flax, with its variables, input and a loss written by hand."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.gelu(nn.Dense(16, name='up')(nn.LayerNorm(name='ln')(x)))
      return x + nn.Dense(8, name='down')(h)

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Block(name='b1')(Block(name='b0')(x))

  model = Net()
  x = jax.random.normal(jax.random.key(1), (4, 8))
  v = model.init(jax.random.key(0), x)
  loss = lambda v, x: jnp.sum(jnp.square(model.apply(v, x)))
  return model, v, x, loss


def test_payload_saved_is_memory_reports():
  model, v, x, loss = _memory_model()
  mox = yax.make_mox(model.apply)(v, x)
  report = yax.memory_report(loss, v, x, xla=False)
  data = _html.payload(mox, memory=report)
  nodes = _html._nodes(mox)
  shown = {'/'.join(n.path) or f'<{n.type_name}>': data['saved'][i]
           for i, n in enumerate(nodes)
           if isinstance(n, yax.Mox) and not n.is_ephemeral}
  assert shown == report.by_path()
  # Equations carry none; the GELUs keep something of their own.
  assert all(s is None for s, n in zip(data['saved'], nodes)
             if not isinstance(n, yax.Mox))
  assert shown['b0/ln'] > 0 and shown['b0'] > 0
  assert data['memory'] == {'saved': report.total,
                            'unattributed': report.unattributed,
                            'training': report.training}
  assert 'saved' not in _html.payload(mox)  # no report, no column


def test_viewer_shows_saved_bytes(browser, tmp_path):
  model, v, x, loss = _memory_model()
  mox = yax.make_mox(model.apply)(v, x)
  report = yax.memory_report(loss, v, x, xla=False)
  path = tmp_path / 'memory.html'
  _html.write_html(mox, path, memory=report)
  page, errors, _ = _open(browser, path)
  nodes = _html._nodes(mox)
  (b0,) = [i for i, n in enumerate(nodes)
           if isinstance(n, yax.Mox) and n.path == ('b0',)]
  kept = report.by_path()['b0']
  # As the summary writes bytes (1,024 bytes: 1.0 KB).
  assert _row(page, b0).locator('.sv').text_content() == (
      _summary.human_bytes(kept) + ' saved')
  _row(page, b0).click()
  assert f'{kept:,} bytes saved for the backward pass' in page.text_content(
      '#details')
  assert 'saved for the backward pass, training' in page.text_content(
      '#status')
  assert errors == []
  page.close()
