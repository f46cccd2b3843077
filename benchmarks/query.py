"""XPath query and XML export timings on full-size BERT-base.

Run: ``python benchmarks/query.py`` (about a minute on 2 CPU cores; no
downloads: the model is built from ``BertConfig()`` with random weights).

Prints, in one run: the first query (including building the XML view), the
warm median of ``//module_call[@type="Dense"]`` (goal: <= 2 ms) and of
``//module_call``, an XPath 2.0 query on elementpath, ``dump_xml`` time and
size, ``to_json`` / ``dump_yson`` times, and how a query with a
100,000-character name test scales against a 10,000-character one.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import time

os.environ.setdefault('USE_TORCH', '0')
os.environ.setdefault('USE_FLAX', '1')

import jax.numpy as jnp  # noqa: E402

import yax  # noqa: E402
from yax._src.views import serialize as _serialize  # noqa: E402

DENSE = '//module_call[@type="Dense"]'


def median_ms(fn, repeat: int) -> float:
  times = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


def main(argv: list[str]) -> None:
  from transformers import BertConfig, FlaxBertModel

  t0 = time.perf_counter()
  model = FlaxBertModel(BertConfig(), seed=0)
  ids = jnp.ones((1, 128), jnp.int32)
  t1 = time.perf_counter()
  mox = yax.make_mox(lambda p, x: model(x, params=p))(model.params, ids)
  t2 = time.perf_counter()
  num_modules = sum(1 for n in yax.map_mox(lambda n: n, mox)
                    if isinstance(n, yax.Mox) and not n.is_ephemeral)
  print(f'model: FlaxBertModel(BertConfig()) built in {t1 - t0:.1f} s, '
        f'traced in {t2 - t1:.2f} s, {num_modules} module calls')

  # A fresh tree object each time, so the view is built again.
  rows = []
  t0 = time.perf_counter()
  dense = yax.query(DENSE, mox)
  first = (time.perf_counter() - t0) * 1e3
  view = _serialize.xml_view(mox)
  rows.append(('first query (builds the XML view)', first, ''))
  rebuild = median_ms(lambda: _serialize.build_view(mox), 5)
  rows.append(('XML view rebuild (node attrs cached)', rebuild, ''))
  warm = median_ms(lambda: yax.query(DENSE, mox), 200)
  rows.append((f'warm {DENSE}', warm,
               f'{len(dense)} results; goal <= 2 ms: '
               f'{"OK" if warm <= 2 else "MISSED"}'))
  every = yax.query('//module_call', mox)
  rows.append(('warm //module_call', median_ms(
      lambda: yax.query('//module_call', mox), 100), f'{len(every)} results'))
  rows.append(('warm count(//*)', median_ms(
      lambda: yax.query('count(//*)', mox), 100),
      f'{int(yax.query("count(//*)", mox))} elements'))
  xpath2 = '//module_call[matches(@path, "attention")]'
  t0 = time.perf_counter()
  att = yax.query(xpath2, mox)
  first2 = (time.perf_counter() - t0) * 1e3
  rows.append(('XPath 2.0 first (elementpath, builds node tree)', first2,
               f'{len(att)} results'))
  rows.append((f'XPath 2.0 warm {xpath2}', median_ms(
      lambda: yax.query(xpath2, mox), 5), 'elementpath'))

  def dump():
    buf = io.StringIO()
    yax.dump_xml(mox, buf)
    return buf

  size = len(dump().getvalue()) / 1e6
  rows.append(('dump_xml (indent=2)', median_ms(dump, 5), f'{size:.2f} MB'))
  rows.append(('to_json', median_ms(lambda: mox.to_json(), 5),
               f'{len(mox.to_json()) / 1e6:.2f} MB'))
  try:
    ybuf = io.BytesIO()
    yax.dump_yson(mox, ybuf)
    rows.append(('dump_yson (indent=2)', median_ms(
        lambda: yax.dump_yson(mox, io.BytesIO()), 3),
        f'{len(ybuf.getvalue()) / 1e6:.2f} MB'))
  except yax.YaxError as e:
    rows.append(('dump_yson', float('nan'), str(e)))

  width = max(len(r[0]) for r in rows)
  print(f'{"measurement":<{width}}  {"ms":>9}  notes')
  for name, ms, note in rows:
    print(f'{name:<{width}}  {ms:9.2f}  {note}')
  print(f'ratio XPath 2.0 warm / XPath 1.0 warm: '
        f'{median_ms(lambda: yax.query(xpath2, mox), 3) / warm:.0f}x')
  # A name test 10x longer should cost about 10x (linear), not 100x.
  def long_name(n):
    expr = '//' + 'a' * n + '/' + 'a' * n
    return median_ms(lambda: yax.query(expr, mox), 3)
  short, long = long_name(10_000), long_name(100_000)
  print(f'query with two 100,000-character name tests: {long:.1f} ms; '
        f'/ 10,000 characters: {long / short:.1f}x (linear: ~10x)')
  del view


if __name__ == '__main__':
  main(sys.argv[1:])
