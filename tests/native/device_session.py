"""The library's execution-provider entries driven through the fake ORT runtime (tests/fake_ort_api.py)
and the fake accelerator driver (tests/native/fake_device_driver.c): no ONNX Runtime, no device.

usage: python device_session.py <scenario> [<api version>]   (17 unless given; from 24 each input's dims are read
    by reference, GetTensorElementTypeAndShapeDataReference, and the last line counts both routes)
    (PAKV_ONNX_CUDA_DRIVER / PAKV_ONNX_CANN_DRIVER point at the fake driver, FAKE_DRIVER too)

Started by tests/test_device_entries.py, one process per scenario (the library keeps its first
registration and its first opened driver for the life of the process). Prints "ok <scenario> ..."
and exits 0, or fails an assertion saying what differed.

Scenarios:
    entries   what is registered: every op once per EP, same counts and characteristics, index
              inputs host-resident on the device entries only
    matrix    every cache dtype x layout x seq_lens form x index dtype x seq_offset (and mixed key /
              value dtypes) through the CUDA and CANN entries: bit-exact vs the golden, every driver
              call on ORT's stream, nothing the real driver would refuse, the copy calls each
              layout should use (and the CPU entry on the same inputs)
    errors    a failing driver call is an ORT error naming the call and its result code; a call the
              validator refuses (the same message as the CPU entry) writes nothing and calls no
              driver; index inputs not on the host, caches on two devices; no current CUDA context
    missing   no driver library, or one without the symbols: an ORT error naming what is missing
    parallel  the CPU entry: ORT's KernelContext_ParallelFor above the size threshold (API >= 17),
              never below it; the library's own threads on API 16
    scatter   ScatterPaKvCache through the CUDA and CANN entries (the copy route), bit-exact vs the
              per-token reference over every dtype and layout, every driver call on ORT's stream
    paths     the CUDA entries' copy paths on the driver FAKE_VARIANT (fake_ort_api.FAKE_DRIVER_VARIANTS):
              a call's Norm copies in one cuMemcpyBatchAsync (_v2 on CUDA 13, the 12.8 symbol before),
              else one launch of the PTX copy kernel, else one cuMemcpyDtoDAsync per run (CUDA 11);
              PAKV_ONNX_CUDA_COPY forcing each, and naming what the driver lacks; gathers and
              scatters bit-exact, the library's own path counters agreeing
    bridge    a Python backend (golden) on the device entries: the callback gets the caches and
              ORT's outputs labelled with the entry's device ("cuda:0" / "npu:0"; turned into
              tensors by runtime_plugin._device, here host views since the fake's device memory is
              host memory), the index inputs as host tensors, and runs on ORT's stream
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys

import torch
from conftest import with_value_dtype
from fake_ort_api import DEVICE_GPU, DEVICE_NPU, EPS, MEM_CPU_INPUT, MEM_DEFAULT, FakeDriver, FakeOrtError
from fake_ort_api import FakeRuntime, FakeTensor

from pakv_onnx import native_lib
from pakv_onnx.cases import random_case
from pakv_onnx.spec import CACHE_DTYPES, ONNX_ELEMENT_TYPE_OF, CacheMode, bitwise_equal

SCENARIO = sys.argv[1]
API = int(sys.argv[2]) if len(sys.argv) > 2 else 17
STREAM = 0x5EED0
DEVICE_OF = {"CUDAExecutionProvider": DEVICE_GPU, "CANNExecutionProvider": DEVICE_NPU}
COPY_CALLS = {  # (EP, layout) -> the driver functions its copies may use (the fake is a CUDA 13 driver)
    ("CUDAExecutionProvider", CacheMode.NORM): {"cuLaunchKernel", "cuMemcpyDtoDAsync_v2"},
    ("CUDAExecutionProvider", CacheMode.PA_NZ): {"cuMemcpy2DAsync_v2"},
    ("CANNExecutionProvider", CacheMode.NORM): {"aclrtMemcpyAsync"},
    ("CANNExecutionProvider", CacheMode.PA_NZ): {"aclrtMemcpy2dAsync"},
}
# Every call that moves bytes (the batched copies, the kernel launch, the per-run copies).
ALL_COPY_CALLS = sorted(set().union(*COPY_CALLS.values(), {"cuMemcpyBatchAsync", "cuMemcpyBatchAsync_v2"}))
INLINE_PIECES = 160  # pakv_cuda_copy.cu's PAKV_COPY_INLINE_RUNS: a list this short is the launch's parameter

runtime = FakeRuntime(api_version=API, stream=STREAM)
lib = native_lib.load()
if SCENARIO == "bridge":  # this process's registration binds the golden backend (the Python callback)
    from pakv_onnx.runtime_plugin import _python_backend

    _python_backend.install()
    assert lib.pakv_bind_next_registration(b"golden") > 0
ops = runtime.register(lib)
driver = FakeDriver(os.environ["FAKE_DRIVER"]) if "FAKE_DRIVER" in os.environ else None


def fake(tensor: torch.Tensor | None, device_type: int = 0, device_id: int = 0) -> FakeTensor | None:
    if tensor is None:
        return None
    assert tensor.is_contiguous()
    return FakeTensor(tensor.data_ptr(), ONNX_ELEMENT_TYPE_OF[tensor.dtype], tuple(tensor.shape), device_type, device_id)


def as_torch(output, dtype: torch.dtype) -> torch.Tensor:
    tensor, buffer = output
    count = 1
    for d in tensor.dims:
        count *= d
    raw = torch.frombuffer(buffer, dtype=torch.uint8)[: count * dtype.itemsize]
    return raw.view(dtype).view(tensor.dims).clone()


def attributes(case) -> dict:
    return {"cache_mode": case.cache_mode.value, "is_seq_lens_cumsum": int(case.is_seq_lens_cumsum)}


def run(ep: str, case, inputs=None, cache_device=None, out_device=None):
    """The case through the `ep` entry: caches (and outputs) as device memory of that EP, index
    inputs in host memory. Returns the outputs as torch tensors."""
    device = DEVICE_OF.get(ep, 0)
    cache_device = cache_device or ((device, 0), (device, 0))
    key_cache, value_cache, tables, lens, offsets = inputs or case.inputs()
    feeds = [fake(key_cache, *cache_device[0]), fake(value_cache, *cache_device[1]), fake(tables), fake(lens)]
    if offsets is not None:
        feeds.append(fake(offsets))
    op = runtime.find_op(ep, ONNX_ELEMENT_TYPE_OF[key_cache.dtype], ONNX_ELEMENT_TYPE_OF[value_cache.dtype])
    kernel = runtime.create_kernel(op, attributes(case))
    try:
        outputs = runtime.compute(op, kernel, feeds, out_device=out_device or (device, 0))
    finally:
        runtime.destroy_kernel(op, kernel)
    return as_torch(outputs[0], key_cache.dtype), as_torch(outputs[1], value_cache.dtype)


def check_exact(ep: str, case, label: str) -> None:
    key, value = run(ep, case)
    want_key, want_value = case.golden()
    assert bitwise_equal(key, want_key) and bitwise_equal(value, want_value), f"{ep} {label}: differs from the golden"


def counts() -> dict[str, int]:
    return {name: driver.count(name) for name in (*ALL_COPY_CALLS, "misuse", "wrong_stream", "kernel_pieces",
                                                  "cuMemcpyHtoDAsync_v2")}  # fmt: skip


# Per op: its name and which inputs a device entry takes in host memory (the index inputs).
OPS = {b"GatherPaKvCache": {2, 3, 4}, b"ScatterPaKvCache": {4}}


# PagedAttention: one entry per dtype it computes in (bfloat16, float16, float32), CPU only, after
# every cache op.
ATTENTION_ENTRIES = 3


def entries() -> str:
    pairs = len(CACHE_DTYPES) ** 2
    pakv = [a for a in ops if runtime.op_domains[a] == "pakv"]  # com.microsoft's PagedAttention: CPU only
    microsoft = [a for a in ops if runtime.op_domains[a] == "com.microsoft"]
    assert all(runtime.op(a).GetExecutionProviderType(a).decode() == EPS[0] for a in microsoft), "a device entry"
    assert len(pakv) == pairs * len(OPS) * len(EPS) + ATTENTION_ENTRIES, len(pakv)
    cache_ops, attention = pakv[:-ATTENTION_ENTRIES], pakv[-ATTENTION_ENTRIES:]
    for address in attention:
        a = runtime.op(address)
        assert a.GetName(address) == b"PagedAttention" and a.GetExecutionProviderType(address).decode() == EPS[0]
        assert (a.GetInputTypeCount(address), a.GetOutputTypeCount(address)) == (6, 1)
    by_ep = {ep: [a for a in cache_ops if runtime.op(a).GetExecutionProviderType(a).decode() == ep] for ep in EPS}
    assert all(len(v) == pairs * len(OPS) for v in by_ep.values()), {k: len(v) for k, v in by_ep.items()}
    for cpu, *devices in zip(*by_ep.values()):
        c = runtime.op(cpu)
        name = c.GetName(cpu)
        assert name in OPS, name
        for address in devices:
            d = runtime.op(address)
            assert d.version == c.version
            assert d.GetName(address) == name
            assert d.GetInputTypeCount(address) == c.GetInputTypeCount(cpu) == 5
            assert d.GetOutputTypeCount(address) == c.GetOutputTypeCount(cpu) == 2
            for i in range(5):
                assert d.GetInputType(address, i) == c.GetInputType(cpu, i)
                assert d.GetInputCharacteristic(address, i) == c.GetInputCharacteristic(cpu, i)
                assert c.GetInputMemoryType(cpu, i) == MEM_DEFAULT
                want = MEM_CPU_INPUT if i in OPS[name] else MEM_DEFAULT  # index inputs on the host
                assert d.GetInputMemoryType(address, i) == want, (name, i, d.GetInputMemoryType(address, i))
            for i in range(2):
                assert d.GetOutputType(address, i) == c.GetOutputType(cpu, i)
                assert d.GetOutputCharacteristic(address, i) == c.GetOutputCharacteristic(cpu, i)
    return f"{len(cache_ops)} cache-op entries, {len(attention)} attention entries"


def scatter() -> str:
    """ScatterPaKvCache through the CUDA and CANN entries: the fake runtime's outputs are fresh buffers
    (the copy route: each pool copied to its output on ORT's stream, then the rows), bit-exact vs the
    per-token reference over every dtype and layout, every driver call on ORT's stream."""
    from per_token_reference import scatter_per_token

    from pakv_onnx.cases import random_scatter_case

    runs = 0
    for ep in ("CUDAExecutionProvider", "CANNExecutionProvider"):
        for seed, (dtype, mode) in enumerate(itertools.product([d.torch_dtype for d in CACHE_DTYPES], CacheMode)):
            case = random_scatter_case(300 + seed, dtype=dtype, cache_mode=mode, num_tokens=7)
            key, value, key_cache, value_cache, slots = case.inputs()
            if key.numel() == 0:
                continue
            driver.reset(STREAM)
            device = DEVICE_OF[ep]
            feeds = [fake(key.contiguous(), device), fake(value.contiguous(), device), fake(key_cache, device),
                     fake(value_cache, device), fake(slots)]  # fmt: skip
            op = runtime.find_op(ep, ONNX_ELEMENT_TYPE_OF[key.dtype], ONNX_ELEMENT_TYPE_OF[value.dtype], "ScatterPaKvCache")
            kernel = runtime.create_kernel(op, {"cache_mode": mode.value})
            try:
                outputs = runtime.compute(op, kernel, feeds, out_device=(device, 0))
            finally:
                runtime.destroy_kernel(op, kernel)
            want = scatter_per_token(*case.inputs(), cache_mode=mode)
            got = (as_torch(outputs[0], key_cache.dtype), as_torch(outputs[1], value_cache.dtype))
            assert bitwise_equal(got[0], want[0]) and bitwise_equal(got[1], want[1]), (ep, case.cache_mode, dtype)
            used = counts()
            assert used["misuse"] == 0 and used["wrong_stream"] == 0, (ep, mode, used)
            runs += 1
    return f"{runs} scatter device runs"


def matrix() -> str:
    runs = 0
    for ep in ("CUDAExecutionProvider", "CANNExecutionProvider"):
        seed = 0
        for dtype, mode, cumsum, index, offset in itertools.product(
            [d.torch_dtype for d in CACHE_DTYPES], CacheMode, (True, False), (torch.int32, torch.int64), (True, False)
        ):
            seed += 1
            case = random_case(seed, dtype=dtype, cache_mode=mode, is_seq_lens_cumsum=cumsum,
                               index_dtypes=(index, index, index), with_seq_offset=offset)  # fmt: skip
            driver.reset(STREAM)
            check_exact(ep, case, case.summary())
            got = counts()
            assert got["misuse"] == 0 and got["wrong_stream"] == 0, (ep, case.summary(), got)
            used = {name for name in ALL_COPY_CALLS if got[name]}
            assert used <= COPY_CALLS[ep, mode], (ep, mode, got)
            if (ep, mode) == ("CUDAExecutionProvider", CacheMode.NORM):  # one launch per call
                assert got["cuLaunchKernel"] + got["cuMemcpyDtoDAsync_v2"] <= 1, got
            runs += 1
        for seed in range(8):  # key and value caches of different dtypes (each output its own)
            case = with_value_dtype(random_case(100 + seed), CACHE_DTYPES[seed % len(CACHE_DTYPES)].torch_dtype, seed)
            driver.reset(STREAM)
            check_exact(ep, case, f"mixed {case.summary()}")
            assert counts()["misuse"] == 0 and counts()["wrong_stream"] == 0
            runs += 1
    for seed in range(8):  # the CPU entry of the same registration
        check_exact("CPUExecutionProvider", random_case(200 + seed), "cpu")
    # Consecutive physical blocks read in order are one copy per cache, not one per block.
    case = random_case(7, dtype=torch.bfloat16, cache_mode=CacheMode.NORM, with_seq_offset=False)
    kc, vc, _tables, _lens, _ = case.inputs()
    nb, bs = kc.shape[0], kc.shape[1]
    tables = torch.arange(nb, dtype=torch.int32).reshape(1, nb)
    lens = torch.tensor([0, nb * bs], dtype=torch.int32)
    key, value = None, None
    driver.reset(STREAM)
    key, value = run("CUDAExecutionProvider", case, inputs=(kc, vc, tables, lens, None))
    assert bitwise_equal(key, kc.reshape(nb * bs, *kc.shape[2:])) and bitwise_equal(value, vc.reshape(nb * bs, *vc.shape[2:]))
    pieces = sum(-(-t.numel() * t.element_size() // 65536) for t in (kc, vc))  # one run per cache, in 64 KiB pieces
    assert driver.count("cuLaunchKernel") == 1 and driver.count("kernel_pieces") == pieces, counts()
    assert driver.count("cuMemcpyDtoDAsync_v2") == 0
    return f"{runs} device runs"


def expect_error(fn, *texts: str) -> str:
    try:
        fn()
    except FakeOrtError as exc:
        for text in texts:
            assert text in str(exc), f"{text!r} not in {exc}"
        return str(exc)
    raise AssertionError(f"no error (expected {texts})")


def errors() -> str:
    norm = random_case(3, dtype=torch.float16, cache_mode=CacheMode.NORM, with_seq_offset=False)
    nz = random_case(4, dtype=torch.float16, cache_mode=CacheMode.PA_NZ, with_seq_offset=False)
    for case in (norm, nz):
        assert case.golden()[0].shape[0] > 0
    # A failing driver call: an ORT error naming the call and its code.
    for ep, case, call, text in (
        ("CUDAExecutionProvider", norm, "cuLaunchKernel (pakv_copy_runs_inline)", "failed with CUresult 700 (CUDA_ERROR_ILLEGAL_ADDRESS)"),
        ("CUDAExecutionProvider", nz, "cuMemcpy2DAsync_v2", "failed with CUresult 700 (CUDA_ERROR_ILLEGAL_ADDRESS)"),
        ("CANNExecutionProvider", norm, "aclrtMemcpyAsync", "failed with aclError 700: fake driver: copy 0 failed"),
        ("CANNExecutionProvider", nz, "aclrtMemcpy2dAsync", "failed with aclError 700: fake driver: copy 0 failed"),
    ):
        driver.reset(STREAM)
        driver.fail_at(0, 700)
        expect_error(lambda: run(ep, case), ep, f"{call} {text}")
        assert sum(counts()[name] for name in ALL_COPY_CALLS) == 1, "the copy went on after a failed call"
    # The validator's refusal (the same message on every entry) happens before any output or copy.
    kc, vc, tables, lens, offsets = norm.inputs()
    bad = tables.clone()
    bad[0, 0] = kc.shape[0]
    refused = []
    for ep in EPS:
        driver.reset(STREAM)
        refused.append(expect_error(lambda: run(ep, norm, inputs=(kc, vc, bad, lens, offsets)), "ValueError: block_tables[0, 0]"))
        assert runtime.last_outputs == [None, None], "outputs were allocated for a refused call"
        assert sum(counts()[name] for name in ALL_COPY_CALLS) == 0, "a refused call reached the driver"
    assert len(set(refused)) == 1, refused
    # Index inputs must be host memory (the device entries declare them so); caches on one device.
    driver.reset(STREAM)
    op = runtime.find_op("CUDAExecutionProvider", ONNX_ELEMENT_TYPE_OF[kc.dtype], ONNX_ELEMENT_TYPE_OF[vc.dtype])
    kernel = runtime.create_kernel(op, attributes(norm))
    feeds = [fake(kc, DEVICE_GPU), fake(vc, DEVICE_GPU), fake(tables, DEVICE_GPU), fake(lens)]
    expect_error(lambda: runtime.compute(op, kernel, feeds, (DEVICE_GPU, 0)), "block_tables: its data is not readable on the host")
    runtime.destroy_kernel(op, kernel)
    expect_error(lambda: run("CUDAExecutionProvider", norm, cache_device=((DEVICE_GPU, 0), (DEVICE_GPU, 1))),
                 "value_cache is on cuda:1 but key_cache is on cuda:0")  # fmt: skip
    expect_error(lambda: run("CANNExecutionProvider", norm, cache_device=((DEVICE_NPU, 1), (DEVICE_NPU, 0))),
                 "value_cache is on npu:0 but key_cache is on npu:1")  # fmt: skip
    assert sum(counts()[name] for name in ALL_COPY_CALLS) == 0
    # A thread with no current CUDA context gets the stream's before the copies.
    driver.reset(STREAM, has_context=False)
    check_exact("CUDAExecutionProvider", norm, "no context")
    assert driver.count("cuCtxSetCurrent") == 1
    driver.reset(STREAM)
    check_exact("CUDAExecutionProvider", norm, "context")
    assert driver.count("cuCtxSetCurrent") == 0
    return "driver failures, refusals, placement"


def missing() -> str:
    case = random_case(3, dtype=torch.float16, cache_mode=CacheMode.NORM, with_seq_offset=False)
    path = os.environ["PAKV_ONNX_CUDA_DRIVER"]
    first = expect_error(lambda: run("CUDAExecutionProvider", case), "CUDAExecutionProvider", "dlopen", path,
                         "PAKV_ONNX_CUDA_DRIVER")  # fmt: skip
    expect_error(lambda: run("CANNExecutionProvider", case), "CANNExecutionProvider", "dlopen",
                 os.environ["PAKV_ONNX_CANN_DRIVER"])  # fmt: skip
    libc = "libc.so.6"
    os.environ["PAKV_ONNX_CUDA_DRIVER"] = libc  # opens, but is no driver
    expect_error(lambda: run("CUDAExecutionProvider", case), "libc.so.6 has no symbol cuInit")
    check_exact("CPUExecutionProvider", case, "cpu without a driver")  # the CPU entry needs none
    return first


def parallel() -> str:
    threshold = int(os.environ["PAKV_ONNX_PARALLEL_MIN_BYTES"])

    def out_bytes(case) -> int:
        return sum(t.numel() * t.element_size() for t in case.golden())

    cases = [random_case(seed, dtype=torch.float32, max_blocks=64) for seed in range(40)]
    small = next(c for c in cases if 0 < out_bytes(c) < threshold)
    big = next(c for c in cases if out_bytes(c) >= threshold)
    runtime.parallel_calls.clear()
    check_exact("CPUExecutionProvider", small, "small")
    assert runtime.parallel_calls == [], "a small copy entered a parallel region"
    check_exact("CPUExecutionProvider", big, "big")
    if API >= 17:
        assert len(runtime.parallel_calls) == 1 and runtime.parallel_calls[0][0] >= 2, runtime.parallel_calls
        assert runtime.parallel_calls[0][1] == 0  # parts handed out one by one
    else:
        assert runtime.parallel_calls == [], "ParallelFor called on a runtime without it"
    return f"parallel calls {runtime.parallel_calls}"


def paths() -> str:
    """The variant's expected path for multi-run gathers and scatters (the copy kernel wherever the
    driver can load it: on an H200 the batched copy cost one copy per run), then each forced path."""
    variant = os.environ["FAKE_VARIANT"]
    expected = {"cuda13": "kernel", "cuda12.8": "kernel", "cuda12.0": "kernel", "cuda11.0": "runs"}[variant]
    launch_call = None if expected == "runs" else "cuLaunchKernel"
    ep = "CUDAExecutionProvider"

    def gathers() -> int:
        """Norm gathers of every dtype, bit-exact; returns how many had more than one copy."""
        multi = 0
        for seed, dtype in enumerate(d.torch_dtype for d in CACHE_DTYPES):
            case = random_case(500 + seed, dtype=dtype, cache_mode=CacheMode.NORM, max_blocks=16)
            driver.reset(STREAM)
            before = native_lib.cuda_copy_paths()
            check_exact(ep, case, f"{variant} {case.summary()}")
            got, after = counts(), native_lib.cuda_copy_paths()
            assert got["misuse"] == 0 and got["wrong_stream"] == 0, got
            launches = sum(got[name] for name in ALL_COPY_CALLS if name != "cuMemcpyDtoDAsync_v2")
            copies = got["cuMemcpyDtoDAsync_v2"]
            if launches + copies == 0:
                continue  # nothing to copy
            path = next(p for p in after if after[p] != before[p])
            if path == "runs" and copies == 1 and expected != "runs":
                continue  # a single copy is issued as itself
            multi += 1
            assert path == expected, (variant, path, got)
            assert launches == (0 if expected == "runs" else 1) and got.get(launch_call, 1) >= 1, (variant, got)
            assert copies == (0 if expected != "runs" else copies), got
            if expected == "kernel":  # a short list rides in the launch's parameter: nothing uploaded
                assert got["kernel_pieces"] <= INLINE_PIECES and got["cuMemcpyHtoDAsync_v2"] == 0, got
        return multi

    multi = gathers()
    assert multi >= 5, multi
    # One run longer than a kernel piece (64 KiB): consecutive blocks of a wide float32 cache.
    case = random_case(7, dtype=torch.float32, cache_mode=CacheMode.NORM, with_seq_offset=False, max_blocks=64)
    kc, vc, _tables, _lens, _ = case.inputs()
    nb, bs = kc.shape[0], kc.shape[1]
    tables, lens = torch.arange(nb, dtype=torch.int32).reshape(1, nb), torch.tensor([0, nb * bs], dtype=torch.int32)
    driver.reset(STREAM)
    key, value = run(ep, case, inputs=(kc, vc, tables, lens, None))
    assert bitwise_equal(key, kc.reshape(nb * bs, *kc.shape[2:])) and bitwise_equal(value, vc.reshape(nb * bs, *vc.shape[2:]))
    if expected == "kernel":
        pieces = -(-kc.numel() * kc.element_size() // 65536) + -(-vc.numel() * vc.element_size() // 65536)
        assert driver.count("kernel_pieces") == pieces, (driver.count("kernel_pieces"), pieces)
        assert driver.count("cuMemcpyHtoDAsync_v2") == (pieces > INLINE_PIECES), (pieces, driver.count("cuMemcpyHtoDAsync_v2"))
        # A list longer than the parameter holds: uploaded, launched, freed (a pool of 64 KiB blocks).
        wide = torch.arange(2 * (INLINE_PIECES + 7) * 16384, dtype=torch.float32).reshape(2 * (INLINE_PIECES + 7), 1, 1, 16384)
        tables = torch.arange(0, wide.shape[0], 2, dtype=torch.int32)[None]  # every other block: no run merges
        lens = torch.tensor([0, tables.shape[1]], dtype=torch.int32)
        driver.reset(STREAM)
        key, value = run(ep, case, inputs=(wide, wide.clone(), tables, lens, None))
        assert bitwise_equal(key, wide[0::2].reshape(-1, 1, 16384)) and bitwise_equal(value, wide[0::2].reshape(-1, 1, 16384))
        assert driver.count("kernel_pieces") == 2 * tables.shape[1] and driver.count("cuMemcpyHtoDAsync_v2") == 1, (
            driver.count("kernel_pieces"), driver.count("cuMemcpyHtoDAsync_v2"))
        # ... from the library's own pool, which keeps its memory (the device's pool gives it back at
        # every synchronization: ~400 us a call on an H200)
        assert driver.count("cuMemAllocFromPoolAsync") == 1 and driver.count("pools_keeping") == 1, counts()
        assert driver.count("live_allocations") == 0, "the run list's device memory was not freed"
        # A large call's pieces grow past 64 KiB: at most about 2,048 beyond one per run.
        huge = torch.zeros(4, 1, 1, 2**24 + 4, dtype=torch.float32)  # four 64 MiB blocks
        tables = torch.tensor([[0, 2]], dtype=torch.int32)  # two runs per cache, 256 MiB in all
        lens = torch.tensor([0, 2], dtype=torch.int32)
        huge[:, 0, 0, :: 2**16] = torch.arange(4, dtype=torch.float32)[:, None]
        driver.reset(STREAM)
        key, _ = run(ep, case, inputs=(huge, huge, tables, lens, None))
        assert bitwise_equal(key, huge[0::2].reshape(2, 1, -1))
        total, runs = 4 * huge[0].numel() * 4, 4
        piece = -(-(total // 2048) // 16) * 16
        assert piece > 65536, piece
        assert driver.count("kernel_pieces") == runs * -(-huge[0].numel() * 4 // piece) <= 2048 + runs, counts()
    assert driver.count("live_allocations") == 0, "the run list's device memory was not freed"
    # The scatter's device entry: the pool copied to the output, then its rows in one launch.
    from per_token_reference import scatter_per_token

    from pakv_onnx.cases import random_scatter_case

    for seed, dtype in enumerate((torch.float16, torch.int8, torch.float32)):
        case = random_scatter_case(600 + seed, dtype=dtype, cache_mode=CacheMode.NORM, num_tokens=9)
        key, value, key_cache, value_cache, slots = case.inputs()
        driver.reset(STREAM)
        feeds = [fake(key.contiguous(), DEVICE_GPU), fake(value.contiguous(), DEVICE_GPU), fake(key_cache, DEVICE_GPU),
                 fake(value_cache, DEVICE_GPU), fake(slots)]  # fmt: skip
        op = runtime.find_op(ep, ONNX_ELEMENT_TYPE_OF[key.dtype], ONNX_ELEMENT_TYPE_OF[value.dtype], "ScatterPaKvCache")
        kernel = runtime.create_kernel(op, {"cache_mode": CacheMode.NORM.value})
        try:
            outputs = runtime.compute(op, kernel, feeds, out_device=(DEVICE_GPU, 0))
        finally:
            runtime.destroy_kernel(op, kernel)
        want = scatter_per_token(*case.inputs(), cache_mode=CacheMode.NORM)
        got = (as_torch(outputs[0], key_cache.dtype), as_torch(outputs[1], value_cache.dtype))
        assert bitwise_equal(got[0], want[0]) and bitwise_equal(got[1], want[1]), (variant, dtype)
        used = counts()
        assert used["misuse"] == 0 and used["wrong_stream"] == 0, used
        if launch_call:
            assert used[launch_call] == 1, (variant, used)
    # Forcing a path: the one asked for, or an error naming what the driver lacks.
    case = random_case(505, dtype=torch.float16, cache_mode=CacheMode.NORM, max_blocks=16)
    results = []
    for forced in ("runs", "batch", "kernel"):
        os.environ["PAKV_ONNX_CUDA_COPY"] = forced
        try:
            driver.reset(STREAM)
            available = forced == "runs" or (forced == "batch" and variant in ("cuda13", "cuda12.8")) or (
                forced == "kernel" and variant != "cuda11.0")
            if available:
                before = native_lib.cuda_copy_paths()
                check_exact(ep, case, f"forced {forced}")
                after = native_lib.cuda_copy_paths()
                assert after[forced] == before[forced] + 1, (forced, before, after)
            else:
                expect_error(lambda: run(ep, case), f"PAKV_ONNX_CUDA_COPY={forced}, but the")
                assert sum(counts()[name] for name in ALL_COPY_CALLS) == 0
            results.append(f"{forced}:{'ran' if available else 'refused'}")
        finally:
            del os.environ["PAKV_ONNX_CUDA_COPY"]
    return f"{variant}: {multi} multi-copy gathers by {expected}, forced {' '.join(results)}"


def bridge() -> str:
    import contextlib

    from pakv_onnx.runtime_plugin import _device, _tensors

    seen: list[str] = []
    streams: list[tuple[str, int]] = []

    def tensor_at(address, shape, dtype, device):  # the fake's "device memory" is host memory
        seen.append(device)
        return _tensors.view(address, shape, dtype)

    def stream_context(device, stream):
        streams.append((device, stream))
        return contextlib.nullcontext()

    _device.tensor_at, _device.stream_context = tensor_at, stream_context
    for ep, label in (("CUDAExecutionProvider", "cuda:0"), ("CANNExecutionProvider", "npu:0")):
        for seed in range(4):
            case = random_case(300 + seed, max_blocks=8)
            seen.clear()
            streams.clear()
            check_exact(ep, case, f"golden via the bridge {case.summary()}")
            assert streams == [(label, STREAM)], streams
            # key_cache, value_cache, then the two outputs ORT allocated (index inputs: host views)
            assert seen == [label] * len(seen) and len(seen) >= 2, seen
    check_exact("CPUExecutionProvider", random_case(310), "golden on the CPU entry")
    return "device labels and ORT's stream reach the Python backend"


print("ok", SCENARIO, {"bridge": bridge, "entries": entries, "matrix": matrix, "errors": errors, "missing": missing,
                       "parallel": parallel, "scatter": scatter, "paths": paths}[SCENARIO](), flush=True)  # fmt: skip
print("shape reads", runtime.shape_reads["reference"], "by reference,", runtime.shape_reads["info"], "by info")
