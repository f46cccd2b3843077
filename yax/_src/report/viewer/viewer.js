'use strict';
(() => {
const $ = (id) => document.getElementById(id);
const SYMBOL = new Set(['input', 'output']);
const MAX_LIST = 500;
const fmt = (n) => Number(n).toLocaleString('en-US');
// Bytes as the summary writes them (human_bytes): decimal units, 83.9 KB.
function fmtBytes(n) {
  const units = ['B', 'KB', 'MB', 'GB'];
  let v = Number(n), u = 0;
  while (v >= 1000 && u < units.length - 1) { v /= 1000; u++; }
  return u === 0 ? v.toFixed(0) + ' B' : v.toFixed(1) + ' ' + units[u];
}
// Bytes a module call keeps for the backward pass (a memory report given).
const savedOf = (i) => (D.saved ? D.saved[i] : null);

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text;
  return e;
}

async function loadPayload() {
  const node = $('yax-data');
  const enc = node.dataset.encoding;
  if (enc === 'json') return JSON.parse(node.textContent);
  if (typeof DecompressionStream === 'undefined')
    throw new Error('this browser cannot decompress the embedded data ' +
                    '(no DecompressionStream); write the page with --no-compress');
  const bin = atob(node.textContent.trim());
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'));
  return JSON.parse(await new Response(stream).text());
}

let D, xml, els, ids, parentOf;
const expanded = new Set();
const rows = new Map();
let selected = -1;
let hits = new Set(), hitList = [], hitIndex = -1, inside = new Map(), lastQuery = null;
let producersOf, consumersOf;           // symbol name -> element ids
let flowSources = [], flowTargets = []; // element ids for the selected node
const DEEP = 12;                        // indentation stops here

const isMox = (i) => els[i].tagName === 'module_call';

function childIds(i) {
  const out = [];
  for (const c of els[i].children) if (!SYMBOL.has(c.tagName)) out.push(ids.get(c));
  return out;
}

function visibleChildren(i) {
  const showEqns = $('show-eqns').checked;
  const out = [];
  for (const c of childIds(i)) {
    if (isMox(c) || showEqns) out.push(c);
    else out.push(...visibleChildren(c));  // module calls inside scan/remat bodies
  }
  return out;
}

function outTypes(i) {
  const out = [];
  for (const c of els[i].children) if (c.tagName === 'output') out.push(c.getAttribute('type'));
  return out;
}

function label(i) {
  // {ty: type or primitive, nm: short name, path: full path (module calls)}
  const e = els[i];
  if (isMox(i)) {
    if (i === 0) return {ty: e.getAttribute('type') || 'fn', nm: '(root)', path: ''};
    const ty = e.getAttribute('type') || 'ephemeral';
    const meth = e.getAttribute('method');
    const path = e.getAttribute('path') || '';
    const nm = e.getAttribute('name') || path.split('/').pop() ||
      (e.hasAttribute('param') ? 'body ' + e.getAttribute('param') : '(top)');
    return {ty: meth && meth !== '__call__' ? ty + '.' + meth : ty, nm, path};
  }
  const name = e.getAttribute('name');
  return {ty: e.tagName, nm: name ? 'name=' + name : '', path: ''};
}

function ownerPath(i) {
  // The path of the module call an equation belongs to.
  for (let p = parentOf[i]; p >= 0; p = parentOf[p]) {
    const path = isMox(p) && els[p].getAttribute('path');
    if (path) return path;
  }
  return '/';
}

function shapes(list, max) {
  if (list.length > max) return list.slice(0, max).join(' ') + ' \u2026+' + (list.length - max);
  return list.join(' ');
}

function makeRow(i, depth) {
  const li = el('li');
  li.setAttribute('role', 'treeitem');
  li.dataset.id = i;
  li.dataset.depth = depth;
  const r = el('div', 'row' + (isMox(i) ? '' : ' eq'));
  const kids = visibleChildren(i).length;
  r.append(el('span', 'tw', kids ? (expanded.has(i) ? '\u25be' : '\u25b8') : ''));
  const lb = label(i);
  r.append(el('span', 'ty', lb.ty));
  if (lb.nm) r.append(el('span', 'nm', lb.nm));
  const outs = outTypes(i);
  if (outs.length) r.append(el('span', 'sh', '\u2192 ' + shapes(outs, 3)));
  if (D.params[i]) r.append(el('span', 'pc', fmt(D.params[i]) + ' params'));
  if (savedOf(i)) r.append(el('span', 'sv', fmtBytes(savedOf(i)) + ' saved'));
  if (lb.path && lb.path !== lb.nm) r.append(el('span', 'dim', lb.path));
  if (lb.path) r.title = lb.path;
  if (depth >= DEEP) r.prepend(el('span', 'depth', 'L' + depth));
  if (hits.has(i)) r.classList.add('hit');
  if (i === selected) r.classList.add('sel');
  if (hitIndex >= 0 && hitList[hitIndex] === i) r.classList.add('cur');
  if (inside.get(i) && !expanded.has(i)) r.append(el('span', 'badge', fmt(inside.get(i))));
  li.setAttribute('aria-expanded', kids ? String(expanded.has(i)) : 'false');
  li.append(r);
  rows.set(i, li);
  if (expanded.has(i) && kids) li.append(makeList(visibleChildren(i), depth + 1));
  return li;
}

function makeList(list, depth) {
  const ul = el('ul');
  ul.setAttribute('role', 'group');
  if (depth >= DEEP) ul.classList.add('deep');
  for (const c of list) ul.append(makeRow(c, depth));
  return ul;
}

function forget(li) {
  for (const d of li.querySelectorAll('li')) rows.delete(Number(d.dataset.id));
}

function refreshRow(i) {
  const old = rows.get(i);
  if (!old) return;
  forget(old);
  old.replaceWith(makeRow(i, Number(old.dataset.depth)));
}

function setExpanded(i, on) {
  if (on) expanded.add(i); else expanded.delete(i);
  refreshRow(i);
  markFlow();
}

function renderTree() {
  rows.clear();
  const tree = $('tree');
  tree.replaceChildren(makeRow(0, 0));
  markFlow();
}

function expandAll() {
  for (let i = 0; i < els.length; i++) if (visibleChildren(i).length) expanded.add(i);
  renderTree();
}

function collapseAll() {
  expanded.clear();
  expanded.add(0);
  renderTree();
}

// ------------------------------------------------------------- data flow

function symbolNames(i, tag) {
  const out = [];
  for (const c of els[i].children) if (c.tagName === tag) out.push(c.textContent);
  return out;
}

function related(i, j) {
  // j is i, an ancestor or a descendant of i.
  for (let p = j; p >= 0; p = parentOf[p]) if (p === i) return true;
  for (let p = i; p >= 0; p = parentOf[p]) if (p === j) return true;
  return false;
}

function computeFlow(i) {
  // Producers of i's inputs and consumers of its outputs, outside i's own
  // ancestors and descendants (those only pass the values through).
  const made = new Set(), read = new Set();
  for (const name of symbolNames(i, 'input'))
    for (const j of producersOf.get(name) || []) if (!related(i, j)) made.add(j);
  for (const name of symbolNames(i, 'output'))
    for (const j of consumersOf.get(name) || []) if (!related(i, j)) read.add(j);
  // A module call and the equation inside it that computes the value are
  // both producers: keep the outermost.
  const outermost = (set) => [...set].filter((j) => {
    for (let p = parentOf[j]; p >= 0; p = parentOf[p]) if (set.has(p)) return false;
    return true;
  });
  flowSources = outermost(made);
  flowTargets = outermost(read);
}

function shownRow(j) {
  // The rendered row that stands for j: j itself or its nearest rendered
  // ancestor (a collapsed node); null if that is an ancestor of the
  // selected node.
  let p = j;
  while (p >= 0 && !rows.has(p)) p = parentOf[p];
  if (p < 0 || (selected >= 0 && related(selected, p))) return null;
  return p;
}

function markFlow() {
  for (const r of document.querySelectorAll('#tree .row.prod, #tree .row.cons'))
    r.classList.remove('prod', 'cons');
  if (selected < 0) return;
  for (const [list, cls] of [[flowSources, 'prod'], [flowTargets, 'cons']]) {
    for (const j of list) {
      const p = shownRow(j);
      if (p !== null) rows.get(p).firstChild.classList.add(cls);
    }
  }
}

function ancestors(i) {
  const out = [];
  for (let p = parentOf[i]; p >= 0; p = parentOf[p]) out.push(p);
  return out.reverse();
}

function reveal(i) {
  if (!isMox(i) && !$('show-eqns').checked) {
    $('show-eqns').checked = true;
    renderTree();
  }
  for (const a of ancestors(i)) {
    if (!expanded.has(a)) setExpanded(a, true);
  }
  select(i);
  const li = rows.get(i);
  if (li) li.firstChild.firstChild.scrollIntoView({block: 'center', inline: 'nearest'});
}

function select(i) {
  const prev = rows.get(selected);
  if (prev) prev.firstChild.classList.remove('sel');
  selected = i;
  const li = rows.get(i);
  if (li) {
    li.firstChild.classList.add('sel');
    // The start of the row (the row itself may be wider than the pane).
    li.firstChild.firstChild.scrollIntoView({block: 'nearest', inline: 'nearest'});
  }
  computeFlow(i);
  markFlow();
  showDetails(i);
}

function flowList(ids, cls, title) {
  const box = el('div');
  if (!ids.length) return box;
  box.append(el('h3', null, title + ' (' + ids.length + ')'));
  for (const j of ids.slice(0, 50)) {
    const lb = label(j);
    const d = el('div', 'item');
    d.append(el('span', 'flow-tag ' + cls, cls === 'prod' ? 'from' : 'to'), ' ',
             el('span', isMox(j) ? 'ty' : 'dim', lb.ty), ' ',
             isMox(j) ? (lb.path || lb.nm) : 'in ' + ownerPath(j));
    d.style.cursor = 'pointer';
    d.addEventListener('click', () => reveal(j));
    box.append(d);
  }
  if (ids.length > 50) box.append(el('div', 'dim', '\u2026 and ' + (ids.length - 50) + ' more'));
  return box;
}

function kvTable(pairs) {
  const t = el('table', 'kv');
  for (const [k, v] of pairs) {
    const tr = el('tr');
    tr.append(el('td', null, k), el('td', null, v));
    t.append(tr);
  }
  return t;
}

function symbolPairs(i, tag) {
  const out = [];
  for (const c of els[i].children) {
    if (c.tagName !== tag) continue;
    let v = c.getAttribute('type');
    if (c.getAttribute('var')) v += '   ' + c.getAttribute('var');
    if (c.getAttribute('literal') === 'true') v += '   literal';
    out.push([c.textContent, v]);
  }
  return out;
}

function xpathOf(i) {
  const e = els[i];
  if (i === 0) return '/module_call';
  if (isMox(i) && e.getAttribute('path')) {
    const same = D.pathCount.get(e.getAttribute('path')) || 0;
    const base = '//module_call[@path="' + e.getAttribute('path') + '"]';
    if (same <= 1) return base;
    return base + '[@method="' + e.getAttribute('method') + '"]';
  }
  return null;
}

function showDetails(i) {
  const box = $('details');
  box.replaceChildren();
  const e = els[i];
  const lb = label(i);
  const head = el('div', 'head');
  const h = el('h2');
  h.append(el('span', isMox(i) ? 'ty' : 'dim', lb.ty), ' ', el('span', 'nm', lb.path || lb.nm));
  if (!isMox(i)) h.append(' ', el('span', 'dim', 'in ' + ownerPath(i)));
  head.append(h);
  box.append(head);
  const facts = [];
  if (D.params[i]) facts.push(fmt(D.params[i]) + ' params');
  if (D.flops[i]) facts.push(fmt(D.flops[i]) + ' FLOPs');
  if (savedOf(i) !== null) facts.push(fmt(savedOf(i)) + ' bytes saved for the backward pass (its own)');
  facts.push(isMox(i) ? 'module_call' : 'equation');
  const xp = xpathOf(i);
  if (xp) facts.push(xp);
  head.append(el('div', 'dim', facts.join(' \u00b7 ')));
  const legend = el('div', 'dim');
  legend.append(el('span', 'flow-tag prod', 'from'), ' ' + flowSources.length +
                ' producers of its inputs  ', el('span', 'flow-tag cons', 'to'),
                ' ' + flowTargets.length + ' consumers of its outputs');
  head.append(legend);
  box.append(el('h3', null, 'attributes'));
  box.append(kvTable([...e.attributes].map((a) => [a.name, a.value])));
  const ins = symbolPairs(i, 'input'), outs = symbolPairs(i, 'output');
  if (ins.length) { box.append(el('h3', null, 'inputs (' + ins.length + ')')); box.append(kvTable(ins)); }
  if (outs.length) { box.append(el('h3', null, 'outputs (' + outs.length + ')')); box.append(kvTable(outs)); }
  box.append(flowList(flowSources, 'prod', 'inputs come from'));
  box.append(flowList(flowTargets, 'cons', 'outputs go to'));
  box.append(el('h3', null, 'jaxpr'));
  box.append(el('pre', 'jaxpr', D.texts[i]));
}

// ---------------------------------------------------------------- search

// XPath white space (S): the same four characters as yax._query.XPATH_SPACE.
const XPATH_SPACE = ' \t\r\n';

function rewriteShorthand(q) {
  // `//[@k=v]` (a step with no node test) means `//*[@k=v]`, as in yax.query
  // (yax._query.rewrite_shorthand, which tests/test_html.py holds this to).
  let out = '', quote = null, last = '';
  for (const ch of q) {
    if (quote) { if (ch === quote) quote = null; out += ch; continue; }
    if (ch === '"' || ch === "'") quote = ch;
    else if (ch === '[' && last === '/') out += '*';
    out += ch;
    if (!XPATH_SPACE.includes(ch)) last = ch;
  }
  return out;
}

function ownerId(n) {
  if (n.nodeType === Node.ATTRIBUTE_NODE) n = n.ownerElement;
  else if (n.nodeType === Node.DOCUMENT_NODE) return 0;
  else if (n.nodeType !== Node.ELEMENT_NODE) n = n.parentNode;
  if (SYMBOL.has(n.tagName)) n = n.parentNode;
  const i = ids.get(n);
  return i === undefined ? 0 : i;
}

function describe(n) {
  const i = ownerId(n);
  const lb = label(i);
  const where = lb.ty + ' ' + (isMox(i) ? lb.path || lb.nm : (lb.nm ? lb.nm + ' ' : '') +
    'in ' + ownerPath(i));
  if (n.nodeType === Node.ATTRIBUTE_NODE) return '@' + n.name + '="' + n.value + '"   ' + where;
  if (n.nodeType === Node.ELEMENT_NODE && SYMBOL.has(n.tagName))
    return n.tagName + ' ' + n.textContent + ':' + n.getAttribute('type') + '   ' + where;
  if (n.nodeType === Node.TEXT_NODE) return '"' + n.nodeValue + '"   ' + where;
  const outs = outTypes(i);
  return where + (outs.length ? '   \u2192 ' + shapes(outs, 3) : '');
}

function clearHits() {
  const old = [...hits, ...inside.keys()];
  hits = new Set(); hitList = []; hitIndex = -1; inside = new Map();
  for (const i of old) refreshRow(i);
  markFlow();
}

function setCount(text, bad, n) {
  const c = $('count');
  c.textContent = text;
  c.classList.toggle('bad', !!bad);
  if (n === undefined) c.removeAttribute('data-count'); else c.dataset.count = n;
}

function runSearch() {
  const q = $('search').value.trim();
  lastQuery = q;
  clearHits();
  const res = $('results');
  res.replaceChildren();
  res.hidden = true;
  $('search').classList.remove('bad');
  if (!q) { setCount('', false); return; }
  const t0 = performance.now();
  let r;
  try {
    r = xml.evaluate(rewriteShorthand(q), xml.documentElement, null, XPathResult.ANY_TYPE, null);
    if (r.resultType === XPathResult.UNORDERED_NODE_ITERATOR_TYPE ||
        r.resultType === XPathResult.ORDERED_NODE_ITERATOR_TYPE)
      r = xml.evaluate(rewriteShorthand(q), xml.documentElement, null,
                       XPathResult.ORDERED_NODE_SNAPSHOT_TYPE, null);
  } catch (err) {
    $('search').classList.add('bad');
    setCount('invalid XPath', true);
    res.hidden = false;
    res.append(el('div', 'error', String(err.message || err).split('\n')[0] +
      '\n(the viewer runs XPath 1.0; XPath 2.0/3.1 needs `yax query` in Python)'));
    return;
  }
  const ms = performance.now() - t0;
  $('count').dataset.ms = ms.toFixed(2);
  if (r.resultType === XPathResult.NUMBER_TYPE) { setCount('= ' + r.numberValue); return; }
  if (r.resultType === XPathResult.STRING_TYPE) { setCount('= "' + r.stringValue + '"'); return; }
  if (r.resultType === XPathResult.BOOLEAN_TYPE) { setCount('= ' + r.booleanValue); return; }
  const n = r.snapshotLength;
  setCount(fmt(n) + (n === 1 ? ' match' : ' matches'), false, n);
  $('results').dataset.n = n;
  const seen = new Set();
  for (let k = 0; k < n; k++) {
    const i = ownerId(r.snapshotItem(k));
    if (!seen.has(i)) { seen.add(i); hitList.push(i); }
  }
  hits = seen;
  for (const i of hitList) for (const a of ancestors(i)) inside.set(a, (inside.get(a) || 0) + 1);
  for (const i of new Set([...hits, ...inside.keys()])) refreshRow(i);
  markFlow();
  if (n) {
    res.hidden = false;
    const shown = Math.min(n, MAX_LIST);
    for (let k = 0; k < shown; k++) {
      const item = r.snapshotItem(k);
      const d = el('div', 'item', describe(item));
      const i = ownerId(item);
      d.dataset.id = i;
      d.addEventListener('click', () => goTo(hitList.indexOf(i)));
      res.append(d);
    }
    if (n > shown) res.append(el('div', 'dim', '\u2026 and ' + fmt(n - shown) + ' more'));
  }
  $('count').dataset.totalMs = (performance.now() - t0).toFixed(2);
}

function goTo(k) {
  const old = hitIndex >= 0 ? rows.get(hitList[hitIndex]) : null;
  if (old) old.firstChild.classList.remove('cur');
  hitIndex = k;
  const i = hitList[k];
  reveal(i);
  const li = rows.get(i);
  if (li) li.firstChild.classList.add('cur');
  const n = Number($('count').dataset.count || hitList.length);
  // Matches are counted per XPath result; stepping goes through the tree
  // nodes that hold them, so k counts nodes when several results share one.
  const total = hitList.length;
  setCount(fmt(k + 1) + ' of ' + fmt(total) + (n !== total ? ' (' + fmt(n) + ' matches)' : ''),
           false, n);
  $('count').dataset.k = k + 1;
  for (const d of document.querySelectorAll('#results .item')) {
    const on = Number(d.dataset.id) === i;
    d.classList.toggle('cur', on);
    if (on) d.scrollIntoView({block: 'nearest'});
  }
}

function step(delta) {
  if ($('search').value.trim() !== lastQuery) runSearch();
  if (!hitList.length) return;
  goTo((hitIndex + delta + hitList.length) % hitList.length);
}

// ------------------------------------------------------------- keyboard

function visibleRows() {
  return [...document.querySelectorAll('#tree li')].map((li) => Number(li.dataset.id));
}

function onTreeKey(ev) {
  if (ev.altKey || ev.ctrlKey || ev.metaKey) return;
  const list = visibleRows();
  let k = list.indexOf(selected);
  const i = selected;
  const has = i >= 0 && visibleChildren(i).length > 0;
  switch (ev.key) {
    case 'ArrowDown': k = Math.min(k + 1, list.length - 1); break;
    case 'ArrowUp': k = Math.max(k - 1, 0); break;
    case 'Home': k = 0; break;
    case 'End': k = list.length - 1; break;
    case 'ArrowRight':
      if (has && !expanded.has(i)) { setExpanded(i, true); ev.preventDefault(); return; }
      if (has) k = k + 1;
      break;
    case 'ArrowLeft':
      if (has && expanded.has(i)) { setExpanded(i, false); ev.preventDefault(); return; }
      if (parentOf[i] >= 0 && rows.has(parentOf[i])) k = list.indexOf(shownAncestor(i));
      break;
    case 'Enter': case ' ':
      if (has) setExpanded(i, !expanded.has(i));
      ev.preventDefault();
      return;
    default: return;
  }
  ev.preventDefault();
  if (k < 0) k = 0;
  if (list[k] !== undefined) select(list[k]);
}

function shownAncestor(i) {
  let p = parentOf[i];
  while (p >= 0 && !rows.has(p)) p = parentOf[p];
  return p;
}

// ------------------------------------------------------------------ init

function index() {
  els = []; ids = new Map(); parentOf = [];
  for (const e of xml.getElementsByTagName('*')) {
    if (SYMBOL.has(e.tagName)) continue;
    ids.set(e, els.length);
    els.push(e);
  }
  for (let i = 0; i < els.length; i++) {
    const p = els[i].parentNode;
    parentOf.push(p && ids.has(p) ? ids.get(p) : -1);
  }
  producersOf = new Map(); consumersOf = new Map();
  for (let i = 0; i < els.length; i++) {
    for (const c of els[i].children) {
      const map = c.tagName === 'output' ? producersOf : c.tagName === 'input' ? consumersOf : null;
      if (!map) continue;
      const name = c.textContent;
      if (!map.has(name)) map.set(name, []);
      map.get(name).push(i);
    }
  }
  D.pathCount = new Map();
  for (const e of els) {
    const p = e.tagName === 'module_call' && e.getAttribute('path');
    if (p) D.pathCount.set(p, (D.pathCount.get(p) || 0) + 1);
  }
}

function fatal(msg) {
  $('details').replaceChildren(el('p', 'error', msg));
}

async function main() {
  try { D = await loadPayload(); } catch (err) { fatal('cannot load data: ' + err.message); return; }
  xml = new DOMParser().parseFromString(D.xml, 'application/xml');
  const perr = xml.getElementsByTagName('parsererror')[0];
  if (perr) { fatal('embedded XML does not parse: ' + perr.textContent); return; }
  index();
  if (els.length !== D.texts.length) {
    fatal('embedded XML has ' + els.length + ' nodes, data has ' + D.texts.length);
    return;
  }
  expanded.add(0);
  const first = childIds(0).filter(isMox);
  if (first.length === 1) expanded.add(first[0]);
  renderTree();
  const t = D.totals;
  $('status').textContent = fmt(t.module_calls) + ' module calls \u00b7 ' + fmt(t.equations) +
    ' equations \u00b7 ' + fmt(t.params) + ' params' +
    (D.memory ? ' \u00b7 ' + fmtBytes(D.memory.saved) + ' saved for the backward pass, training ' +
     fmtBytes(D.memory.training) : '') + ' \u00b7 yax ' + D.version;
  $('details').replaceChildren(el('p', 'hint',
    'Click a node to see its attributes, its Jaxpr and where its data comes from (green ' +
    'bar) and goes to (orange bar). Keys: arrows move, Enter expands, / searches. ' +
    'Type an XPath above (e.g. //module_call[@type="Dense"]) and press Enter; Enter again ' +
    'jumps to the next match.'));
  $('tree').addEventListener('click', (ev) => {
    const li = ev.target.closest('li');
    if (!li) return;
    const i = Number(li.dataset.id);
    $('tree').focus({preventScroll: true});
    if (ev.target.classList.contains('tw') || i === selected) {
      if (visibleChildren(i).length) setExpanded(i, !expanded.has(i));
    }
    select(i);
  });
  $('tree').addEventListener('dblclick', (ev) => ev.preventDefault());
  $('search-form').addEventListener('submit', (ev) => { ev.preventDefault(); step(1); });
  $('search').addEventListener('keydown', (ev) => {
    if (ev.key === 'Enter' && ev.shiftKey) { ev.preventDefault(); step(-1); }
  });
  let timer = null;
  $('search').addEventListener('input', () => {
    clearTimeout(timer);
    timer = setTimeout(() => { if ($('search').value.trim() !== lastQuery) runSearch(); }, 300);
  });
  $('next').addEventListener('click', () => step(1));
  $('prev').addEventListener('click', () => step(-1));
  $('show-eqns').addEventListener('change', renderTree);
  $('collapse').addEventListener('click', collapseAll);
  $('expand').addEventListener('click', expandAll);
  $('tree').addEventListener('keydown', onTreeKey);
  document.addEventListener('keydown', (ev) => {
    const typing = ev.target instanceof HTMLInputElement;
    if (ev.key === '/' && !typing) { ev.preventDefault(); $('search').focus(); $('search').select(); }
    else if (ev.key === 'Escape' && typing) { $('tree').focus(); }
    else if (!typing && ev.target === document.body &&
             ['ArrowDown', 'ArrowUp', 'ArrowLeft', 'ArrowRight', 'Home', 'End'].includes(ev.key)) {
      $('tree').focus();
      onTreeKey(ev);
    }
  });
  document.body.dataset.ready = 'true';
}

main();
})();
