"""Property test (hypothesis): malformed inputs to the native kernel through ORT only ever give
errors, never crashes or out-of-bounds reads, and the kernel accepts exactly what the contract
(validator.plan_gather) accepts, bit-exact when it does. Runs in a subprocess so a crash fails the
test instead of killing pytest."""

from __future__ import annotations

from conftest import run_python

SCRIPT = (
    """
    import sys
    import torch
    from hypothesis import HealthCheck, given, settings, strategies as st
    from pakv_onnx import gather_pa_kv_cache, runtime_plugin
    from onnx_graphs import plugin_model_for
    from pakv_onnx.spec import CACHE_DTYPES, INPUT_NAMES, bitwise_equal, nz_last_dim
    from pakv_onnx.validator import plan_gather

    sessions = {}
    stats = {"accepted": 0, "refused": 0}
    index = st.sampled_from([torch.int32, torch.int64])
    big = st.integers(-(2**31), 2**31 - 1)
    small = st.integers(-3, 12)

    @st.composite
    def calls(draw):
        dtype = draw(st.sampled_from(CACHE_DTYPES))
        nz = draw(st.booleans())
        cumsum = draw(st.booleans())
        nb, bs = draw(st.integers(0, 5)), draw(st.integers(0, 4))
        e = nz_last_dim(dtype.itemsize)
        if nz:
            k_shape = [nb, draw(st.integers(0, 2)), bs, draw(st.sampled_from([e, e, e + 1]))]
            v_shape = [draw(st.sampled_from([nb, nb, nb + 1])), draw(st.integers(0, 2)), bs, e]
        else:
            k_shape = [nb, bs, draw(st.integers(0, 2)), draw(st.integers(0, 3))]
            v_shape = [draw(st.sampled_from([nb, nb, nb + 1])), bs, draw(st.integers(1, 2)), draw(st.integers(1, 3))]
        if draw(st.integers(0, 15)) == 0:
            k_shape = k_shape[:3]
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
        key_cache = torch.randint(-100, 100, k_shape, dtype=bits).view(dtype.torch_dtype)
        value_cache = torch.randint(-100, 100, v_shape, dtype=bits).view(dtype.torch_dtype)
        q, cols = draw(st.integers(0, 3)), draw(st.integers(0, 4))
        values = st.one_of(small, big) if draw(st.booleans()) else small
        tables = torch.tensor(draw(st.lists(values, min_size=q * cols, max_size=q * cols)), dtype=torch.int64).reshape(q, cols)
        if draw(st.integers(0, 15)) == 0:
            tables = tables.reshape(-1)
        n_lens = (q + 1 if cumsum else q) + draw(st.sampled_from([0, 0, 0, 1]))
        if cumsum and draw(st.booleans()):
            steps = draw(st.lists(st.integers(0, 9), min_size=max(n_lens - 1, 0), max_size=max(n_lens - 1, 0)))
            lens = [0] + torch.tensor(steps, dtype=torch.int64).cumsum(0).tolist() if n_lens else []
        else:
            lens = draw(st.lists(st.one_of(small, big, st.sampled_from([2**63 - 1, -(2**63)])), min_size=n_lens, max_size=n_lens))
        seq_lens = torch.tensor(lens, dtype=torch.int64)
        offset = None
        if draw(st.booleans()):
            n_off = q + draw(st.sampled_from([0, 0, 0, 1]))
            offset = torch.tensor(draw(st.lists(st.one_of(small, big), min_size=n_off, max_size=n_off)), dtype=torch.int64)
        ti, si, oi = draw(index), draw(index), draw(index)
        def cast(t, d):  # int32 keeps only values that fit (others would be a different test)
            return t.clamp(-(2**31), 2**31 - 1).to(d) if d == torch.int32 else t
        inputs = [key_cache, value_cache, cast(tables, ti), cast(seq_lens, si), None if offset is None else cast(offset, oi)]
        return inputs, ("PA_NZ" if nz else "Norm"), cumsum

    @settings(max_examples=int(sys.argv[1]), deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(calls())
    def prop(call):
        inputs, mode, cumsum = call
        try:
            plan_gather(*inputs, cache_mode=mode, is_seq_lens_cumsum=cumsum)
            spec_ok = True
        except (TypeError, ValueError):
            spec_ok = False
        model = plugin_model_for(*inputs, cache_mode=mode, is_seq_lens_cumsum=cumsum).SerializeToString()
        if model not in sessions:
            sessions[model] = runtime_plugin.make_session(model, backend="native")
        feeds = {n: t for n, t in zip(INPUT_NAMES, inputs) if t is not None}
        try:
            out = runtime_plugin.run(sessions[model], feeds)
        except RuntimeError as exc:
            assert not spec_ok, f"native refused a valid call: {exc}"
            stats["refused"] += 1
            return
        assert spec_ok, "native accepted a call the contract refuses"
        key, value = gather_pa_kv_cache(*inputs, cache_mode=mode, is_seq_lens_cumsum=cumsum, backend="golden")
        assert bitwise_equal(out["key"], key) and bitwise_equal(out["value"], value)
        stats["accepted"] += 1

    prop()
    print("stats", stats["accepted"], stats["refused"])
    assert stats["accepted"] > 0 and stats["refused"] > 0
    """
)


def test_malformed_inputs_never_crash_the_native_kernel(tmp_path) -> None:
    # cwd: hypothesis keeps its example database in the working directory.
    result = run_python(SCRIPT, timeout=600, env={"ORT_LOGGING_LEVEL": "3"}, args=["400"], cwd=tmp_path)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert "stats" in result.stdout
