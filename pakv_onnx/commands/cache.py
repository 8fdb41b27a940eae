"""``pakv-onnx cache``: show (and with ``--clear`` empty) the project's cache directory."""

from __future__ import annotations

import argparse

from pakv_onnx import paths
from pakv_onnx.commands import _args


def human_size(size_bytes: int) -> str:
    """``1.5 MB``-style size (powers of 1000, like ``du --si``)."""
    size = float(size_bytes)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def run(args: argparse.Namespace) -> int:
    root = paths.cache_root()  # CacheDirError (HOME empty ...) is printed as one line by the CLI
    entries = paths.cache_entries(root)
    where = "" if root.is_dir() else " (does not exist yet: nothing cached)"
    print(f"cache directory: {root}{where}")
    for entry in entries:
        name = entry.name + ("/" if entry.is_dir else "")
        print(f"  {name:<40} {human_size(entry.size_bytes):>10}")
    total = sum(e.size_bytes for e in entries)
    print(f"total {human_size(total)} in {len(entries)} entries")
    if args.clear:
        freed = paths.clear_cache(root)
        print(f"cleared: freed {human_size(freed)}")
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = _args.add_command(
        commands,
        "cache",
        help="show the cache directory and its size per entry; --clear empties it",
        description=(
            "Show pakv-onnx's cache directory ($PAKV_ONNX_CACHE_DIR, else $XDG_CACHE_HOME/pakv-onnx, else "
            "~/.cache/pakv-onnx) with the size of each top-level entry (PyPTO's helper build, run "
            "directories kept from failed runs, ...). With --clear, delete everything in it; a "
            "directory given by $PAKV_ONNX_CACHE_DIR is only emptied if it carries pakv-onnx's "
            "CACHEDIR.TAG. Everything there is rebuilt on demand."
        ),
        examples=[
            "",
            "--clear",
        ],
    )
    parser.add_argument("--clear", action="store_true", help="delete everything in the cache directory")
    parser.set_defaults(run=run)
