"""Views for notebooks: ``Mox._repr_html_`` (the viewer in a frame, its
texts bounded), ``yax.pformat(mox, depth=...)``, and the viewer writer and
summary printer on the public surface."""

from __future__ import annotations

import base64
import gzip
import html
import io
import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import yax


class Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(8)(jnp.tanh(nn.Dense(16)(x)))


class Stack(nn.Module):
  layers: int = 2

  @nn.compact
  def __call__(self, x):
    for i in range(self.layers):
      x = Block(name=f'block{i}')(x)
    return nn.Dense(3)(x)


def traced(layers=2):
  model = Stack(layers)
  x = jnp.ones((2, 8))
  return yax.make_mox(model.apply)(model.init(jax.random.key(0), x), x)


def page_data(page: str) -> dict:
  blob = re.search(r'data-encoding="gzip\+base64">([^<]*)</script>',
                   page).group(1)
  return json.loads(gzip.decompress(base64.b64decode(blob)))


def test_repr_html_is_the_viewer_in_a_frame():
  """Before, a notebook showed only ``repr``: Mox had no _repr_html_."""
  mox = traced()
  fragment = mox._repr_html_()
  assert fragment.startswith('<iframe srcdoc="')
  page = html.unescape(re.search(r'srcdoc="([^"]*)"', fragment).group(1))
  assert page == yax.render_html(mox, max_text=4000)
  assert '<script' not in fragment  # escaped: it runs inside the frame only
  data = page_data(page)
  assert data['totals']['module_calls'] == 8  # Stack, 2 Blocks, 4 + 1 Dense
  assert str(mox).startswith(data['texts'][0].rsplit('\n', 1)[0])


def test_repr_html_texts_are_bounded_on_a_deep_model():
  mox = traced(layers=12)
  whole = page_data(yax.render_html(mox))
  cut = page_data(html.unescape(re.search(
      r'srcdoc="([^"]*)"', mox._repr_html_()).group(1)))
  assert len(whole['texts']) == len(cut['texts'])
  assert max(map(len, whole['texts'])) > 4000
  for full, short in zip(whole['texts'], cut['texts']):
    if len(full) <= 4000:
      assert short == full
    else:
      kept, note = short.rsplit('\n', 1)
      assert full.startswith(kept) and len(kept) <= 4000
      assert note.startswith(f'... ({len(full) - len(kept):,} more characters')
  assert max(map(len, cut['texts'])) <= 4000 + 200
  # The tree itself (the XML the search runs on) is whole.
  assert cut['xml'] == whole['xml']


def test_pformat_folds_module_calls_below_depth():
  mox = traced()
  assert yax.pformat(mox) == str(mox)
  assert yax.pformat(mox, depth=10) == str(mox)
  text = yax.pformat(mox, depth=1)
  # The Stack's body shows; each call inside it shows its header and a
  # one-line body.
  assert text.count('module_call[') == 4  # Stack, block0, block1, Dense_0
  assert 'type=Stack' in text and text.count('type=Block') == 2
  folded = re.findall(r'folded\[equations=(\d+) module_calls=(\d+)\]', text)
  assert [int(c) for _, c in folded] == [2, 2, 0]
  assert len(text.splitlines()) < len(str(mox).splitlines()) / 2
  assert yax.pformat(mox, depth=0).count('module_call[') == 1
  with pytest.raises(yax.YaxError, match='depth must be an int'):
    yax.pformat(mox, depth=-1)


def test_viewer_writer_and_summary_printer_are_public(tmp_path):
  mox = traced()
  size = yax.write_html(mox, tmp_path / 'm.html', title='stack')
  assert size == (tmp_path / 'm.html').stat().st_size
  buf = io.StringIO()
  yax.print_summary(mox, file=buf, width=120)
  assert buf.getvalue() == yax.format_summary(mox, width=120)
  assert 'block0' in buf.getvalue()
