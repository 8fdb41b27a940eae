"""Packaging: the wheel's tag and contents, the sdist's contents (its tests collect), the bare library.

The wheel and sdist are built from a copy of the source tree without any build output (no
``libpakv_ort.so``, no ``build/``), so the library in the wheel must have been compiled by the
build itself.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

import pakv_onnx

ROOT = Path(__file__).resolve().parents[1]
BUILD_OUTPUT = (
    ".git", "build", "dist", "*.egg-info", "*.so", "__pycache__", ".pytest_cache", ".hypothesis", ".venv", "venv"
)  # fmt: skip
# Files the tests import or compile besides the test modules (the sdist must ship them).
TEST_HELPERS = (
    "tests/per_token_reference.py",
    "tests/broken_backend.py",
    "tests/native/fake_ort_driver.c",
    "tests/native/fake_device_driver.c",
    "tests/native/device_session.py",
    "tests/device/gpu_check.py",
    "tests/device/gpu_check.sh",
)


def source_files(root: Path) -> list[str] | None:
    """The files git would ship from ``root`` (tracked, plus new ones not ignored), relative paths;
    ``None`` when ``root`` is not a git checkout (an unpacked sdist)."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [name for name in listed.decode().split("\0") if name and (root / name).is_file()]


def copy_source_tree(root: Path, dest: Path) -> None:
    """Copy the source tree at ``root`` to ``dest`` without build output or local files.

    In a git checkout only what git would ship is copied, so a virtual environment or anything else
    .gitignore names (a ``.venv`` of 900 MB, say) never is; elsewhere the BUILD_OUTPUT patterns are
    left out."""
    names = source_files(root)
    if names is None:
        shutil.copytree(root, dest, ignore=shutil.ignore_patterns(*BUILD_OUTPUT))
        return
    for name in names:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, dest / name)


@pytest.fixture(scope="module")
def clean_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the source tree with no build output in it."""
    dest = tmp_path_factory.mktemp("src") / "pakv-onnx"
    copy_source_tree(ROOT, dest)
    assert not list(dest.rglob("*.so"))
    return dest


def test_the_source_copy_leaves_out_ignored_local_files(tmp_path: Path) -> None:
    """A .venv (the README's) or other ignored folder in the checkout is not copied; new files are."""
    if source_files(ROOT) is None:
        pytest.skip("not a git checkout (an unpacked sdist): the copy falls back to BUILD_OUTPUT patterns")
    checkout = tmp_path / "checkout"
    for name in ("pakv_onnx/__init__.py", ".gitignore"):
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, checkout / name)
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    subprocess.run(["git", "-C", str(checkout), "add", "."], check=True)
    (checkout / ".venv" / "lib").mkdir(parents=True)
    (checkout / ".venv" / "lib" / "big.py").write_text("x = 1\n")
    (checkout / "build" / "lib").mkdir(parents=True)
    (checkout / "build" / "lib" / "libpakv_ort.so").write_bytes(b"\x7fELF")
    (checkout / "new_module.py").write_text("")  # not added yet: still part of the source
    copy_source_tree(checkout, tmp_path / "copy")
    copied = sorted(str(p.relative_to(tmp_path / "copy")) for p in (tmp_path / "copy").rglob("*") if p.is_file())
    assert copied == [".gitignore", "new_module.py", "pakv_onnx/__init__.py"]


def _platform_tag() -> str:
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


@pytest.mark.slow  # builds a wheel / an sdist from a clean copy: 15-30 s
def test_wheel_is_abi3_platform_and_carries_the_built_library_and_extension(clean_tree: Path, tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(clean_tree), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         "--no-cache-dir"],  # fmt: skip (pip would keep the wheel in ~/.cache/pip)
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    assert wheel.name == f"pakv_onnx-{pakv_onnx.__version__}-cp310-abi3-{_platform_tag()}.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = f"pakv_onnx-{pakv_onnx.__version__}.dist-info"
        metadata = archive.read(f"{dist_info}/METADATA").decode()
        wheel_file = archive.read(f"{dist_info}/WHEEL").decode()
    assert "pakv_onnx/native_lib/libpakv_ort.so" in names  # compiled by the build: the copy had none
    assert "pakv_onnx/native_lib/_front.abi3.so" in names  # the front's extension, stable ABI
    assert f"{dist_info}/licenses/LICENSE" in names
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert f"Version: {pakv_onnx.__version__}" in metadata.splitlines()
    assert "Root-Is-Purelib: false" in wheel_file


def test_build_backend_pin_accepts_the_license_form_and_is_met_here() -> None:
    """``project.license`` is an SPDX string (setuptools >= 77) and the pinned range includes this setuptools."""
    from packaging.requirements import Requirement
    from packaging.version import Version
    import setuptools

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert (ROOT / project["project"]["license-files"][0]).read_text().lstrip().startswith("Apache License")
    (backend,) = [Requirement(r) for r in project["build-system"]["requires"] if r.startswith("setuptools")]
    assert not backend.specifier.contains("76.9"), "setuptools < 77 rejects the SPDX license string"
    assert backend.specifier.contains(Version(setuptools.__version__)), (backend, setuptools.__version__)


@pytest.mark.slow  # builds a wheel / an sdist from a clean copy: 15-30 s
def test_sdist_ships_the_test_helpers_and_its_tests_collect(clean_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "dist"
    out.mkdir()
    subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"],
        cwd=clean_tree,
        check=True,
        capture_output=True,
        text=True,
    )
    (sdist,) = out.glob("*.tar.gz")
    top = f"pakv_onnx-{pakv_onnx.__version__}"
    with tarfile.open(sdist) as archive:
        names = {name.removeprefix(top + "/") for name in archive.getnames()}
        archive.extractall(tmp_path / "x", filter="data")
    for needed in (*TEST_HELPERS, "LICENSE", "README.md", "pakv_onnx/native_lib/pakv_core.c"):
        assert needed in names, f"the sdist lacks {needed}"
    shipped_tests = {n for n in names if n.startswith("tests/test_") and n.endswith(".py")}
    assert shipped_tests == {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")}
    # tests/test_readme.py runs the python blocks of every docs page, test_architecture.py reads one
    shipped_docs = {n for n in names if n.startswith("docs/") and n.endswith(".md")}
    assert shipped_docs == {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")}
    assert not any(n.endswith(".so") for n in names)

    unpacked = tmp_path / "x" / top
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=unpacked,
        env={**_clean_env(), "PYTHONPATH": str(unpacked)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " tests collected" in result.stdout and "error" not in result.stdout.splitlines()[-1]


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# Runs in a process where torch cannot be imported and pakv_onnx is never imported: only
# onnxruntime, numpy and onnx, as on a serving host that only copied libpakv_ort.so. float16 caches
# (numpy has them), so this works on every supported onnxruntime, 1.16 included.
BARE_ORT_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # importing torch now fails
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    lib = sys.argv[1]
    names = ["key_cache", "value_cache", "block_tables", "seq_lens", "seq_offset"]
    types = [TensorProto.FLOAT16, TensorProto.FLOAT16] + [TensorProto.INT32] * 3
    node = helper.make_node("GatherPaKvCache", names, ["key", "value"], domain="pakv")
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, types)],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT16, None) for n in ("key", "value")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("pakv", 1)], ir_version=8
    )
    options = ort.SessionOptions()
    options.register_custom_ops_library(lib)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    kc = rng.standard_normal((6, 4, 2, 8)).astype(np.float16)
    vc = rng.standard_normal((6, 4, 3, 5)).astype(np.float16)
    bt = np.array([[5, 0, 2], [9, 1, 3]], np.int32)  # 9: an unused column may hold anything
    sl = np.array([0, 7, 13], np.int32)
    so = np.array([0, 4], np.int32)  # sequence 1 starts at column 1
    key, value = session.run(None, dict(zip(names, (kc, vc, bt, sl, so))))
    rows = [(5, t) if t < 4 else (0, t - 4) for t in range(7)] + [(1, t) if t < 4 else (3, t - 4) for t in range(6)]
    assert np.array_equal(key, np.stack([kc[b, s] for b, s in rows]))
    assert np.array_equal(value, np.stack([vc[b, s] for b, s in rows]))
    try:
        session.run(None, dict(zip(names, (kc, vc, np.array([[6, 0, 2], [9, 1, 3]], np.int32), sl, so))))
    except Exception as err:
        assert "block_tables" in str(err), err
    else:
        raise AssertionError("an out-of-range block id was accepted")
    # ScatterPaKvCache: which in-place route this runtime takes (printed; asserted where known).
    snames = ["key", "value", "key_cache", "value_cache", "slot_mapping"]
    stypes = [TensorProto.FLOAT16] * 4 + [TensorProto.INT64]
    def scatter_model(then_gather):
        inputs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(snames, stypes)]
        if then_gather:
            nodes = [helper.make_node("ScatterPaKvCache", snames, ["k2", "v2"], domain="pakv"),
                     helper.make_node("GatherPaKvCache", ["k2", "v2", "block_tables", "seq_lens"], ["key_all", "value_all"], domain="pakv")]
            inputs += [helper.make_tensor_value_info(n, TensorProto.INT32, None) for n in ("block_tables", "seq_lens")]
            outs = ["key_all", "value_all"]
        else:
            nodes = [helper.make_node("ScatterPaKvCache", snames, ["key_cache_out", "value_cache_out"], domain="pakv")]
            outs = ["key_cache_out", "value_cache_out"]
        graph = helper.make_graph(nodes, "s", inputs, [helper.make_tensor_value_info(n, TensorProto.FLOAT16, None) for n in outs])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("pakv", 1)], ir_version=8)
    k, v = rng.standard_normal((3, 2, 8)).astype(np.float16), rng.standard_normal((3, 3, 5)).astype(np.float16)
    slots = np.array([5, -1, 17], np.int64)  # block 1 row 1, padding, block 4 row 1
    want_k, want_v = kc.copy(), vc.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot // 4, slot % 4], want_v[slot // 4, slot % 4] = k[t], v[t]
    one = ort.InferenceSession(scatter_model(False).SerializeToString(), options, providers=["CPUExecutionProvider"])
    caches = (kc.copy(), vc.copy())
    out_k, out_v = one.run(None, dict(zip(snames, (k, v, *caches, slots))))
    assert np.array_equal(out_k, want_k) and np.array_equal(out_v, want_v)
    assert np.array_equal(caches[0], kc), "an unbound output wrote the input cache"
    # Bound in place (ORT GenAI's way): the kernel sees one buffer and writes only the rows.
    binding = one.io_binding()
    pool_k, pool_v = kc.copy(), vc.copy()
    for name, array in zip(snames, (k, v, pool_k, pool_v, slots)):
        binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    for name, array in (("key_cache_out", pool_k), ("value_cache_out", pool_v)):
        binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    one.run_with_iobinding(binding)
    assert np.array_equal(pool_k, want_k) and np.array_equal(pool_v, want_v)
    # Feeding a later node: a copy (the graph's input is left as it was), unless the host opts into the
    # alias route (session config entry pakv_onnx.alias_caches = 1; ORT >= 1.18): then the pool in place.
    minor = int(ort.__version__.split(".")[1])
    for opt_in in (None, "1"):
        fed_options = ort.SessionOptions()
        if opt_in:
            fed_options.add_session_config_entry("pakv_onnx.alias_caches", opt_in)
        fed_options.register_custom_ops_library(lib)
        fed = ort.InferenceSession(scatter_model(True).SerializeToString(), fed_options, providers=["CPUExecutionProvider"])
        pool_k, pool_v = kc.copy(), vc.copy()
        lens = np.array([0, 24], np.int32)
        all_k, _ = fed.run(None, dict(zip([*snames, "block_tables", "seq_lens"], (k, v, pool_k, pool_v, slots, np.arange(6, dtype=np.int32)[None], lens))))
        assert np.array_equal(all_k, want_k.reshape(24, 2, 8))
        aliased = np.array_equal(pool_k, want_k)
        assert aliased == (opt_in is not None and minor >= 18), (ort.__version__, opt_in, aliased)
        assert fed_options.get_session_config_entry("pakv_onnx.alias_caches") == ("1" if opt_in else "0")
        print("scatter route when feeding a node, alias", opt_in, ":", "in place (alias map)" if aliased else "copy")
    print("bare onnxruntime", ort.__version__, "ok")
    """
)


def _run_bare_script(script: Path, text: str) -> None:
    """Write ``text`` to ``script`` and run it with the built library's path; it must exit 0 printing ok."""
    from pakv_onnx.runtime_plugin import library_path

    script.write_text(text)
    result = subprocess.run(
        [sys.executable, str(script), str(library_path())], capture_output=True, text=True, timeout=120,
        cwd=script.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_library_runs_under_bare_onnxruntime_without_torch(tmp_path: Path) -> None:
    """The .so alone, in onnxruntime without torch or pakv_onnx: bit-exact, and a bad id is an ORT error."""
    _run_bare_script(tmp_path / "bare.py", BARE_ORT_SCRIPT)


def test_the_stated_onnxruntime_range_is_the_one_ci_tests() -> None:
    """README, pyproject's floor and .ci/run's pins name the same oldest onnxruntime releases."""
    import re

    pins = re.findall(r'"onnxruntime==([0-9.]+)"', (ROOT / ".ci" / "run").read_text())
    assert len(pins) == 2, pins
    python_oldest, library_oldest = pins
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"onnxruntime {python_oldest}" in readme and f"onnxruntime {library_oldest}" in readme
    floor = ".".join(python_oldest.split(".")[:2])
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"onnxruntime>={floor}" in dependencies, dependencies


# com.microsoft::PagedAttention on a bare runtime: fp32, separate QKV, rotary at past + j, derived
# slots, a ragged batch (a decode row, a two-token chunk); the caches compared exactly with a numpy
# write (rotary rounded as the CUDA kernel's fused multiply-add: a float64 sum of an exact product and
# a float32 term, exact for these magnitudes, rounded once), the output with a numpy attention (1e-5).
BARE_ORT_ATTENTION_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    N, HQ, HK, D, NB, BS = 3, 4, 2, 16, 4, 4
    names = ["query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length", "past_seqlens",
             "block_table", "cos_cache", "sin_cache"]
    node = helper.make_node("PagedAttention", names, ["output", "key_cache_out", "value_cache_out"],
                            domain="com.microsoft", num_heads=HQ, kv_num_heads=HK, do_rotary=1)
    types = [TensorProto.INT32 if 5 <= i <= 7 else TensorProto.FLOAT for i in range(len(names))]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, types)],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in node.output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=8)
    rng = np.random.default_rng(0)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    angles = np.arange(16)[:, None] / 10.0 ** np.arange(8)[None, :]
    feeds = dict(query=f(N, HQ * D), key=f(N, HK * D), value=f(N, HK * D), key_cache=f(NB, BS, HK, D),
                 value_cache=f(NB, BS, HK, D), cumulative_sequence_length=np.array([0, 1, 3], np.int32),
                 past_seqlens=np.array([2, 3], np.int32), block_table=np.array([[1, 0], [3, 2]], np.int32),
                 cos_cache=np.cos(angles).astype(np.float32), sin_cache=np.sin(angles).astype(np.float32))
    options = ort.SessionOptions()
    options.register_custom_ops_library(sys.argv[1])
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    output, key_cache, value_cache = session.run(None, feeds)

    def rotate(x, position):  # halves: fp32(a c + fp32(sign b s)), the CUDA kernel's fused form in fp32
        c, s = np.cos(angles[position]), np.sin(angles[position])
        c, s = c.astype(np.float32).astype(np.float64), s.astype(np.float32).astype(np.float64)
        a, b = x[..., :8].astype(np.float64), x[..., 8:].astype(np.float64)
        first = a * c + (-(b * s)).astype(np.float32).astype(np.float64)
        second = b * c + (a * s).astype(np.float32).astype(np.float64)
        return np.concatenate([first, second], -1).astype(np.float32)

    keys, values, queries = feeds["key_cache"].copy(), feeds["value_cache"].copy(), []
    for b, (start, past) in enumerate(((0, 2), (1, 3))):
        for j in range(feeds["cumulative_sequence_length"][b + 1] - start):
            t, p = start + j, past + j
            block = feeds["block_table"][b, p // BS]
            keys[block, p % BS] = rotate(feeds["key"][t].reshape(HK, D), p)
            values[block, p % BS] = feeds["value"][t].reshape(HK, D)
            queries.append((t, b, p, rotate(feeds["query"][t].reshape(HQ, D), p)))
    assert np.array_equal(key_cache, keys) and np.array_equal(value_cache, values), "the write"
    for t, b, p, q in queries:
        context = [(feeds["block_table"][b, i // BS], i % BS) for i in range(p + 1)]
        for h in range(HQ):
            k = np.stack([keys[blk, row, h // 2] for blk, row in context]).astype(np.float64)
            v = np.stack([values[blk, row, h // 2] for blk, row in context]).astype(np.float64)
            s = k @ q[h] / 4.0
            w = np.exp(s - s.max())
            assert np.allclose(output[t, h * D:(h + 1) * D], (w / w.sum()) @ v, atol=1e-5), (t, h)
    print("ok", ort.__version__)
    """
)


def test_ort_paged_attention_runs_under_bare_onnxruntime(tmp_path: Path) -> None:
    """The .so alone serves com.microsoft::PagedAttention in onnxruntime without torch or pakv_onnx
    (CI runs this on the oldest runtime, 1.16.3, too)."""
    _run_bare_script(tmp_path / "bare_attention.py", BARE_ORT_ATTENTION_SCRIPT)
