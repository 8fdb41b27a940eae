"""Another thread changing one int64 entry (a block table's) while calls read it, without Python's GIL:
tests/native/table_flipper.c, compiled on first use, run from a Python thread through ctypes (which
releases the GIL for the call), so the flips go on during the whole call, validation included."""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "native" / "table_flipper.c"
_library: ctypes.CDLL | None = None


def _flipper_library() -> ctypes.CDLL:
    global _library
    if _library is None:
        out = Path(tempfile.mkdtemp(prefix="pakv-flipper-")) / "libtable_flipper.so"
        subprocess.run(["gcc", "-std=c11", "-O1", "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(out), str(SOURCE)], check=True)
        _library = ctypes.CDLL(str(out))
        _library.pakv_test_flip.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        _library.pakv_test_flip.restype = None
    return _library


class Flipping:
    """``with Flipping(address, a, b):`` the int64 at ``address`` flips between ``a`` and ``b`` (ending at
    ``b``) until the block exits."""

    def __init__(self, address: int, a: int, b: int) -> None:
        self.stop = ctypes.c_int32(0)
        library = _flipper_library()
        self.thread = threading.Thread(
            target=library.pakv_test_flip, args=(address, a, b, ctypes.addressof(self.stop)), daemon=True
        )

    def __enter__(self) -> Flipping:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.value = 1
        self.thread.join()
