"""Where the commands write: a staging folder beside the output, published by renames at the end.

A command never writes its output folder while it works. :func:`staged_folder` gives it a new hidden
folder in the output's nearest existing ancestor (the same filesystem, so publishing is a rename);
when the block ends normally the folder is published in one step (:func:`_interrupt.commit` first:
after it a Ctrl-C no longer stops the run); when it ends by an exception or Ctrl-C, or the process
by the hard exit, the staging folder is removed. So an interrupted or failed run leaves neither a
half-written file nor a folder that was not there before. :func:`temporary_folder` is the same for
a scratch folder that is never published.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from pakv_onnx.commands import _interrupt

STAGING_PREFIX = ".pakv-onnx-partial-"


def staging_base(target: Path) -> Path:
    """Where :func:`staged_folder` stages ``target`` (absolute): inside it when it is a folder already
    (its entries are moved out of there), else in the nearest existing ancestor of its parent (the
    whole folder is renamed into place). Either way on ``target``'s filesystem, and no folder is made."""
    if target.is_dir():
        return target
    return next(p for p in target.parents if os.path.lexists(p))


@contextlib.contextmanager
def temporary_folder(prefix: str) -> Iterator[Path]:
    """A new folder under the temporary directory (``TMPDIR``), removed when the block ends, by an
    exception, or by the hard exit of a Ctrl-C."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    forget = _interrupt.on_hard_exit(lambda: _interrupt.remove_folder(folder))
    try:
        yield folder
    finally:
        _interrupt.remove_folder(folder)
        forget()


@contextlib.contextmanager
def staged_folder(target: Path, *, replace: Sequence[str] = ()) -> Iterator[Path]:
    """An empty staging folder (in :func:`staging_base`) for what is to become ``target`` (new, or an
    existing folder; checked by :func:`pakv_onnx.commands._args.output_folder_problem`).

    When the block ends normally the staging folder is published: it becomes ``target`` (a new
    target: one rename, its missing parents made then) or its entries replace those of the same
    names in ``target`` (an existing one; the names in ``replace`` are removed from ``target`` first:
    files of an earlier output that this one has not). Otherwise it is removed.
    """
    target = Path(target).absolute()
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}{STAGING_PREFIX}", dir=staging_base(target)))
    forget = _interrupt.on_hard_exit(lambda: _interrupt.remove_folder(staging))
    try:
        yield staging
        _interrupt.commit()
        _publish(staging, target, replace)
    finally:
        _interrupt.remove_folder(staging)  # published: already gone
        forget()


def _publish(staging: Path, target: Path, replace: Sequence[str]) -> None:
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's 0700 would be a surprise on the user's folder
        os.rename(staging, target)
        return
    for name in replace:
        (target / name).unlink(missing_ok=True)
    for entry in sorted(staging.iterdir()):  # staging lies inside target here
        destination = target / entry.name
        if destination.is_dir() and not destination.is_symlink():
            shutil.rmtree(destination)
        os.replace(entry, destination)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
