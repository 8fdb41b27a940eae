"""A fake ``OrtApiBase`` (ctypes) for driving the library's ``RegisterCustomOps`` without ONNX Runtime.

``fake_ort({slot: ctypes function}, api_version=N)`` serves an ``OrtApi`` table up to version N
(``GetApi`` returns NULL above it) and records every version asked for;
:func:`register_custom_ops` calls the library's entry point with it.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Mapping

GET_API = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)
VERSION_STRING = ctypes.CFUNCTYPE(ctypes.c_void_p)  # returns a char* we own (no ctypes conversion)


class ApiBase(ctypes.Structure):
    _fields_ = [("GetApi", GET_API), ("GetVersionString", VERSION_STRING)]


@dataclasses.dataclass
class FakeOrt:
    base: ApiBase
    requested: list[int]  # the API versions GetApi was asked for, in order
    keep: list  # every ctypes object the C side may call or read, alive as long as this is


def fake_ort(functions: Mapping[int, object], *, api_version: int, version: bytes | None = None, slots: int = 300):
    """An OrtApiBase whose API table has ``functions`` at their slots; ``version``: GetVersionString's text."""
    table = (ctypes.c_void_p * slots)()
    for slot, fn in functions.items():
        table[slot] = ctypes.cast(fn, ctypes.c_void_p)
    requested: list[int] = []
    text = ctypes.create_string_buffer(version) if version is not None else None

    @GET_API
    def get_api(asked: int):
        requested.append(asked)
        return ctypes.addressof(table) if asked <= api_version else None

    @VERSION_STRING
    def version_string():
        return ctypes.addressof(text) if text is not None else None

    keep = [table, dict(functions), text, get_api, version_string]
    return FakeOrt(ApiBase(get_api, version_string), requested, keep)


def register_custom_ops(lib: ctypes.CDLL, options_address: int | None, fake: FakeOrt) -> int | None:
    """``RegisterCustomOps(options, api_base)``: the returned OrtStatus* (None = success)."""
    register = lib.RegisterCustomOps
    register.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    register.restype = ctypes.c_void_p
    return register(options_address, ctypes.addressof(fake.base))
