"""Shared test helpers (import them with ``from conftest import ...``; pytest puts tests/ on the path).

* :func:`assert_matches_golden` — outputs (a ``(key, value)`` sequence or a dict keyed by the
  contract's output names) bit-equal to the golden of a case.
* :func:`assert_matches_reference` — one backend through the public front, bit-equal to the
  independent per-token reference (optionally into caller-given outputs).
* :func:`junk_like`, :func:`unaligned_offsets`, :func:`with_value_dtype`, :func:`as_pool_views` —
  turn a valid case into a harder valid case (non-aligned ``seq_offset``, mixed dtypes, caches
  that are views of a larger pool).
* fixture ``temp_cache`` — the project cache dir pointed at a temporary directory for one test
  module (PyPTO runs, tuned tiles, the pypto-cpu worker), PyPTO's helper build kept shared.
* :data:`ORT_ERRORS` — what onnxruntime raises for a refused model or a failed run.
* :func:`run_python` — a script in a fresh interpreter (crash-prone scenarios; exit behaviour).
* Temporary files: every test (and every process it starts) writes its temporary files, pip's cache
  and torch's compile cache under pytest's base temporary directory (:data:`CONTAINED_ENV`), which
  a green run removes (pyproject.toml's ``tmp_path_retention_policy``): a run leaves nothing in
  /tmp or ~/.cache/pip.

One-node models for the runtime plugin are in ``onnx_graphs.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch
from per_token_reference import gather_per_token

import pakv_onnx
from pakv_onnx.cases import GatherCase, random_cache
from pakv_onnx.paths import CACHE_DIR_ENV, cache_dir
from pakv_onnx.spec import OUTPUT_NAMES, CacheMode, bitwise_equal, block_size_axis, nz_last_dim


def __getattr__(name: str):
    """:data:`ORT_ERRORS`, on first use: onnxruntime writes ``$TMPDIR/.ses`` when imported, so it is
    imported only after :func:`pytest_sessionstart` has pointed TMPDIR under pytest's folder."""
    if name != "ORT_ERRORS":
        raise AttributeError(name)
    import onnxruntime as ort

    # session.run_with_iobinding re-raises kernel failures as RuntimeError("Error in execution: ...");
    # session creation raises onnxruntime's own exception types.
    state = ort.capi.onnxruntime_pybind11_state
    return (RuntimeError, state.Fail, state.InvalidArgument, state.RuntimeException, state.InvalidGraph)


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# Where temporary files go, and the two caches a test run would otherwise fill outside it:
# variable -> folder under the session's temporary root (set from pytest_sessionstart to the end).
CONTAINED_ENV = {"TMPDIR": ".", "TORCHINDUCTOR_CACHE_DIR": "torchinductor", "PIP_CACHE_DIR": "pip"}
_saved_temp_settings: list = []


def pytest_sessionstart(session: pytest.Session) -> None:
    """Point temporary files, torch's compile cache and pip's cache under pytest's base temp dir."""
    root = session.config._tmp_path_factory.getbasetemp() / "tmp"
    root.mkdir(exist_ok=True)
    _saved_temp_settings.append((tempfile.tempdir, {name: os.environ.get(name) for name in CONTAINED_ENV}))
    for name, sub in CONTAINED_ENV.items():
        os.environ[name] = str((root / sub).resolve())
    tempfile.tempdir = None  # tempfile reads TMPDIR again on next use


@pytest.hookimpl(trylast=True)  # after pytest's own, which removes a green run's base temp dir
def pytest_sessionfinish(session: pytest.Session) -> None:
    _remove_empty_pytest_root(session.config._tmp_path_factory)
    if not _saved_temp_settings:
        return
    tempdir, saved = _saved_temp_settings.pop()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = tempdir


def _remove_empty_pytest_root(factory: pytest.TempPathFactory) -> None:
    """pytest puts its base temp dir in ``$TMPDIR/pytest-of-$USER/pytest-N``; a green run removes
    ``pytest-N`` (tmp_path_retention_policy) but not its parent. Remove the parent too when nothing
    else is in it: only its dead ``pytest-current`` link (another session's folder keeps it, and so
    does a failed run's). Not for a ``--basetemp`` the caller chose."""
    if factory._given_basetemp is not None or factory._basetemp is None or factory._basetemp.exists():
        return
    root = factory._basetemp.parent
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            if entry.is_symlink() and not entry.exists():
                entry.unlink(missing_ok=True)
        root.rmdir()  # fails, harmlessly, while anything else is in it


def run_python(
    script: str,
    timeout: int = 240,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess:
    """Run ``script`` (dedented; ``sys.argv[1:]`` = ``args``) in a fresh interpreter, this checkout
    and tests/ first on sys.path (so it can import ``onnx_graphs``)."""
    root = os.path.dirname(TESTS_DIR)
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    full_env.update(env or {})
    command = [sys.executable, "-c", textwrap.dedent(script), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)


def rerun_with_the_8_float_walk(test_file: str, deselect: str) -> None:
    """``test_file``'s tests, but those ``-k`` ``deselect`` names, in a fresh pytest with
    PAKV_ONNX_ATTENTION_WIDTH=8 (the attention core picks its walk once per process): all must pass."""
    env = dict(os.environ, PAKV_ONNX_ATTENTION_WIDTH="8")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", f"not ({deselect})"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def _as_pair(outputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(outputs, Mapping):
        return tuple(outputs[name] for name in OUTPUT_NAMES)  # type: ignore[return-value]
    assert len(outputs) == len(OUTPUT_NAMES), f"expected {len(OUTPUT_NAMES)} outputs, got {len(outputs)}"
    return tuple(outputs)  # type: ignore[return-value]


def assert_pair_equal(got, want, label: str) -> None:
    """Both outputs bit-equal (dtype, shape and bytes)."""
    for name, g, w in zip(OUTPUT_NAMES, _as_pair(got), _as_pair(want)):
        assert bitwise_equal(g, w), (
            f"{name} differs ({label}): got {g.dtype} {tuple(g.shape)}, want {w.dtype} {tuple(w.shape)}"
        )


def assert_matches_golden(outputs, case: GatherCase, label: str = "") -> None:
    """``outputs`` equal the golden of ``case`` bit for bit."""
    assert_pair_equal(outputs, case.golden(), f"{label} vs golden, {case.summary()}")


def reference_outputs(case: GatherCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token reference's (key, value) for ``case`` (straight from the contract text)."""
    return gather_per_token(
        *case.inputs(), cache_mode=case.cache_mode.value, is_seq_lens_cumsum=case.is_seq_lens_cumsum
    )


def junk_like(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of ``tensor``'s shape and dtype filled with a byte pattern, so an unwritten row shows."""
    raw = torch.full((tensor.numel() * tensor.element_size(),), 0x5A, dtype=torch.uint8)
    return raw.view(tensor.dtype).view(tensor.shape)


def assert_matches_reference(case: GatherCase, backend: str, *, caller_outputs: bool = False) -> None:
    """``backend`` through :func:`pakv_onnx.gather_pa_kv_cache` equals the per-token reference."""
    want = reference_outputs(case)
    kwargs = {}
    if caller_outputs:
        kwargs = {"key_out": junk_like(want[0]), "value_out": junk_like(want[1])}
    got = pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend=backend, **kwargs)
    if caller_outputs:
        assert got[0].data_ptr() == kwargs["key_out"].data_ptr()
        assert got[1].data_ptr() == kwargs["value_out"].data_ptr()
    assert_pair_equal(got, want, f"{backend} vs per-token reference, {case.summary()}")


# --------------------------------------------------------------------------- #
# Case transforms
# --------------------------------------------------------------------------- #
def block_size_of(case: GatherCase) -> int:
    return case.key_cache.shape[block_size_axis(case.cache_mode)]


def unaligned_offsets(case: GatherCase, seed: int) -> GatherCase:
    """``case`` with a random remainder in ``[0, bs)`` added to every ``seq_offset`` (same columns: the FLOOR RULE).

    A case without ``seq_offset`` gets one (its columns stay 0).
    """
    rng = random.Random(seed)
    bs = block_size_of(case)
    num_seqs = case.block_tables.shape[0]
    base = case.seq_offset if case.seq_offset is not None else torch.zeros(num_seqs, dtype=torch.int64)
    remainder = torch.tensor([rng.randrange(bs) for _ in range(num_seqs)], dtype=torch.int64)
    if bs > 1 and num_seqs and not bool(remainder.any()):
        remainder[0] = bs - 1  # at least one offset really off the block boundary
    return dataclasses.replace(case, seq_offset=(base.to(torch.int64) + remainder).to(base.dtype))


def with_value_dtype(case: GatherCase, dtype: torch.dtype, seed: int) -> GatherCase:
    """``case`` with a fresh value cache of ``dtype`` (same num_blocks, block_size and layout)."""
    generator = torch.Generator().manual_seed(seed)
    nb, bs = case.key_cache.shape[0], block_size_of(case)
    if case.cache_mode is CacheMode.NORM:
        shape = (nb, bs, *case.value_cache.shape[2:])
    else:
        shape = (nb, case.value_cache.shape[1], bs, nz_last_dim(torch.empty((), dtype=dtype).element_size()))
    return dataclasses.replace(case, value_cache=random_cache(shape, dtype, generator))


def pool_view(cache: torch.Tensor, *, slot: int, parts: int, pad: int = 0) -> torch.Tensor:
    """``cache``'s bytes placed as part ``slot`` of a junk-filled pool, returned as a view of the pool.

    The pool is ``[nb, parts * block_numel + pad]`` elements; the view is strided on dim 0 only
    (block stride ``parts * block_numel + pad``), as ``pool[:, slot]`` of a K/V pool is.
    """
    nb = cache.shape[0]
    block_numel = cache[0].numel() if nb else 0
    pool = junk_like(torch.empty((nb, parts * block_numel + pad), dtype=cache.dtype))
    start = slot * block_numel
    view = pool[:, start : start + block_numel].view(nb, *cache.shape[1:])
    view.copy_(cache)
    return view


def as_pool_views(case: GatherCase, *, pad: int = 0) -> GatherCase:
    """``case`` with key and value caches turned into pool views (key part 0, value part 1 of a 2-part pool)."""
    return dataclasses.replace(
        case,
        key_cache=pool_view(case.key_cache, slot=0, parts=2, pad=pad),
        value_cache=pool_view(case.value_cache, slot=1, parts=2, pad=pad),
    )


# The helper build takes about a minute, so it lives in the user's real cache (built once per
# machine); every run directory, log, tuned-tiles file and pypto-cpu worker of the PyPTO tests goes
# to a temporary directory removed with the test module.
@pytest.fixture(scope="module")
def temp_cache(tmp_path_factory):
    """Point the project cache at a fresh temporary directory for one test module."""
    from pakv_onnx.pypto import cpu
    from pakv_onnx.pypto.adapter import HELPER_DIR_ENV

    shared_helper = os.environ.get(HELPER_DIR_ENV) or str(cache_dir("pypto", "calculator"))
    path = tmp_path_factory.mktemp("pakv-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(path))
        patch.setenv(HELPER_DIR_ENV, shared_helper)
        yield path
        cpu._stop_worker()


def perturbed_norms(model, seed: int = 0):
    """``model`` with every RMS norm weight (Qwen3's q/k norms too) drawn around 1, from ``seed``:
    transformers inits them all to ones, so a norm wired to another's weight, or to none, would go
    unseen. Returns ``model``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.empty_like(parameter).normal_(1.0, 0.2, generator=generator))
    return model


# --- pakv-onnx serve: one exported sample folder and one server for the whole session -------------------
SERVE_API_KEY = "test-key"


@pytest.fixture(scope="session")
def serve_folder(tmp_path_factory) -> Path:
    """The sample Llama (seeded weights, word-level tokenizer, chat template) as `pakv-onnx export` writes
    it: block size 4, 64 blocks (257 tokens at most per request), batches of 8, one intra-op thread."""
    from serve_helpers import needs

    from pakv_onnx import cli
    from pakv_onnx.models.hf import save_sample_folder

    for module in ("fastapi", "uvicorn", "openai", "onnxruntime_genai"):
        needs(module)
    root = tmp_path_factory.mktemp("serve")
    hf = save_sample_folder(root / "hf", "llama", 0)
    out = root / "tiny-llama-genai"
    args = ["--block-size", "4", "--num-blocks", "64", "--max-batch-size", "8", "--threads", "1"]
    assert cli.main(["export", str(hf), str(out), *args]) == 0
    return out


@pytest.fixture(scope="session")
def served(serve_folder: Path):
    """`pakv-onnx serve` of :func:`serve_folder` with an API key, on a free loopback port; killed at the end."""
    from serve_helpers import running_server

    with running_server(serve_folder, "--api-key", SERVE_API_KEY, "--max-queue", "256") as server:
        yield server
