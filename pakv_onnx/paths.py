"""Where pakv-onnx keeps files it makes: one cache directory the project controls.

``$PAKV_ONNX_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/pakv-onnx`` (an absolute XDG path only,
as the XDG spec says), else ``$HOME/.cache/pakv-onnx``. Nothing is ever written to the current
directory, and never to the filesystem root: an empty or relative ``HOME`` is an error that says
to set ``PAKV_ONNX_CACHE_DIR``, as is a cache directory that cannot be created or written.

A directory pakv-onnx creates (or finds empty) gets a ``CACHEDIR.TAG`` (the Cache Directory
Tagging convention: backup tools skip it); ``pakv-onnx cache --clear`` empties a directory given
by ``PAKV_ONNX_CACHE_DIR`` only if it carries that tag, so pointing the variable at a directory of
your own by mistake never gets it wiped.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

CACHE_DIR_ENV = "PAKV_ONNX_CACHE_DIR"
CACHEDIR_TAG = "CACHEDIR.TAG"
# The tag's first line is fixed by the convention (https://bford.info/cachedir/).
CACHEDIR_TAG_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by pakv-onnx.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)


class CacheDirError(OSError):
    """The cache directory cannot be chosen, created or written.

    The message is one line naming the path (or the variable at fault) and saying to set
    ``PAKV_ONNX_CACHE_DIR``; the CLI prints it as is.
    """


def _hint() -> str:
    return f"set {CACHE_DIR_ENV} to a writable directory"


def cache_root() -> Path:
    """The cache directory's absolute path, without creating anything.

    Raises:
        CacheDirError: neither ``PAKV_ONNX_CACHE_DIR`` nor an absolute ``XDG_CACHE_HOME`` is set
            and ``HOME`` is empty or relative (``Path.home()`` would then give ``/`` or the cwd).
    """
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "pakv-onnx"
    home = os.environ.get("HOME")
    if home is None:  # unset: the password database says where home is
        home = str(Path.home())
    if not os.path.isabs(home):
        shown = "empty" if not home else f"relative ({home!r})"
        raise CacheDirError(f"cannot place the pakv-onnx cache: HOME is {shown}; {_hint()}")
    return Path(home) / ".cache" / "pakv-onnx"


def cache_dir(*parts: str) -> Path:
    """The project's cache directory (or a subdirectory of it), created on first use.

    Raises:
        CacheDirError: the directory cannot be placed, created or written (one line naming the
            path and ``PAKV_ONNX_CACHE_DIR``).
    """
    root = cache_root()
    _ensure_root(root)
    path = root.joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CacheDirError(f"cannot create the pakv-onnx cache directory {path}: {err.strerror}; {_hint()}") from err
    if not os.access(path, os.W_OK | os.X_OK):
        raise CacheDirError(f"the pakv-onnx cache directory {path} is not writable; {_hint()}")
    return path


def _ensure_root(root: Path) -> None:
    """Create ``root`` and tag it when pakv-onnx makes it (or finds it empty)."""
    try:
        fresh = not root.exists() or (root.is_dir() and not any(root.iterdir()))
        root.mkdir(parents=True, exist_ok=True)
        if fresh and not (root / CACHEDIR_TAG).exists():
            # Write then rename: concurrent first uses (parallel subprocesses) never see half a tag.
            fd, tmp = tempfile.mkstemp(dir=root, prefix=".tag-")
            with os.fdopen(fd, "w") as f:
                f.write(CACHEDIR_TAG_TEXT)
            os.replace(tmp, root / CACHEDIR_TAG)
    except OSError as err:
        raise CacheDirError(f"cannot create the pakv-onnx cache directory {root}: {err.strerror}; {_hint()}") from err


def is_tagged(root: Path) -> bool:
    """Whether ``root`` carries the ``CACHEDIR.TAG`` pakv-onnx writes (so pakv-onnx made it)."""
    try:
        return (root / CACHEDIR_TAG).read_text().startswith(CACHEDIR_TAG_TEXT.splitlines()[0])
    except OSError:
        return False


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One top-level entry of the cache directory and its size on disk."""

    name: str
    is_dir: bool
    size_bytes: int


def tree_size(path: Path) -> int:
    """Bytes of the regular files under ``path`` (symlinks not followed; unreadable parts skipped)."""
    if path.is_symlink() or not path.is_dir():
        try:
            return path.lstat().st_size
        except OSError:
            return 0
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path, onerror=lambda err: None):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def cache_entries(root: Path) -> list[CacheEntry]:
    """The top-level entries of ``root`` (the tag left out), largest first; none if it is absent."""
    if not root.is_dir():
        return []
    entries = [
        CacheEntry(p.name, p.is_dir() and not p.is_symlink(), tree_size(p))
        for p in root.iterdir()
        if p.name != CACHEDIR_TAG
    ]
    return sorted(entries, key=lambda e: (-e.size_bytes, e.name))


def clear_cache(root: Path) -> int:
    """Delete everything in ``root`` but its tag; returns the bytes freed.

    Raises:
        CacheDirError: ``root`` was given by ``PAKV_ONNX_CACHE_DIR`` and does not carry
            pakv-onnx's ``CACHEDIR.TAG`` (so it may be a directory of the user's own, which is
            never emptied). The default location (``.../pakv-onnx``) is pakv-onnx's by its name.
    """
    if not root.is_dir():
        return 0
    if os.environ.get(CACHE_DIR_ENV) and not is_tagged(root):
        raise CacheDirError(
            f"not clearing {root}: it has no {CACHEDIR_TAG} from pakv-onnx, so it may hold files of your own; "
            "delete what you want there yourself"
        )
    freed = 0
    for entry in root.iterdir():
        if entry.name == CACHEDIR_TAG:
            continue
        freed += tree_size(entry)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return freed


def pypto_output_env(base: Path) -> dict[str, str]:
    """Environment variables that send everything PyPTO writes (outputs, logs, run records) under ``base``.

    Without them PyPTO writes ``./output``, ``~/ascend/log`` and ``~/.pypto`` on import and on
    every compile.
    """
    return {
        "PYPTO_HOME": str(base / "home" / ".pypto"),
        "TILE_FWK_OUTPUT_DIR": str(base / "output"),
        "ASCEND_PROCESS_LOG_PATH": str(base / "ascend_log"),
    }
