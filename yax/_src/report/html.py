"""A self-contained, interactive HTML viewer of a module expression.

``render_html(mox)`` returns one HTML page with everything inline (no
network, no external scripts or styles):

* a collapsible tree of module calls (and, on request, their equations) that
  shows type, name, path, output shapes and parameter counts; children are
  rendered only when a node is expanded, so BERT-size trees stay responsive;
  "expand all" / "collapse all"; rows deeper than 12 levels stop indenting
  (they show their level) and the pane scrolls horizontally;
* keyboard navigation: arrows move the selection (Left/Right collapse and
  expand), Enter toggles, Home/End jump, ``/`` focuses the search box;
* a details panel for the selected node, its header sticky: XML attributes,
  inputs and outputs, parameter count, FLOPs, the nodes its inputs come from
  and its outputs go to, and its Jaxpr text (``str(node)``);
* data flow: selecting a node marks the producers of its inputs (a green
  bar) and the consumers of its outputs (an orange bar) in the tree,
  at the nearest row that is shown; its own ancestors and descendants, which
  only pass the values through, are not marked;
* a search box that evaluates XPath 1.0 in the browser
  (``document.evaluate``) over the embedded XML view (the output of
  :func:`yax.dump_xml`), highlights the matches, and steps through them
  (Enter / Shift+Enter) with a ``k of n`` counter and the current match
  outlined.

The data (XML, Jaxpr texts, parameter and FLOP counts) is one JSON payload,
gzip-compressed and base64-encoded by default (Jaxpr texts repeat a lot: the
texts of BERT-base shrink from 2 MB to 0.2 MB) and decompressed in the
browser with ``DecompressionStream``; ``compress=False`` embeds plain JSON.

Tree nodes are numbered in XML document order, counting every element except
``input``/``output``: node ``k`` of the payload is the ``k``-th such element,
which is how XPath results in the browser map back to tree nodes.

The page itself (``viewer/page.html``, ``viewer.css``, ``viewer.js`` next to
this module) is package data, read with :mod:`importlib.resources`.
"""

from __future__ import annotations

import base64
import functools
import gzip
import html
import importlib.resources
import io
import json
import re

from yax._src.ir.nodes import Equation, Expr, Mox, register_view
from yax._src.ir.text import escape_text
from yax._src.report import summary as _summary
from yax._src.version import __version__
from yax._src.views.serialize import dump_xml, xml_view

_SYMBOL_TAGS = ('input', 'output')

# The page's files, in the folder ``viewer`` of this module's package.
_VIEWER = 'viewer'


@functools.cache
def viewer_file(name: str) -> str:
  """The text of one of the viewer's files (``page.html``, ``viewer.css``,
  ``viewer.js``)."""
  package = __name__.rpartition('.')[0]
  return (importlib.resources.files(package) / _VIEWER / name).read_text(
      encoding='utf-8')


def _nodes(mox: Expr) -> list[Expr]:
  """Tree nodes in XML document order (``input``/``output`` skipped)."""
  view = xml_view(mox)
  out = []
  for el in view.root.iter():
    if el.tag in _SYMBOL_TAGS:
      continue
    out.append(view.node(el, mox))
  return out


def _bounded(text: str, limit: int | None) -> str:
  """``text`` cut at ``limit`` characters (at a line end), with a note."""
  if limit is None or len(text) <= limit:
    return text
  cut = text.rfind('\n', 0, limit)
  cut = cut if cut > 0 else limit
  lines = text.count('\n', cut) + 1
  return (text[:cut] + f'\n... ({len(text) - cut:,} more characters, '
          f'{lines:,} lines: print the node, or yax.pformat(node, depth=...), '
          'for the whole text)')


def _saved_per_node(nodes: list[Expr], memory) -> list[int | None]:
  """The bytes each module call keeps for the backward pass: ``memory``'s
  row for its path (``<Type>`` at the root path), on the first call at
  that path (a report's row sums every call at its path); None
  elsewhere."""
  kept = memory.by_path()
  seen, out = set(), []
  for node in nodes:
    path = None
    if isinstance(node, Mox) and not node.is_ephemeral:
      path = '/'.join(node.path) or f'<{node.type_name}>'
    if path is None or path in seen or path not in kept:
      out.append(None)
      continue
    seen.add(path)
    out.append(kept[path])
  return out


def payload(mox: Expr, *, title: str = 'yax',
            max_text: int | None = None, memory=None) -> dict:
  """The data the page embeds (see the module docstring); each node's
  Jaxpr text is cut at ``max_text`` characters when given; ``memory``: a
  ``yax.memory_report`` whose per-call bytes are shown (``saved``)."""
  buf = io.StringIO()
  dump_xml(mox, buf, indent=None)
  nodes = _nodes(mox)
  params, texts = [], []
  for i, node in enumerate(nodes):
    if isinstance(node, Mox):
      if i == 0 or node.is_ephemeral:
        count = _summary.total_params(node)[0]
      else:
        count = _summary.param_count(node)
    else:
      count = 0
    params.append(count)
    texts.append(_bounded(str(node), max_text))
  flops = _flops_per_node(nodes)
  n_params, n_bytes = _summary.total_params(mox)
  extra = {}
  if memory is not None:
    extra = {'saved': _saved_per_node(nodes, memory),
             'memory': {'saved': memory.total,
                        'unattributed': memory.unattributed,
                        'training': memory.training}}
  return {
      'format': 1,
      'title': title,
      'version': __version__,
      'xml': buf.getvalue(),
      'texts': texts,
      'params': params,
      'flops': flops,
      'totals': {
          'params': n_params,
          'param_bytes': n_bytes,
          'module_calls': sum(1 for _ in _summary.module_calls(mox)),
          'equations': sum(1 for n in nodes if isinstance(n, Equation)),
      },
      **extra,
  }


def _flops_per_node(nodes: list[Expr]) -> list[int]:
  """:func:`yax._src.report.summary.flops` of each node, each equation counted once.

  A module call's FLOPs are the sum of its children's (an equation's own
  count includes its bodies), so they are summed bottom-up instead of each
  call walking its whole subtree again (which costs nodes x depth).
  """
  done: dict[int, int] = {}

  def of(node: Expr) -> int:
    key = id(node)
    if key not in done:
      if isinstance(node, Mox):
        done[key] = sum(of(child) for child in node.children)
      else:
        done[key] = _summary.flops(node)
    return done[key]

  return [of(node) for node in reversed(nodes)][::-1]


def _script_json(data) -> str:
  """JSON safe inside a <script> element, and still JSON.

  Inside ``<script>`` the HTML parser ends the element at ``</script`` and
  treats ``<!--`` and ``<script`` specially, whatever the JSON means; so no
  ``<`` (nor ``>`` and ``&``, for good measure) may appear literally. They
  can only occur inside JSON strings, where ``\\u003c`` and friends are
  valid escapes that ``JSON.parse`` turns back into the same characters
  (``<\\!--`` would not be: ``\\!`` is not a JSON escape). Non-ASCII
  characters (lone surrogates included) are escaped as well.
  """
  text = json.dumps(data, separators=(',', ':'), ensure_ascii=True)
  return (text.replace('<', '\\u003c').replace('>', '\\u003e')
          .replace('&', '\\u0026'))


def _html_text(text: str) -> str:
  """``text`` escaped for HTML. Characters that a document cannot hold
  (NUL, which the HTML parser drops, other control characters, lone
  surrogates, which UTF-8 cannot encode) are written as Python escapes
  (``\\x00``), as the XML view writes them in field text."""
  return html.escape(escape_text(text), quote=True)


_MARKER = re.compile(r'@@(TITLE|CSS|JS|DATA)@@')


def _fill(template: str, values: dict[str, str]) -> str:
  """Substitutes the ``@@NAME@@`` markers of ``template`` in ONE pass: the
  values put in are never searched for markers again (a title that reads
  ``@@DATA@@`` stays that text)."""
  return _MARKER.sub(lambda m: values[m.group(1)], template)


def render_html(mox: Expr, *, title: str = 'yax', compress: bool = True,
                max_text: int | None = None, memory=None) -> str:
  """Returns the viewer page for ``mox`` as a string (see the module doc).

  **Arguments:**
  - ``mox``: the tree (what :func:`yax.make_mox` returns).
  - ``title``: page title, e.g. the model's name.
  - ``compress``: gzip + base64 the embedded data (needs a browser with
    ``DecompressionStream``: Chrome 80, Firefox 113, Safari 16.4 or newer);
    ``False`` embeds plain JSON.
  - ``max_text``: cut each node's Jaxpr text (the details panel) at this
    many characters, with a note saying how much was left out. An
    enclosing call's text holds every text below it, so on a deep model
    these texts are most of the page; ``None`` keeps them whole.
  - ``memory``: a ``yax.memory_report`` of a training step of this tree
    (given the same loss and arguments): each module call's row shows
    the bytes it keeps for the backward pass (the report's row for its
    path, exclusive of its submodules), the status line the total.

  **Returns:** the page, one self-contained HTML document.

  Example::

      page = yax.render_html(mox, title='bert', max_text=4000)
      page = yax.render_html(mox, memory=yax.memory_report(loss, p, x))
  """
  data = payload(mox, title=title, max_text=max_text, memory=memory)
  if compress:
    raw = json.dumps(data, separators=(',', ':')).encode()
    blob = base64.b64encode(gzip.compress(raw, 9, mtime=0)).decode('ascii')
    data_tag = ('<script id="yax-data" type="application/octet-stream" '
                f'data-encoding="gzip+base64">{blob}</script>')
  else:
    data_tag = ('<script id="yax-data" type="application/json" '
                f'data-encoding="json">{_script_json(data)}</script>')
  return _fill(viewer_file('page.html'), {
      'TITLE': _html_text(str(title)), 'CSS': viewer_file('viewer.css'),
      'JS': viewer_file('viewer.js'), 'DATA': data_tag})


# A notebook cell shows the viewer in an iframe of this height (pixels),
# each node's Jaxpr text cut at this many characters.
NOTEBOOK_HEIGHT = 520
NOTEBOOK_MAX_TEXT = 4000


def notebook_html(mox: Expr, *, title: str = 'yax',
                  max_text: int | None = NOTEBOOK_MAX_TEXT,
                  height: int = NOTEBOOK_HEIGHT) -> str:
  """The viewer as a notebook shows it (``Mox._repr_html_``): the page in
  an ``<iframe srcdoc=...>`` (its script and style stay inside the frame),
  each node's Jaxpr text cut at ``max_text`` characters, so the cell stays
  small for big models (the viewer itself builds rows only as they are
  expanded).

  **Arguments:**
  - ``mox``: the tree.
  - ``title``: the page title.
  - ``max_text``: see :func:`render_html`.
  - ``height``: the frame's height in pixels.

  **Returns:** an HTML fragment.

  Example::

      from IPython.display import HTML
      HTML(yax.notebook_html(mox, max_text=1000))
  """
  page = render_html(mox, title=title, max_text=max_text)
  return (f'<iframe srcdoc="{html.escape(page, quote=True)}" '
          f'title="{_html_text(str(title))}" '
          f'style="width:100%;height:{int(height)}px;border:1px solid #ccc" '
          'sandbox="allow-scripts"></iframe>')


def write_html(mox: Expr, path, **kwargs) -> int:
  """Writes :func:`render_html` to ``path``; returns the size in bytes.

  **Arguments:**
  - ``mox``: the tree.
  - ``path``: the file to write.
  - ``**kwargs``: :func:`render_html`'s (``title``, ``compress``,
    ``max_text``, ``memory``).

  **Returns:** the number of bytes written.

  Example::

      yax.write_html(mox, 'model.html', title='bert')
  """
  text = render_html(mox, **kwargs)
  data = text.encode('utf-8')
  with open(path, 'wb') as f:
    f.write(data)
  return len(data)


# A notebook shows a Mox as the viewer: the data model (``ir/nodes.py``)
# does not import this module.
register_view('html', notebook_html)
