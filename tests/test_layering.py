"""The package's layering rule, checked on the source (``ast``, no import).

* The modules live in packages that are layers (:data:`LAYERS`, lowest
  first): a module imports modules of its own package or of lower ones,
  function-level imports included.
* No import cycle among ``yax`` modules, function-level imports included.
* A tool (a module of ``yax/_src/tools/``) never imports another tool; a
  tool's helper modules are named after it (``fewbit_tables`` is
  ``fewbit``'s) and belong to it.
* A package's ``__init__.py`` imports nothing (importing a package must not
  import its modules, or packages would import each other).
* No module imports another module's private name (a leading underscore):
  ``from yax._src.rewrite.engine import _dyn`` or ``_engine._dyn(...)``.
  The modules under ``yax/_src`` are private as a whole, as ``jax._src`` is.
* JAX and Flax internals (``jax._src``, ``jaxlib``, ``flax.core``, any
  ``_``-prefixed module of ``jax``/``flax``) are imported in
  ``yax/_src/compat.py`` only.

docs/design.md ("Layers") lists the same packages, each with its modules; a
test keeps the two equal.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = 'yax'

# The packages (dotted, under ``yax``; '' is ``yax`` itself), lowest first.
# A module may import from its own package and from those above it in this
# list, never from one below it.
LAYERS: list[tuple[str, str]] = [
    ('_src', 'foundations'),
    ('_src.ir', 'the data model: nodes, their variables and arguments, the JAX bridge (lowering, per-primitive rules), checks'),
    ('_src.trace', 'JAX callable <-> tree: boundary markers, module calls, the Linen and NNX frontends, and evaluation (which splits NNX arguments as the NNX frontend does)'),
    ('_src.views', 'read-only renderings a rewrite may use: Jaxpr text, XML/JSON/YSON, XPath'),
    ('_src.rewrite', 'the rewrite engine and the analyses tools share: selection and substitution, patterns, contractions, quantized formats'),
    ('_src.tools', 'tools: clients of the engine, which never import each other'),
    ('_src.report', 'what a tree holds and costs (summary, FLOPs) and the viewers (HTML, Model Explorer); above the tools, as the summary reads variable locations through the engine'),
    ('_src.plan', 'planners that compose the tools and measure with the reports (fit_memory); above the reports, as a plan is checked by them'),
    ('_src.cli', 'the command line and its bundled example models'),
    ('', 'public surface'),
]

COMPAT = '_src.compat'  # the one module that may import JAX/Flax internals
TOOLS = '_src.tools'  # its modules never import each other
# Imports between tools let through for now, (importer, tool): why. The test
# fails when one of them is no longer made, so the list only shrinks.
TOOL_EXCEPTIONS: dict[tuple[str, str], str] = {}


# ------------------------------------------------------------ the scanner

@dataclasses.dataclass(frozen=True)
class Import:
  """One imported thing: ``target`` is a module of the package, keyed by its
  dotted path under ``yax`` (``_src.ir.nodes``; a package's ``__init__.py``
  is ``_src.ir.__init__``, ``yax/__init__.py`` is ``__init__``), ``name``
  what is taken from it (``None`` for the module itself)."""
  importer: str
  target: str
  name: str | None
  line: int
  function: str | None  # the enclosing function, for a function-level one

  def where(self, package_dir: pathlib.Path) -> str:
    at = f'{package_dir.name}/{file_of(self.importer)}:{self.line}'
    return at + (f' (in {self.function})' if self.function else '')


@dataclasses.dataclass
class Scan:
  imports: list[Import]  # imports of package modules
  private: list[tuple[Import, str]]  # (import, private name used)
  internals: list[tuple[str, int, str]]  # (module, line, internal name)
  # Imports of modules outside the package: (module, line, dotted name),
  # ``from flax import nnx`` as ``flax.nnx``.
  external: list[tuple[str, int, str]] = dataclasses.field(
      default_factory=list)


def file_of(key: str) -> str:
  """The file of a module key, relative to the package directory."""
  return key.replace('.', '/') + '.py'


def module_key(package_dir: pathlib.Path, path: pathlib.Path) -> str:
  return '.'.join(path.relative_to(package_dir).with_suffix('').parts)


def package_of(key: str) -> str:
  """The package a module belongs to ('' for ``yax/__init__.py``)."""
  return key.rpartition('.')[0]


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
    self.external: list[tuple[str, int, str]] = []
    # Local names bound to a package module, by its dotted name ('_engine'
    # -> 'yax._src.rewrite.engine', 'yax' -> 'yax'), or to an outside
    # module ('jax' -> 'jax').
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
    imp = Import(self.module, target, name, line, self.function)
    if target != self.module:
      self.imports.append(imp)
      if name is not None and _is_private(name):
        self.private.append((imp, name))
    return imp

  def _key(self, dotted: str) -> str | None:
    """The module key of exactly ``yax`` or ``yax.a.b`` (a module, or a
    package's ``__init__``)."""
    if dotted == self.package:
      return '__init__'
    head, _, rest = dotted.partition('.')
    if head != self.package or not rest:
      return None
    for key in (rest, rest + '.__init__'):
      if key in self.modules:
        return key
    return None

  def _module_of(self, dotted: str) -> str | None:
    """The package module that ``dotted`` names or is inside of (the
    longest prefix that is one)."""
    parts = dotted.split('.')
    while parts:
      key = self._key('.'.join(parts))
      if key is not None:
        return key
      parts.pop()
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
          self.aliases[alias.asname] = alias.name
        else:  # ``import yax.a.b`` binds ``yax``
          self.aliases[self.package] = self.package
      else:
        self._internal(alias.name, node.lineno)
        self.external.append((self.module, node.lineno, alias.name))
        local = alias.asname or alias.name.split('.')[0]
        self.outside[local] = alias.name if alias.asname else local

  def _absolute(self, node) -> str:
    """The module a ``from`` import reads from, relative ones resolved."""
    if not node.level:
      return node.module or ''
    parts = [self.package, *self.module.split('.')][:-1]  # its package
    parts = parts[:len(parts) - (node.level - 1)]
    return '.'.join(parts + ([node.module] if node.module else []))

  def visit_ImportFrom(self, node):
    module = self._absolute(node)
    target = self._module_of(module)
    if target is None:
      names = [f'{module}.{alias.name}' for alias in node.names]
      for name in [module, *names]:  # one report per statement
        if is_internal(name):
          self._internal(name, node.lineno)
          break
      for alias, name in zip(node.names, names, strict=True):
        self.outside[alias.asname or alias.name] = name
        self.external.append((self.module, node.lineno, name))
      return
    for alias in node.names:
      sub = self._key(f'{module}.{alias.name}')
      if sub is not None:  # ``from yax._src.ir import nodes``
        self._add(sub, None, node.lineno)
        self.aliases[alias.asname or alias.name] = f'{module}.{alias.name}'
      else:
        self._add(target, alias.name, node.lineno)

  def visit_Call(self, node):
    # importlib.import_module('yax._src.x') / __import__('jax._src...')
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

  # -- names used through a module: ``_engine._dyn``, ``jax._src.core``
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

  def _package_attribute(self, dotted: str, chain: list[str], line: int):
    for attr in chain:
      sub = self._key(f'{dotted}.{attr}')
      if sub is not None:  # ``yax._src.ir.nodes`` after ``import yax...``
        self._add(sub, None, line)
        dotted = f'{dotted}.{attr}'
        continue
      target = self._key(dotted)
      if _is_private(attr) and target != self.module:
        self.private.append((Import(self.module, target, attr, line,
                                    self.function), attr))
      return


def scan(package_dir: pathlib.Path, package: str = PACKAGE) -> Scan:
  paths = sorted(package_dir.rglob('*.py'))
  modules = {module_key(package_dir, p): p for p in paths}
  out = Scan([], [], [])
  for key, path in modules.items():
    visitor = _Visitor(key, set(modules), package)
    visitor.visit(ast.parse(path.read_text(encoding='utf-8'), str(path)))
    out.imports += visitor.imports
    out.private += visitor.private
    out.internals += visitor.internals
    out.external += visitor.external
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
  return {package: i for i, (package, _) in enumerate(LAYERS)}


def upward(imports: list[Import]) -> list[Import]:
  where = layer_of()
  return [imp for imp in imports
          if package_of(imp.importer) in where
          and package_of(imp.target) in where
          and where[package_of(imp.target)] > where[package_of(imp.importer)]]


def between_tools(imports: list[Import]) -> list[Import]:
  """Imports of one tool by another; a tool's helper modules, named after
  it (``fewbit_tables`` of ``fewbit``), are the tool's own."""
  def family(a: str, b: str) -> bool:
    a, b = a.rpartition('.')[2], b.rpartition('.')[2]
    return a.startswith(b + '_') or b.startswith(a + '_')
  return [imp for imp in imports
          if package_of(imp.importer) == TOOLS == package_of(imp.target)
          and not family(imp.importer, imp.target)]


# ------------------------------------------------------------- the rules

PACKAGE_DIR = ROOT / PACKAGE


@pytest.fixture(scope='module')
def package():
  return scan(PACKAGE_DIR)


def _packages_on_disk() -> list[str]:
  found = set()
  for path in PACKAGE_DIR.rglob('*.py'):
    rel = path.parent.relative_to(PACKAGE_DIR)
    found.add('.'.join(rel.parts))
  return sorted(found)


def test_every_package_is_one_layer():
  on_disk = _packages_on_disk()
  listed = [package for package, _ in LAYERS]
  twice = sorted({p for p in listed if listed.count(p) > 1})
  missing = [p for p in on_disk if p not in listed]
  stale = [p for p in listed if p not in on_disk]
  assert not (twice or missing or stale), (
      'tests/test_layering.py LAYERS must name each package of yax/ once: '
      f'missing {missing}, not in the package {stale}, twice {twice}')
  no_init = [p for p in on_disk if p and not (
      PACKAGE_DIR / p.replace('.', '/') / '__init__.py').exists()]
  assert not no_init, f'folders of yax/ without an __init__.py: {no_init}'


def test_package_inits_import_nothing(package):
  bad = [f'{imp.where(PACKAGE_DIR)}: imports {imp.target}'
         for imp in package.imports
         if imp.importer.endswith('.__init__')]
  assert not bad, ("a package's __init__.py imports nothing (its modules are "
                   'imported by their full names):\n  ' + '\n  '.join(bad))


def test_no_import_cycles(package):
  found = cycles(package.imports)
  text = [' -> '.join([c[0].importer] + [i.target for i in c]) + '\n    '
          + '\n    '.join(f'{i.where(PACKAGE_DIR)}: imports {i.target}'
                          for i in c) for c in found]
  assert not found, ('import cycles among yax modules (function-level '
                     'imports count):\n  ' + '\n  '.join(text))


def test_imports_go_down_the_layers(package):
  names = [p or PACKAGE for p, _ in LAYERS]
  where = layer_of()

  def layer(key):
    i = where[package_of(key)]
    return f'layer {i} {names[i]!r}'
  bad = [f'{imp.where(PACKAGE_DIR)}: {imp.importer} ({layer(imp.importer)}) '
         f'imports {imp.target}{"." + imp.name if imp.name else ""} '
         f'({layer(imp.target)})'
         for imp in upward(package.imports)]
  assert not bad, (
      'imports must go down the layers of tests/test_layering.py LAYERS '
      '(lowest first: ' + ' < '.join(names) + '):\n  ' + '\n  '.join(bad))


def test_tools_never_import_tools(package):
  found = between_tools(package.imports)
  pairs = {(i.importer.rpartition('.')[2], i.target.rpartition('.')[2])
           for i in found}
  bad = [f'{imp.where(PACKAGE_DIR)}: {imp.importer} imports {imp.target}'
         for imp in found if (imp.importer.rpartition('.')[2],
                              imp.target.rpartition('.')[2])
         not in TOOL_EXCEPTIONS]
  assert not bad, (
      'a tool never imports another tool (what two tools share belongs in '
      'yax/_src/rewrite or lower):\n  ' + '\n  '.join(bad))
  stale = sorted(set(TOOL_EXCEPTIONS) - pairs)
  assert not stale, (f'TOOL_EXCEPTIONS names imports no tool makes any more '
                     f'(remove them): {stale}')


def test_no_private_names_across_modules(package):
  bad = [f'{imp.where(PACKAGE_DIR)}: {imp.importer} uses {name} of '
         f'{imp.target}' for imp, name in package.private]
  assert not bad, (
      "a module may not use another module's private (_-prefixed) names; "
      'make the name public in its module or keep it local:\n  '
      + '\n  '.join(bad))


def test_jax_and_flax_internals_only_in_compat(package):
  bad = [f'{PACKAGE}/{file_of(m)}:{line}: {name}' for m, line, name in
         package.internals]
  assert not bad, ('JAX/Flax internals may only be used in '
                   'yax/_src/compat.py:\n  ' + '\n  '.join(bad))


# ------------------------------------------- module systems as frontends

TRACE = '_src.trace'  # the frontends of the module systems live here
# What names a module system: the Flax and Equinox packages, and YAX's own
# frontend modules for them (trace/linen*.py, trace/nnx*.py,
# trace/equinox*.py). Everything else reaches a module system through
# trace/systems.py.
SYSTEM_PACKAGES = ('flax.nnx', 'flax.linen', 'equinox')
SYSTEM_FRONTENDS = ('_src.trace.linen', '_src.trace.nnx', '_src.trace.equinox')
# Modules outside trace/ let through for now, (importer, what it imports):
# why. The test fails when one is no longer made, so the list only shrinks.
SYSTEM_EXCEPTIONS: dict[tuple[str, str], str] = {
    ('_src.cli.bundled', 'flax.linen'): 'a bundled example model, in Linen',
    ('_src.cli.bundled_nnx', 'flax.nnx'): 'a bundled example model, in NNX',
    ('_src.tools.fewbit', 'flax.linen'):
        'its replacement module (FewBit) is a Linen module',
    ('_src.tools.lean_norm', 'flax.linen'):
        'its replacement module (LeanNorm) is a Linen module; it replaces '
        'nn.LayerNorm/nn.RMSNorm by type',
}


def system_of(name: str) -> str | None:
  """The module system a dotted name (an outside module or a package
  module key) belongs to, or ``None``."""
  for prefix in SYSTEM_PACKAGES:
    if name == prefix or name.startswith(prefix + '.'):
      return prefix
  for frontend in SYSTEM_FRONTENDS:
    tail = name.rpartition('.')[2]
    if name.startswith(TRACE + '.') and (
        name == frontend or tail.startswith(frontend.rpartition('.')[2] + '_')):
      return name
  return None


def system_imports(found: Scan) -> list[tuple[str, int, str]]:
  """(importer, line, module system) of each import of a module system by
  a module outside trace/ and compat.py."""
  out = [(m, line, system_of(name)) for m, line, name in found.external]
  out += [(i.importer, i.line, system_of(i.target)) for i in found.imports]
  return [(m, line, system) for m, line, system in out
          if system is not None and package_of(m) != TRACE and m != COMPAT]


def test_module_systems_are_reached_through_trace(package):
  found = system_imports(package)
  bad = [f'{PACKAGE}/{file_of(m)}:{line}: {m} imports {system}'
         for m, line, system in found
         if (m, system) not in SYSTEM_EXCEPTIONS]
  assert not bad, (
      'only yax/_src/trace/ (and compat.py) imports a module system (Flax '
      'NNX/Linen, Equinox) or its frontend module; the others use '
      'yax/_src/trace/systems.py:\n  ' + '\n  '.join(bad))
  stale = sorted(set(SYSTEM_EXCEPTIONS) - {(m, s) for m, _, s in found})
  assert not stale, (f'SYSTEM_EXCEPTIONS names imports no module makes any '
                     f'more (remove them): {stale}')


def test_scanner_finds_module_system_imports(tmp_path):
  pkg = _package(tmp_path, {
      '_src/__init__': '', '_src/trace/__init__': '', '_src/tools/__init__': '',
      '_src/trace/nnx': 'from flax import nnx\n',
      '_src/trace/nnx_graph': '', '_src/trace/systems': '',
      '_src/tools/a': ('import flax.linen as nn\nfrom flax import struct\n'
                       'from yax._src.trace import nnx_graph\n'
                       'from yax._src.trace import systems\n'
                       'def f():\n  import equinox as eqx\n'),
      '_src/compat': 'from flax.nnx import graph\n'})
  assert sorted(system_imports(scan(pkg))) == [
      ('_src.tools.a', 1, 'flax.linen'), ('_src.tools.a', 3,
                                          '_src.trace.nnx_graph'),
      ('_src.tools.a', 6, 'equinox')]


def _modules_of(package: str) -> list[str]:
  folder = PACKAGE_DIR / package.replace('.', '/') if package else PACKAGE_DIR
  return sorted(p.stem for p in folder.glob('*.py')
                if not (package and p.name == '__init__.py'))


def test_design_doc_lists_the_layers():
  text = (ROOT / 'docs' / 'design.md').read_text(encoding='utf-8')
  section = re.search(r'^## Layers\n(.*?)(?=^## )', text, re.M | re.S)
  assert section, 'docs/design.md has no "## Layers" section'
  rows = re.findall(r'^\d+\. (.*)$', section.group(1), re.M)
  documented = []
  for row in rows:
    folder = re.match(r'`yax/([\w/]*?)/?`', row)
    package = folder.group(1).replace('/', '.') if folder else None
    documented.append((package, sorted(re.findall(r'`(\w+)\.py`', row))))
  expected = [(package, _modules_of(package)) for package, _ in LAYERS]
  assert documented == expected, (
      'the numbered list of docs/design.md "## Layers" must name the packages '
      'of tests/test_layering.py LAYERS, lowest first, one a line '
      '(`yax/<folder>/`, then each of its modules as `name.py`):\n'
      f'  doc:  {documented}\n  test: {expected}')


# ------------------------------------------- the scanner on known sources

def _package(tmp_path, files: dict[str, str]) -> pathlib.Path:
  pkg = tmp_path / PACKAGE
  pkg.mkdir()
  for name, source in files.items():
    path = pkg / f'{name}.py'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
  return pkg


def test_scanner_sees_every_import_form(tmp_path):
  pkg = _package(tmp_path, {
      '__init__': 'from yax.p.a import f as f\n',
      'p/__init__': '', 'q/__init__': '',
      'p/a': ('from yax.q import b\nimport yax.q.c\nimport yax.q.d as d\n'
              'from . import e\nfrom .f import g\nfrom ..q import h\n'
              'def f():\n  from yax.q.g import h\n  import yax\n'
              '  importlib.import_module("yax.q.h")\n'),
      **{f'q/{m}': '' for m in 'bcdgh'}, 'p/e': '', 'p/f': ''})
  found = {(i.importer, i.target, i.name, i.function)
           for i in scan(pkg).imports}
  assert found == {
      ('__init__', 'p.a', 'f', None), ('p.a', 'q.b', None, None),
      ('p.a', 'q.c', None, None), ('p.a', 'q.d', None, None),
      ('p.a', 'p.e', None, None), ('p.a', 'p.f', 'g', None),
      ('p.a', 'q.h', None, None),
      ('p.a', 'q.g', 'h', 'f'), ('p.a', '__init__', None, 'f'),
      ('p.a', 'q.h', None, 'f')}


def test_scanner_finds_cycles_through_function_level_imports(tmp_path):
  pkg = _package(tmp_path, {
      'p/__init__': '',
      'p/a': 'from yax.p import b\n',
      'p/b': 'def f():\n  from yax.p.c import g\n',
      'p/c': 'import yax.p.a\n', 'p/d': 'from yax.p import a\n'})
  (cycle,) = cycles(scan(pkg).imports)
  assert [(i.importer, i.target) for i in cycle] == [
      ('p.a', 'p.b'), ('p.b', 'p.c'), ('p.c', 'p.a')]
  assert cycle[1].function == 'f'


def test_scanner_finds_private_names(tmp_path):
  pkg = _package(tmp_path, {
      'p/__init__': '',
      'p/a': ('from yax.p.b import _dyn, public\nfrom yax.p import b as _b\n'
              'import yax.p.b\nimport yax.p.b as b\n'
              'x = _b._hidden(), _b.shown(), yax.p.b._deep, b._alias\n'
              'y = _b.__name__, _own\n'),
      'p/b': 'def _dyn(): pass\n'})
  assert sorted((i.importer, i.target, name)
                for i, name in scan(pkg).private) == [
      ('p.a', 'p.b', '_alias'), ('p.a', 'p.b', '_deep'),
      ('p.a', 'p.b', '_dyn'), ('p.a', 'p.b', '_hidden')]


def test_scanner_finds_internals_outside_compat(tmp_path):
  pkg = _package(tmp_path, {
      '_src/__init__': '',
      '_src/a': ('import jax\nfrom jax._src import core\nfrom jax import _src\n'
                 'import flax.core.scope as s\nfrom flax.linen import Dense\n'
                 'from jax.extend import core as jex\nx = jax._src.dtypes\n'
                 'y = jax.numpy.ones\n'),
      '_src/compat': 'from jax._src import core\n'})
  assert sorted((m, line) for m, line, _ in scan(pkg).internals) == [
      ('_src.a', 2), ('_src.a', 3), ('_src.a', 4), ('_src.a', 7)]


def test_upward_and_tool_to_tool_imports_are_found():
  imports = [Import('_src.ir.nodes', '_src.views.printing', None, 1,
                    'Expr.__str__'),
             Import('_src.views.printing', '_src.ir.nodes', 'Expr', 1, None),
             Import('_src.ir.nodes', '_src.errors', 'YaxError', 1, None)]
  assert upward(imports) == imports[:1]
  tools = [Import('_src.tools.quantize', '_src.tools.lora', None, 1, None),
           Import('_src.tools.fewbit', '_src.tools.fewbit_tables', None, 1,
                  None),
           Import('_src.tools.lora', '_src.rewrite.engine', None, 1, None)]
  assert between_tools(tools) == tools[:1]
