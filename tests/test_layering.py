"""The package's layering rule, checked on the source (``ast``, no import).

* Imports go down the layers of :data:`LAYERS` (a module may import modules
  of its own layer or of lower ones), function-level imports included.
* No import cycle among ``yax`` modules, function-level imports included.
* No module imports another module's private name (a leading underscore):
  ``from yax._sub import _dyn`` or ``_sub._dyn(...)``. Modules themselves
  are private (``from yax import _lower`` is how modules are imported).
* JAX and Flax internals (``jax._src``, ``jaxlib``, ``flax.core``, any
  ``_``-prefixed module of ``jax``/``flax``) are imported in
  ``yax/_compat.py`` only.

docs/design.md ("Layers") lists the same layers; a test keeps the two equal.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = 'yax'

# Lowest first. A module may import from its own layer and from those above
# it in this list, never from one below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ('foundations', ('_errors', '_compat', '_version')),
    ('data model',
     ('_ir', '_markers', '_containers', '_format', '_variables', '_arguments')),
    ('lowering and rules', ('_lower', '_rules', '_calls')),
    ('tracing', ('_trace', '_nnx')),
    ('running and viewing a tree',
     ('_eval', '_check', '_printing', '_serialize', '_query')),
    ('rewriting', ('_sub', '_pattern', '_contraction', '_formats')),
    ('LoRA, new variables, precision', ('_lora', '_init', '_cast', '_quantize')),
    ('memory rewrites', ('_remat', '_randomized', '_fewbit', '_fewbit_tables',
                         '_fewbit_solver')),
    ('summary', ('_summary', '_flops')),
    ('viewers', ('_html', '_explorer')),
    ('command line', ('_cli', '_bundled', '_bundled_nnx')),
    ('public surface', ('__init__', '__main__')),
]

COMPAT = '_compat'  # the one module that may import JAX/Flax internals

# The tools: clients of the rewrite engine, none importing another (what
# they share lives in the engine's layer or below).
TOOLS = ('_lora', '_init', '_cast', '_quantize', '_remat', '_randomized',
         '_fewbit')


# ------------------------------------------------------------ the scanner

@dataclasses.dataclass(frozen=True)
class Import:
  """One imported thing: ``target`` is a module of the package, ``name``
  what is taken from it (``None`` for the module itself)."""
  importer: str
  target: str
  name: str | None
  line: int
  function: str | None  # the enclosing function, for a function-level one

  def where(self, package_dir: pathlib.Path) -> str:
    at = f'{package_dir.name}/{self.importer}.py:{self.line}'
    return at + (f' (in {self.function})' if self.function else '')


@dataclasses.dataclass
class Scan:
  imports: list[Import]  # imports of package modules
  private: list[tuple[Import, str]]  # (import, private name used)
  internals: list[tuple[str, int, str]]  # (module, line, internal name)


def _is_private(name: str) -> bool:
  return name.startswith('_') and not name.startswith('__')


def is_internal(name: str) -> bool:
  """A JAX/Flax module path or attribute that is not public API."""
  parts = name.split('.')
  if parts[0] == 'jaxlib' or parts[:2] == ['flax', 'core']:
    return True
  return parts[0] in ('jax', 'flax') and any(
      _is_private(p) for p in parts[1:])


class _Visitor(ast.NodeVisitor):
  def __init__(self, module: str, modules: set[str], package: str):
    self.module, self.modules, self.package = module, modules, package
    self.scope: list[tuple[str, bool]] = []
    self.imports: list[Import] = []
    self.private: list[tuple[Import, str]] = []
    self.internals: list[tuple[str, int, str]] = []
    # Local names bound to a package module ('_sub' -> '_sub', 'yax' ->
    # '__init__') or to an outside module ('jax' -> 'jax').
    self.aliases: dict[str, str] = {}
    self.outside: dict[str, str] = {}

  # -- where we are
  def _scope(self, node, is_function):
    self.scope.append((node.name, is_function))
    self.generic_visit(node)
    self.scope.pop()

  @property
  def function(self) -> str | None:
    """``Expr.__str__`` inside a function (classes and functions around
    it), ``None`` at module or class level."""
    if any(is_function for _, is_function in self.scope):
      return '.'.join(name for name, _ in self.scope)
    return None

  def visit_FunctionDef(self, node):
    self._scope(node, True)

  visit_AsyncFunctionDef = visit_FunctionDef

  def visit_ClassDef(self, node):
    self._scope(node, False)

  def _add(self, target: str, name: str | None, line: int) -> Import:
    imp = Import(self.module, target, name, line,
                 self.function)
    if target != self.module:
      self.imports.append(imp)
      if name is not None and _is_private(name):
        self.private.append((imp, name))
    return imp

  def _module_of(self, dotted: str) -> str | None:
    """The package module ``yax`` or ``yax._x`` stands for."""
    if dotted == self.package:
      return '__init__'
    head, _, rest = dotted.partition('.')
    if head == self.package and rest:
      return rest.split('.')[0]
    return None

  def _internal(self, name: str, line: int):
    if self.module != COMPAT and is_internal(name):
      self.internals.append((self.module, line, name))

  # -- imports
  def visit_Import(self, node):
    for alias in node.names:
      target = self._module_of(alias.name)
      if target is not None:
        self._add(target, None, node.lineno)
        if alias.asname:
          self.aliases[alias.asname] = target
        else:  # ``import yax._x`` binds ``yax``
          self.aliases[self.package] = '__init__'
      else:
        self._internal(alias.name, node.lineno)
        local = alias.asname or alias.name.split('.')[0]
        self.outside[local] = alias.name if alias.asname else local

  def visit_ImportFrom(self, node):
    if node.level:  # relative: only ``from . import x``/``from .x import y``
      module = self.package + ('.' + node.module if node.module else '')
      if node.level > 1:
        return
    else:
      module = node.module or ''
    target = self._module_of(module)
    if target is None:
      names = [f'{module}.{alias.name}' for alias in node.names]
      for name in [module, *names]:  # one report per statement
        if is_internal(name):
          self._internal(name, node.lineno)
          break
      for alias, name in zip(node.names, names, strict=True):
        self.outside[alias.asname or alias.name] = name
      return
    for alias in node.names:
      if target == '__init__' and alias.name in self.modules:
        self._add(alias.name, None, node.lineno)  # ``from yax import _x``
        self.aliases[alias.asname or alias.name] = alias.name
      else:
        self._add(target, alias.name, node.lineno)

  def visit_Call(self, node):
    # importlib.import_module('yax._x') / __import__('jax._src...')
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(
        func, 'id', None)
    if (name in ('import_module', '__import__') and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)):
      dotted = node.args[0].value
      target = self._module_of(dotted)
      if target is not None:
        self._add(target, None, node.lineno)
      else:
        self._internal(dotted, node.lineno)
    self.generic_visit(node)

  # -- names used through a module: ``_sub._dyn``, ``jax._src.core``
  def visit_Attribute(self, node):
    chain, base = [], node
    while isinstance(base, ast.Attribute):
      chain.append(base.attr)
      base = base.value
    if isinstance(base, ast.Name) and isinstance(node.ctx, ast.Load):
      chain.reverse()
      if base.id in self.aliases:
        self._package_attribute(self.aliases[base.id], chain, node.lineno)
        return  # the whole chain is handled
      if base.id in self.outside:
        if not is_internal(self.outside[base.id]):  # else reported already
          self._internal('.'.join([self.outside[base.id], *chain]),
                         node.lineno)
        return
    self.generic_visit(node)

  def _package_attribute(self, target: str, chain: list[str], line: int):
    for attr in chain:
      if target == '__init__' and attr in self.modules:
        self._add(attr, None, line)  # ``yax._x`` after ``import yax._x``
        target = attr
        continue
      if _is_private(attr) and target != self.module:
        self.private.append((Import(self.module, target, attr, line,
                                    self.function), attr))
      return


def scan(package_dir: pathlib.Path, package: str = PACKAGE) -> Scan:
  modules = {p.stem for p in package_dir.glob('*.py')}
  out = Scan([], [], [])
  for path in sorted(package_dir.glob('*.py')):
    visitor = _Visitor(path.stem, modules, package)
    visitor.visit(ast.parse(path.read_text(encoding='utf-8'), str(path)))
    out.imports += visitor.imports
    out.private += visitor.private
    out.internals += visitor.internals
  return out


def cycles(imports: list[Import]) -> list[list[Import]]:
  """Import cycles, each as the imports that close it (``a -> b -> a``):
  for every import between two modules that import each other (directly
  or not), the shortest cycle through it."""
  edges: dict[str, dict[str, Import]] = {}
  for imp in imports:
    edges.setdefault(imp.importer, {}).setdefault(imp.target, imp)
  # Tarjan's strongly connected components.
  index, low, stack, on_stack, groups = {}, {}, [], set(), []

  def connect(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges.get(v, {})):
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        group.add(w)
        if w == v:
          break
      if len(group) > 1:
        groups.append(group)

  for v in sorted(edges):
    if v not in index:
      connect(v)
  found, seen = [], set()
  for group in groups:
    # For each import inside the group, the shortest cycle through it, so
    # that every import of the cycle is shown at least once.
    for v in sorted(group):
      for w, imp in sorted(edges[v].items()):
        if w not in group:
          continue
        back = _shortest_path(edges, group, w, v)
        cycle = [imp, *back]
        key = frozenset((i.importer, i.target) for i in cycle)
        if key not in seen:
          seen.add(key)
          found.append(cycle)
  return found


def _shortest_path(edges, group, start, end) -> list[Import]:
  """Imports leading from ``start`` to ``end`` inside ``group`` (breadth
  first; empty when ``start`` is ``end``)."""
  paths = {start: []}
  queue = [start]
  while queue:
    v = queue.pop(0)
    if v == end:
      return paths[v]
    for w, imp in sorted(edges.get(v, {}).items()):
      if w in group and w not in paths:
        paths[w] = paths[v] + [imp]
        queue.append(w)
  raise AssertionError(f'{end} is not reachable from {start}')


def layer_of() -> dict[str, int]:
  return {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}


def upward(imports: list[Import]) -> list[Import]:
  where = layer_of()
  return [imp for imp in imports
          if imp.importer in where and imp.target in where
          and where[imp.target] > where[imp.importer]]


# ------------------------------------------------------------- the rules

PACKAGE_DIR = ROOT / PACKAGE


@pytest.fixture(scope='module')
def package():
  return scan(PACKAGE_DIR)


def test_every_module_is_in_one_layer():
  modules = sorted(p.stem for p in PACKAGE_DIR.glob('*.py'))
  listed = [m for _, mods in LAYERS for m in mods]
  twice = sorted({m for m in listed if listed.count(m) > 1})
  missing = [m for m in modules if m not in listed]
  stale = [m for m in listed if m not in modules]
  assert not (twice or missing or stale), (
      f'tests/test_layering.py LAYERS must name each yax/*.py once: '
      f'missing {missing}, not in the package {stale}, twice {twice}')


def test_no_import_cycles(package):
  found = cycles(package.imports)
  text = [' -> '.join([c[0].importer] + [i.target for i in c]) + '\n    '
          + '\n    '.join(f'{i.where(PACKAGE_DIR)}: imports {i.target}'
                          for i in c) for c in found]
  assert not found, ('import cycles among yax modules (function-level '
                     'imports count):\n  ' + '\n  '.join(text))


def test_imports_go_down_the_layers(package):
  names = [name for name, _ in LAYERS]
  where = layer_of()
  bad = [f'{imp.where(PACKAGE_DIR)}: {imp.importer} (layer '
         f'{where[imp.importer]} {names[where[imp.importer]]!r}) imports '
         f'{imp.target}{"." + imp.name if imp.name else ""} (layer '
         f'{where[imp.target]} {names[where[imp.target]]!r})'
         for imp in upward(package.imports)]
  assert not bad, (
      'imports must go down the layers of tests/test_layering.py LAYERS '
      '(lowest first: ' + ' < '.join(names) + '):\n  ' + '\n  '.join(bad))


def test_tools_never_import_each_other(package):
  bad = [f'{imp.where(PACKAGE_DIR)}: {imp.importer} imports {imp.target}'
         for imp in package.imports
         if imp.importer in TOOLS and imp.target in TOOLS]
  assert not bad, ('a tool imports another tool (move what they share into '
                   'the rewriting layer):\n  ' + '\n  '.join(bad))


def test_no_private_names_across_modules(package):
  bad = [f'{imp.where(PACKAGE_DIR)}: {imp.importer} uses {name} of '
         f'{imp.target}' for imp, name in package.private]
  assert not bad, (
      "a module may not use another module's private (_-prefixed) names; "
      'make the name public in its module or keep it local:\n  '
      + '\n  '.join(bad))


def test_jax_and_flax_internals_only_in_compat(package):
  bad = [f'{PACKAGE}/{m}.py:{line}: {name}' for m, line, name in
         package.internals]
  assert not bad, ('JAX/Flax internals may only be used in yax/_compat.py:\n  '
                   + '\n  '.join(bad))


def test_design_doc_lists_the_layers():
  text = (ROOT / 'docs' / 'design.md').read_text(encoding='utf-8')
  section = re.search(r'^## Layers\n(.*?)(?=^## )', text, re.M | re.S)
  assert section, 'docs/design.md has no "## Layers" section'
  rows = re.findall(r'^\d+\. (.*)$', section.group(1), re.M)
  documented = [tuple(sorted(re.findall(r'`(\w+)\.py`', row))) for row in rows]
  expected = [tuple(sorted(mods)) for _, mods in LAYERS]
  assert documented == expected, (
      'the numbered list of docs/design.md "## Layers" must name the modules '
      'of tests/test_layering.py LAYERS, one layer a line, lowest first:\n'
      f'  doc:  {documented}\n  test: {expected}')


# ------------------------------------------- the scanner on known sources

def _package(tmp_path, files: dict[str, str]) -> pathlib.Path:
  pkg = tmp_path / PACKAGE
  pkg.mkdir()
  for name, source in files.items():
    (pkg / f'{name}.py').write_text(source)
  return pkg


def test_scanner_sees_every_import_form(tmp_path):
  pkg = _package(tmp_path, {
      '__init__': 'from yax._a import f as f\n',
      '_a': ('from yax import _b\nimport yax._c\nimport yax._d as d\n'
             'from . import _e\nfrom ._f import g\n'
             'def f():\n  from yax._g import h\n  import yax\n'
             '  importlib.import_module("yax._h")\n'),
      **{m: '' for m in ('_b', '_c', '_d', '_e', '_f', '_g', '_h')}})
  found = {(i.importer, i.target, i.name, i.function)
           for i in scan(pkg).imports}
  assert found == {
      ('__init__', '_a', 'f', None), ('_a', '_b', None, None),
      ('_a', '_c', None, None), ('_a', '_d', None, None),
      ('_a', '_e', None, None), ('_a', '_f', 'g', None),
      ('_a', '_g', 'h', 'f'), ('_a', '__init__', None, 'f'),
      ('_a', '_h', None, 'f')}


def test_scanner_finds_cycles_through_function_level_imports(tmp_path):
  pkg = _package(tmp_path, {
      '_a': 'from yax import _b\n',
      '_b': 'def f():\n  from yax._c import g\n',
      '_c': 'import yax._a\n', '_d': 'from yax import _a\n'})
  (cycle,) = cycles(scan(pkg).imports)
  assert [(i.importer, i.target) for i in cycle] == [
      ('_a', '_b'), ('_b', '_c'), ('_c', '_a')]
  assert cycle[1].function == 'f'


def test_scanner_finds_private_names(tmp_path):
  pkg = _package(tmp_path, {
      '_a': ('from yax._b import _dyn, public\nfrom yax import _b\n'
             'import yax._b\nimport yax._b as b\n'
             'x = _b._hidden(), _b.shown(), yax._b._deep, b._alias\n'
             'y = _b.__name__, _own\n'),
      '_b': 'def _dyn(): pass\n'})
  assert sorted((i.importer, i.target, name)
                for i, name in scan(pkg).private) == [
      ('_a', '_b', '_alias'), ('_a', '_b', '_deep'), ('_a', '_b', '_dyn'),
      ('_a', '_b', '_hidden')]


def test_scanner_finds_internals_outside_compat(tmp_path):
  pkg = _package(tmp_path, {
      '_a': ('import jax\nfrom jax._src import core\nfrom jax import _src\n'
             'import flax.core.scope as s\nfrom flax.linen import Dense\n'
             'from jax.extend import core as jex\nx = jax._src.dtypes\n'
             'y = jax.numpy.ones\n'),
      '_compat': 'from jax._src import core\n'})
  assert sorted((m, line) for m, line, _ in scan(pkg).internals) == [
      ('_a', 2), ('_a', 3), ('_a', 4), ('_a', 7)]


def test_upward_imports_are_found():
  imports = [Import('_ir', '_printing', None, 1, 'Expr.__str__'),
             Import('_printing', '_ir', 'Expr', 1, None),
             Import('_ir', '_errors', 'YaxError', 1, None)]
  assert upward(imports) == imports[:1]
