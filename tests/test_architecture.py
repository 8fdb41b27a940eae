"""No import reaches upward or sideways across the package's layers (docs/architecture.md).

The layer order is written once, in the ```layers block of docs/architecture.md; this test reads
it, parses every module of ``pakv_onnx`` with ``ast`` (module-level and lazy imports,
``importlib.import_module("pakv_onnx...")`` calls included) and fails on an import of a unit that
is not strictly below the importer's layer. The checker itself is tested on synthetic modules and
on a copy of the package with an upward import added.

Within a layer the house has no circles either: files are rooms, imports (Python) and the use of a
function or table another C file defines (the library's units: what the linker resolves between
them) are arrows, and no two rooms reach each other. Shared names move down a floor instead.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "pakv_onnx"
DOC = ROOT / "docs" / "architecture.md"


def read_layers(doc: str) -> dict[str, int]:
    """``{unit: rank}`` from the doc's ```layers block (lines ``rank | units | description``)."""
    match = re.search(r"^```layers\n(.*?)^```", doc, re.S | re.M)
    assert match, "docs/architecture.md has no ```layers block"
    layers: dict[str, int] = {}
    for line in match.group(1).splitlines():
        if not line.strip():
            continue
        rank, units, _what = (part.strip() for part in line.split("|", 2))
        for unit in units.split():
            assert unit not in layers, f"{unit} is in two layers"
            layers[unit] = int(rank)
    return layers


def package_modules(package_dir: Path) -> dict[str, Path]:
    """Every module of the package under ``package_dir``: dotted name -> file."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


@dataclasses.dataclass(frozen=True)
class Import:
    line: int
    target: str  # dotted module inside the package


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module of ``from <node.module> import ...`` (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, source: str, known: set[str], is_package: bool = False) -> list[Import]:
    """The package modules ``source`` imports, anywhere in the file.

    ``from pakv_onnx.x import y`` imports ``pakv_onnx.x.y`` when that is a module (``known``),
    else ``pakv_onnx.x``; ``importlib.import_module("pakv_onnx...")`` with a literal name counts.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                targets = [node.args[0].value]
        found += [Import(node.lineno, t) for t in targets if t == PACKAGE or t.startswith(PACKAGE + ".")]
    return found


def unit_of(module: str, layers: dict[str, int]) -> str | None:
    """The layer unit of a package module: the longest dotted prefix (below ``pakv_onnx``) in ``layers``."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in layers:
            return ".".join(parts[:n])
    return PACKAGE if not parts and PACKAGE in layers else None


def violations(module: str, found: list[Import], layers: dict[str, int]) -> list[str]:
    """One line per import of a unit that is not strictly below ``module``'s layer (its own unit is fine)."""
    unit = unit_of(module, layers)
    assert unit is not None, f"{module} is in no layer of docs/architecture.md"
    bad = []
    for imp in found:
        target = unit_of(imp.target, layers)
        assert target is not None, f"{module}:{imp.line} imports {imp.target}, which is in no layer"
        if target != unit and layers[target] >= layers[unit]:
            where = "above" if layers[target] > layers[unit] else "beside"
            bad.append(
                f"{module}:{imp.line} imports {imp.target} ({target}, layer {layers[target]}) "
                f"{where} {unit} (layer {layers[unit]})"
            )
    return bad


def check_tree(package_dir: Path, layers: dict[str, int]) -> list[str]:
    modules = package_modules(package_dir)
    known = set(modules)
    bad = []
    for module, path in modules.items():
        found = imports_of(module, path.read_text(), known, is_package=path.name == "__init__.py")
        bad += violations(module, found, layers)
    return bad


LAYERS = read_layers(DOC.read_text())


# --------------------------------------------------------------------------- #
# The tree
# --------------------------------------------------------------------------- #
def test_every_module_has_a_layer() -> None:
    homeless = [m for m in package_modules(ROOT / PACKAGE) if unit_of(m, LAYERS) is None]
    assert homeless == [], f"place these in the layers table of docs/architecture.md: {homeless}"


def test_no_import_reaches_upward_or_sideways() -> None:
    bad = check_tree(ROOT / PACKAGE, LAYERS)
    assert bad == [], "\n".join(bad)


# --------------------------------------------------------------------------- #
# The checker can fail
# --------------------------------------------------------------------------- #
KNOWN = {
    "pakv_onnx",
    "pakv_onnx.spec",
    "pakv_onnx.golden",
    "pakv_onnx.native_lib",
    "pakv_onnx.kernels",
    "pakv_onnx.kernels.native",
    "pakv_onnx.export",
    "pakv_onnx.export.builder",
    "pakv_onnx.runtime_plugin",
    "pakv_onnx.models",
}


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("pakv_onnx.spec", "def f():\n    from pakv_onnx.kernels import Backend\n", "above spec"),
        ("pakv_onnx.golden", "import pakv_onnx.models.gqa\n", "above golden"),
        ("pakv_onnx.kernels.native", "from pakv_onnx import runtime_plugin\n", "above kernels"),
        ("pakv_onnx.export.builder", "from pakv_onnx.runtime_plugin import _tensors\n", "beside export"),
        ("pakv_onnx.runtime_plugin", "from ..export import builder\n", "beside runtime_plugin"),
        ("pakv_onnx.kernels", "import importlib\nimportlib.import_module('pakv_onnx.export')\n", "above kernels"),
        ("pakv_onnx.spec", "from pakv_onnx import gather_pa_kv_cache\n", "above spec"),
    ],
)
def test_the_checker_catches_upward_and_sideways_imports(module: str, source: str, expected: str) -> None:
    is_package = module in ("pakv_onnx.runtime_plugin",)
    bad = violations(module, imports_of(module, source, KNOWN, is_package), LAYERS)
    assert len(bad) == 1 and expected in bad[0], bad


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("pakv_onnx.kernels.native", "from pakv_onnx.spec import GatherPlan\nfrom pakv_onnx import native_lib\n"),
        ("pakv_onnx.kernels.native", "from pakv_onnx.kernels import Backend\n"),  # its own unit
        ("pakv_onnx.models", "from pakv_onnx.export import export\nimport torch\n"),
        ("pakv_onnx.export.builder", "from . import schema\n"),
    ],
)
def test_the_checker_allows_downward_and_own_unit_imports(module: str, source: str) -> None:
    is_package = module == "pakv_onnx.models"
    assert violations(module, imports_of(module, source, KNOWN, is_package), LAYERS) == []


def test_an_upward_import_added_to_a_copy_of_the_package_is_caught(tmp_path: Path) -> None:
    copy = tmp_path / PACKAGE
    shutil.copytree(ROOT / PACKAGE, copy, ignore=shutil.ignore_patterns("*.so", "*.c", "*.h", "__pycache__", "data"))
    assert check_tree(copy, LAYERS) == []  # the copy is as clean as the tree
    spec = copy / "spec.py"
    spec.write_text(spec.read_text() + "\n\ndef _sneaky():\n    from pakv_onnx.runtime_plugin import make_session\n")
    (bad,) = check_tree(copy, LAYERS)
    assert bad.startswith("pakv_onnx.spec:") and "runtime_plugin" in bad and "above spec" in bad
    (copy / "newthing.py").write_text("X = 1\n")
    assert "pakv_onnx.newthing is in no layer" in _assertion_text(lambda: check_tree(copy, LAYERS))


def _assertion_text(call) -> str:
    with pytest.raises(AssertionError) as info:
        call()
    return str(info.value)


# --------------------------------------------------------------------------- #
# No circles: no two rooms (files) reach each other through imports / calls
# --------------------------------------------------------------------------- #
def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one room in ``arrows`` (room -> rooms it uses), each
    sorted: rooms that reach each other (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(room: str) -> None:
        index[room] = low[room] = len(index)
        stack.append(room)
        for other in sorted(arrows.get(room, ())):
            if other not in index:
                visit(other)
                low[room] = min(low[room], low[other])
            elif other in stack:
                low[room] = min(low[room], index[other])
        if low[room] == index[room]:
            group = []
            while not group or group[-1] != room:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for room in sorted(arrows):
        if room not in index:
            visit(room)
    return sorted(found)


def python_arrows(package_dir: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in the file), itself left out."""
    modules = package_modules(package_dir)
    known = set(modules)
    return {
        module: {i.target for i in imports_of(module, path.read_text(), known, path.name == "__init__.py")} - {module}
        for module, path in modules.items()
    }


_C_TOKENS = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|/\*.*?\*/|//[^\n]*', re.S)
_C_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def c_code(text: str) -> str:
    """C source without comments, string / char contents and preprocessor lines."""
    text = _C_TOKENS.sub(lambda m: '""' if m.group(0)[0] in "\"'" else " ", text)
    return re.sub(r"^\s*#[^\n]*(\\\n[^\n]*)*", " ", text, flags=re.M)


def _top_level_statements(code: str):
    """Each file-scope declaration or definition of ``code`` (a function with its body)."""
    depth, start = 0, 0
    for i, ch in enumerate(code):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0 and ch == "}" and not code[i + 1 :].lstrip().startswith(";") and "=" not in code[start:i].split("{")[0]:
                yield code[start : i + 1]
                start = i + 1
        elif ch == ";" and depth == 0:
            yield code[start : i + 1]
            start = i + 1


def c_definitions(code: str) -> set[str]:
    """The functions and tables ``code`` defines for other files (file-scope, not static)."""
    names = set()
    for statement in _top_level_statements(code):
        head = statement.split("{", 1)[0]
        if {"static", "extern", "typedef"} & set(_C_IDENTIFIER.findall(head)):
            continue
        if "=" in head:
            match = re.search(r"(\w+)\s*(\[[^\]]*\]\s*)*=", head)
        else:
            match = re.search(r"(\w+)\s*\(", head) if "{" in statement else None
        if match:
            names.add(match.group(1))
    return names


def c_arrows(folder: Path) -> dict[str, set[str]]:
    """C file (its stem) -> the C files whose functions or tables it uses."""
    codes = {path.stem: c_code(path.read_text()) for path in sorted(folder.glob("*.c"))}
    owner = {name: room for room, code in codes.items() for name in c_definitions(code)}
    return {
        room: {owner[w] for w in set(_C_IDENTIFIER.findall(code)) if w in owner and owner[w] != room}
        for room, code in codes.items()
    }


def test_no_import_circle_among_the_python_modules() -> None:
    assert circles(python_arrows(ROOT / PACKAGE)) == []


def test_no_circle_among_the_c_units() -> None:
    assert circles(c_arrows(ROOT / PACKAGE / "native_lib")) == []


def test_the_circle_checks_find_a_circle(tmp_path: Path) -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    package = tmp_path / "pakv_onnx"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "one.py").write_text("def f():\n    from pakv_onnx.sub.two import g\n")
    (package / "sub" / "two.py").write_text("from pakv_onnx.sub import one\n")
    assert circles(python_arrows(package)) == [["pakv_onnx.sub.one", "pakv_onnx.sub.two"]]
    library = tmp_path / "lib"
    library.mkdir()
    (library / "low.c").write_text('#include "x.h"\nint low_fail(int e) { return -e; }\n/* high_run() */\n')
    (library / "mid.c").write_text('static int helper(void) { return 1; }\nconst char* const NAMES[] = {"a // b"};\n'
                                   "int mid_run(void) { return low_fail(helper()); }\n")
    (library / "high.c").write_text("int high_run(void) {\n  return mid_run() + (int)sizeof(NAMES);\n}\n")
    assert c_arrows(library) == {"low": set(), "mid": {"low"}, "high": {"mid"}} and circles(c_arrows(library)) == []
    (library / "low.c").write_text("int low_fail(int e) { return e ? high_run() : 0; }\n")
    assert circles(c_arrows(library)) == [["high", "low", "mid"]]


# --------------------------------------------------------------------------- #
# The C library stays readable as it grows: no C unit over MAX_C_LINES lines
# --------------------------------------------------------------------------- #
MAX_C_LINES = 450


def oversized_c_files(folder: Path, limit: int = MAX_C_LINES) -> dict[str, int]:
    """``{file name: lines}`` of the C sources and headers in ``folder`` longer than ``limit``."""
    sizes = {path.name: len(path.read_text().splitlines()) for path in [*folder.glob("*.c"), *folder.glob("*.h")]}
    return {name: lines for name, lines in sizes.items() if lines > limit}


def test_no_c_file_of_the_library_is_over_450_lines() -> None:
    """Each op's contract, core and glue in units of their own: a unit past the limit is split, not grown."""
    assert oversized_c_files(ROOT / PACKAGE / "native_lib") == {}


def test_the_c_size_check_finds_a_long_file(tmp_path: Path) -> None:
    (tmp_path / "long.c").write_text("int x;\n" * (MAX_C_LINES + 1))
    (tmp_path / "short.h").write_text("int y;\n" * MAX_C_LINES)
    assert oversized_c_files(tmp_path) == {"long.c": MAX_C_LINES + 1}
