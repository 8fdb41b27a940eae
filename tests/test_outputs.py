"""commands/_outputs.py: a command's output is staged beside its target and published whole, or
not at all (an exception, Ctrl-C): no half-written file, no folder that was not there before."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pakv_onnx.commands import _interrupt, _outputs


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_new_target_is_one_rename_with_its_parents_made_then(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "out"
    with _outputs.staged_folder(target) as staging:
        assert staging.parent == tmp_path and staging.name.startswith(f".out{_outputs.STAGING_PREFIX}")
        assert not (tmp_path / "a").exists()  # nothing made before the publish
        (staging / "model.onnx").write_text("m")
        (staging / "data").mkdir()
        (staging / "data" / "x.pb").write_text("x")
    assert _listing(tmp_path) == ["a", "a/b", "a/b/out", "a/b/out/data", "a/b/out/data/x.pb", "a/b/out/model.onnx"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~umask  # not mkdtemp's 0700


def test_an_existing_folder_gets_the_entries_and_keeps_the_others(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    (target / "model.onnx").write_text("old")
    (target / "model.onnx.data").write_text("old weights")
    (target / "data").mkdir()
    (target / "data" / "stale.pb").write_text("old")
    with _outputs.staged_folder(target, replace=("model.onnx.data",)) as staging:
        assert staging.parent == target  # staged inside it: its own filesystem, no other folder touched
        (staging / "model.onnx").write_text("new")
        (staging / "data").mkdir()
        (staging / "data" / "x.pb").write_text("x")
    assert _listing(tmp_path) == ["out", "out/data", "out/data/x.pb", "out/model.onnx", "out/notes.txt"]
    assert (target / "model.onnx").read_text() == "new" and (target / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("exists", [False, True])
@pytest.mark.parametrize("ending", [RuntimeError, KeyboardInterrupt])
def test_a_failed_or_interrupted_block_leaves_nothing(tmp_path: Path, exists: bool, ending: type) -> None:
    target = tmp_path / "new" / "out"
    if exists:
        target.mkdir(parents=True)
        (target / "model.onnx").write_text("old")
    before = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    with pytest.raises(ending), _outputs.staged_folder(target) as staging:
        (staging / "model.onnx").write_text("half")
        raise ending()
    assert {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")} == before


def test_the_publish_is_the_last_safe_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that came while the block ran stops the publish; once published, the run is committed."""
    state = _interrupt.State()
    monkeypatch.setattr(_interrupt, "STATE", state)
    with pytest.raises(KeyboardInterrupt), _outputs.staged_folder(tmp_path / "out") as staging:
        (staging / "f").write_text("x")
        state.requested = True
    assert _listing(tmp_path) == [] and not state.committed
    state.requested = False
    with _outputs.staged_folder(tmp_path / "out") as staging:
        (staging / "f").write_text("x")
    assert state.committed and _listing(tmp_path) == ["out", "out/f"]
    state.requested = True
    _interrupt.check()  # committed: a Ctrl-C no longer stops the run


def test_a_temporary_folder_is_removed_and_registered_for_the_hard_exit(tmp_path: Path, monkeypatch) -> None:
    state = _interrupt.State()
    monkeypatch.setattr(_interrupt, "STATE", state)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    with _outputs.temporary_folder("pakv-onnx-test-") as folder:
        (folder / "f").write_text("x")
        assert len(state.cleanups) == 1
        state.cleanups[0]()  # what the hard exit would run
        assert not folder.exists()
    assert state.cleanups == [] and _listing(tmp_path) == []
