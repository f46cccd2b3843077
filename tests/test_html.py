"""The HTML viewer, end to end in a real headless Chromium.

Needs Debian's ``chromium`` (``apt-get install -y chromium``) and the Python
``playwright`` package (``pip install playwright``; its own browser download,
``playwright install``, is never used). Skipped, with the reason, when either
is missing. Set ``YAX_VIEWER_PNG=/some/path.png`` to keep a screenshot.
"""

from __future__ import annotations

import os
import shutil

import pytest

import yax
from yax import _html

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
  assert count == f'{n} matches'
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
    got = _search(page, xpath)
    assert got == f'{want} {"match" if want == 1 else "matches"}', xpath

  # Atomic results are shown as values; invalid expressions as errors.
  assert _search(page, 'count(//module_call)') == \
      f'= {yax.query("count(//module_call)", bert):g}'
  assert _search(page, '//module_call[') == 'invalid XPath'
  assert 'bad' in page.get_attribute('#search', 'class').split()

  assert errors == []
  assert all(u.startswith(('file:', 'data:', 'blob:')) for u in requests), requests
  page.close()


def test_viewer_nested_bodies(browser, tmp_path):
  """Module calls inside nn.scan bodies (equation children) are in the tree."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  class Cell(nn.Module):
    @nn.compact
    def __call__(self, c, x):
      c = nn.Dense(4)(c) + x
      return c, c

  class Model(nn.Module):
    @nn.compact
    def __call__(self, xs):
      scan = nn.scan(Cell, variable_broadcast='params',
                     split_rngs={'params': False}, length=3)
      return scan(name='rnn')(xs[0], xs)[0]

  m = Model()
  xs = jnp.ones((3, 4))
  mox = yax.make_mox(m.apply)(m.init(jax.random.key(0), xs), xs)
  path = tmp_path / 'scan.html'
  _html.write_html(mox, path)
  page, errors, _ = _open(browser, path)
  dense = '//module_call[@type="Dense"]'
  assert _search(page, dense) == f'{len(yax.query(dense, mox))} match'
  nodes = _html._nodes(mox)
  (cell,) = [i for i, n in enumerate(nodes) if isinstance(n, yax.Mox)
             and n.path == ('rnn', 'Dense_0')]
  assert _row(page, cell).is_visible()  # revealed through the scan body
  assert errors == []
  page.close()
