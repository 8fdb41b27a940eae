"""Every ```python block of README.md and of the docs pages (docs/*.md) runs as written, each in a
fresh empty directory; every relative link between them points at a file and heading that exist.

A block whose first line says ``no torch`` runs in a process where ``import torch`` fails, so
the onnxruntime-only example really needs nothing but onnxruntime, numpy and onnx.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)
# A block whose first line starts so talks to the server a bash block above it started: tests/test_serve_readme.py
# runs the pair; here it is left out.
NEEDS_SERVER = "# needs the server"
NO_TORCH_PRELUDE = "import sys\nsys.modules['torch'] = None  # README block says: no torch\n"


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(line number, source) of each ```python block of one page."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


def all_blocks() -> list[tuple[str, int, str]]:
    """(page path relative to the root, line number, source) of every ```python block."""
    return [
        (page.relative_to(ROOT).as_posix(), line, source)
        for page in PAGES
        for line, source in python_blocks(page)
        if not source.startswith(NEEDS_SERVER)
    ]


def test_readme_and_docs_have_the_documented_python_blocks() -> None:
    readme = [source for _, source in python_blocks(README)]
    docs = [source for page in DOCS for _, source in python_blocks(page)]
    assert len(readme) >= 2  # the Python API example and the plugin example
    assert len(docs) >= 4  # export, onnxruntime without torch, the transformers model, pypto-cpu
    blocks = {(path, line) for path, line, _ in all_blocks()}
    assert {path for path, _ in blocks} >= {"README.md", "docs/export.md", "docs/plugin-hosts.md",
                                             "docs/decoders.md", "docs/pypto.md"}
    no_torch = [path for path, _, source in all_blocks() if "no torch" in source.splitlines()[0]]
    assert no_torch, "no ```python block starts with `no torch`"  # the onnxruntime-only example


# Pages whose blocks export and run whole models (tens of seconds each): run with -m slow.
SLOW_PAGES = {"docs/decoders.md"}


@pytest.mark.parametrize(
    ("page", "line", "source"),
    [
        pytest.param(path, line, source, id=f"{path}:{line}", marks=[pytest.mark.slow] if path in SLOW_PAGES else [])
        for path, line, source in all_blocks()
    ],
)
def test_python_block_runs(page: str, line: int, source: str, tmp_path: Path) -> None:
    prelude = NO_TORCH_PRELUDE if "no torch" in source.splitlines()[0] else ""
    script = tmp_path / f"{Path(page).stem}_line{line}.py"
    script.write_text(prelude + source)
    # The checkout under test, not whatever copy of pakv_onnx the interpreter would find from tmp_path.
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, script.name],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{page} block at line {line} failed:\n{result.stderr[-4000:]}"


# --------------------------------------------------------------------------- #
# Relative links: README -> docs/x.md#anchor, pages -> ../README.md
# --------------------------------------------------------------------------- #
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```$", re.DOTALL | re.MULTILINE)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a page: lower case, punctuation dropped, spaces to hyphens."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+ (.*)$", FENCE.sub("", page.read_text()), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert broken == []


def test_every_docs_page_is_listed_in_the_index_and_the_readme() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    readme = README.read_text()
    for page in DOCS:
        if page.name == "README.md":
            continue
        assert f"]({page.name})" in index, f"docs/README.md does not list {page.name}"
        assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
