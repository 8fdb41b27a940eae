"""Facts the C library and Python share are written once or checked here (issue 9.2-9.3):

* the C cache dtype table (pakv_dtypes.h) equals spec.CACHE_DTYPES, in order;
* the ctypes mirrors (Plan, Tensor, Request) match the C structs: the library reports its ABI version and
  struct sizes and the loader refuses a mismatch;
* the library exports exactly the functions the loader declares (no dead exports);
* ORT slot numbers live only in ort_abi.h (the fake-ORT driver includes it, keeps no table).
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pakv_onnx import native_lib
from pakv_onnx.spec import CACHE_DTYPES

SOURCES = Path(native_lib.__file__).parent
DRIVER = Path(__file__).parent / "native" / "fake_ort_driver.c"


def test_c_dtype_table_matches_spec() -> None:
    text = (SOURCES / "pakv_dtypes.h").read_text()
    start = text.index("PAKV_CACHE_DTYPES[] = {")
    body = text[start : text.index("};", start)]
    rows = [(int(t), int(s), n) for t, s, n in re.findall(r'\{(\d+), (\d+), "([a-z0-9_]+)"\}', body)]
    assert rows == [(d.onnx_type, d.itemsize, d.name) for d in CACHE_DTYPES]


def test_struct_sizes_and_abi_version_match_the_library() -> None:
    lib = native_lib.load()
    assert lib.pakv_abi_version() == native_lib.ABI_VERSION
    assert lib.pakv_plan_size() == ctypes.sizeof(native_lib.Plan)
    assert lib.pakv_request_size() == ctypes.sizeof(native_lib.Request)
    header = (SOURCES / "pakv_core.h").read_text()
    assert f"#define PAKV_ABI_VERSION {native_lib.ABI_VERSION}\n" in header
    # Field order: the ctypes mirror names the C fields in the same order.
    c_fields = re.findall(r"^\s+[a-z0-9_ *]+?\b(\w+)(?:\[\w+\])?;", header[header.index("typedef struct pakv_plan") :], re.M)
    assert [name for name, _ in native_lib.Plan._fields_] == c_fields[: len(native_lib.Plan._fields_)]
    assert lib.pakv_tensor_size() == ctypes.sizeof(native_lib.Tensor)
    assert lib.pakv_gather_call_size() == ctypes.sizeof(native_lib.GatherCall)
    assert lib.pakv_scatter_plan_size() == ctypes.sizeof(native_lib.ScatterPlan)
    assert lib.pakv_scatter_call_size() == ctypes.sizeof(native_lib.ScatterCall)
    contract = (SOURCES / "pakv_contract.h").read_text()
    record = contract[contract.index("typedef struct {") : contract.index("} pakv_tensor;")]
    c_fields = re.findall(r"^\s+[a-z0-9_ *]+?\b(\w+)(?:\[\w+\])?;", record, re.M)
    assert [name for name, _ in native_lib.Tensor._fields_] == c_fields


def test_loader_refuses_a_library_with_another_abi() -> None:
    class Stale:
        """A library built from older sources: other ABI version and plan size, every other size right."""

        def __getattr__(self, name):
            real = getattr(native_lib.load(), name)
            return lambda: real()

        def pakv_abi_version(self):
            return native_lib.ABI_VERSION - 1

        def pakv_plan_size(self):
            return ctypes.sizeof(native_lib.Plan) - 8

    stale = rf"ABI version is {native_lib.ABI_VERSION - 1} in the library, {native_lib.ABI_VERSION} here.*rebuild"
    with pytest.raises(native_lib.LibraryABIError, match=stale):
        native_lib.check_abi(Stale(), "/stale/libpakv_ort.so")


def test_front_extension_writes_records_of_the_mirrors_size_and_is_refused_otherwise(monkeypatch) -> None:
    assert native_lib.front().record_size() == ctypes.sizeof(native_lib.Tensor)

    class Stale:
        __file__ = "/stale/_front.abi3.so"

        @staticmethod
        def record_size():
            return ctypes.sizeof(native_lib.Tensor) + 8

    monkeypatch.setitem(sys.modules, "pakv_onnx.native_lib._front", Stale)
    monkeypatch.setattr(native_lib, "_front", Stale, raising=False)
    native_lib.front.cache_clear()
    try:
        with pytest.raises(native_lib.LibraryABIError, match=r"records of \d+ bytes.*rebuild"):
            native_lib.front()
    finally:
        native_lib.front.cache_clear()


def test_each_mirror_is_exported_under_its_own_name() -> None:
    from pakv_onnx.native_lib import _abi

    assert len(_abi.MIRRORS) == 11
    for name, cls in _abi.MIRRORS.items():
        assert getattr(native_lib, name) is cls and cls.__name__ == name


def test_library_exports_exactly_what_the_loader_declares() -> None:
    nm = shutil.which("nm")
    assert nm, "nm (binutils) is needed to list the library's exports"
    listing = subprocess.run([nm, "-D", "--defined-only", native_lib.library_path()], capture_output=True, text=True)
    exported = {line.split()[-1] for line in listing.stdout.splitlines() if " T " in line}
    assert exported == {"RegisterCustomOps", *native_lib.SIGNATURES}


def test_ort_slot_numbers_are_written_only_in_ort_abi_h() -> None:
    slots = re.findall(r"PAKV_SLOT_(\w+) = (\d+)", (SOURCES / "ort_abi.h").read_text())
    assert len(slots) > 20
    others = [*SOURCES.glob("*.c"), DRIVER]
    for path in others:
        text = path.read_text()
        assert not re.search(r"g_table\[\d+\]|\[PAKV_SLOT_\w+\] = |api\)\[\d+\]", text), path
    assert "#include \"ort_abi.h\"" in DRIVER.read_text()
    assert "PAKV_CACHE_DTYPES" in DRIVER.read_text() and "TYPES[11]" not in DRIVER.read_text()


def test_fake_runtime_mirrors_the_op_struct_and_reads_slots_from_ort_abi_h() -> None:
    """tests/fake_ort_api.py's CustomOp names PakvOrtCustomOp's fields in ort_abi.h's order, and its
    slot numbers are ort_abi.h's (it parses them; it writes none)."""
    import fake_ort_api

    header = (SOURCES / "ort_abi.h").read_text()
    struct = header[header.index("typedef struct PakvOrtCustomOp {") : header.index("} PakvOrtCustomOp;")]
    c_fields = re.findall(r"^\s+(?:[\w* ]+?\(\*(\w+)\)|[\w* ]+?\b(\w+)(?:\[\w+\])?;)", struct, re.M)
    names = [a or b for a, b in c_fields]
    mirror = [name for name, _ in fake_ort_api.CustomOp._fields_]
    assert names[: len(mirror)] == mirror
    assert fake_ort_api.SLOTS == {n: int(v) for n, v in re.findall(r"PAKV_SLOT_(\w+) = (\d+)", header)}


def test_driver_signatures_are_declared_only_in_device_abi_h() -> None:
    for path in [*SOURCES.glob("*.c"), *SOURCES.glob("*.h")]:
        if path.name == "device_abi.h":
            continue
        text = path.read_text()
        assert not re.search(r"typedef\s+\w+\s*\(\*\s*pakv_(cu|acl)\w*_fn\)", text), path
        assert "#include <cuda" not in text and "#include <acl" not in text, path
