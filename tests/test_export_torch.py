"""The torch custom op ``torch.ops.pakv.gather_pa_kv_cache``: eager, torch.export, torch.compile.

Every result is compared bit-exactly (``spec.bitwise_equal``) with the golden of its case.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_matches_golden

import pakv_onnx.export as pe
from pakv_onnx.cases import GatherCase, paged_case, random_case
from pakv_onnx.spec import CACHE_DTYPES, CacheMode, nz_last_dim


class GatherModule(torch.nn.Module):
    """A module whose forward is one call of the op (seq_offset optional)."""

    def __init__(self, cache_mode: CacheMode | str, is_seq_lens_cumsum: bool) -> None:
        super().__init__()
        self.cache_mode = CacheMode(cache_mode).value
        self.is_seq_lens_cumsum = is_seq_lens_cumsum

    def forward(self, key_cache, value_cache, block_tables, seq_lens, seq_offset=None):
        return torch.ops.pakv.gather_pa_kv_cache(
            key_cache, value_cache, block_tables, seq_lens, seq_offset, self.cache_mode, self.is_seq_lens_cumsum
        )


def sized_case(
    seed: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    cache_mode: CacheMode = CacheMode.NORM,
    is_seq_lens_cumsum: bool = True,
    with_seq_offset: bool = True,
    block_size: int = 4,
    index_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype] = (torch.int32, torch.int32, torch.int32),
    min_size: int = 1,
) -> GatherCase:
    """A random case whose token shapes and block size are fixed (only Q, T, nb and the table vary).

    Key rows are (2 heads x 5) Norm / 2 fractals PA_NZ, value rows (3 x 4) / 3 fractals, so one
    exported model (static head dims) runs every case of a layout and dtype. ``min_size=2``
    makes an export example (torch.export specialises dynamic dims of size 0 or 1).
    """
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    num_blocks = rng.randint(min_size, 40)
    num_seqs = rng.randint(min_size, 7)
    lengths = [rng.choice((0, rng.randint(1, block_size), rng.randint(1, 4 * block_size))) for _ in range(num_seqs)]
    offsets = [rng.randint(0, 2) if with_seq_offset else 0 for _ in range(num_seqs)]
    used = [o + -(-n // block_size) for o, n in zip(offsets, lengths)]
    e = nz_last_dim(torch.empty(0, dtype=dtype).element_size())
    pa_nz = cache_mode is CacheMode.PA_NZ
    return paged_case(
        case_id=f"sized-{seed}",
        description="fixed token shapes",
        lengths=lengths,
        block_size=block_size,
        num_blocks=num_blocks,
        key_token=(2, e) if pa_nz else (2, 5),
        value_token=(3, e) if pa_nz else (3, 4),
        key_dtype=dtype,
        offset_cols=offsets,
        extra_cols=max(min_size, max(used) + rng.randint(0, 3)) - max(used),
        cache_mode=cache_mode,
        is_seq_lens_cumsum=is_seq_lens_cumsum,
        index_dtypes=index_dtypes,
        with_seq_offset=with_seq_offset,
        rng=rng,
        generator=generator,
    )


def module_args(case: GatherCase) -> tuple:
    """Positional args for :class:`GatherModule` (seq_offset left out when absent)."""
    inputs = case.inputs()
    return inputs if case.seq_offset is not None else inputs[:4]


@pytest.mark.parametrize("seed", range(12))
def test_eager_matches_golden_random_cases(seed):
    dtype = CACHE_DTYPES[seed % len(CACHE_DTYPES)].torch_dtype
    case = random_case(1000 + seed, dtype=dtype)
    module = GatherModule(case.cache_mode, case.is_seq_lens_cumsum)
    assert_matches_golden(module(*module_args(case)), case)


def test_op_is_registered_with_the_contract_arguments():
    schema = torch.ops.pakv.gather_pa_kv_cache.default._schema
    names = [a.name for a in schema.arguments]
    assert names == [
        "key_cache",
        "value_cache",
        "block_tables",
        "seq_lens",
        "seq_offset",
        "cache_mode",
        "is_seq_lens_cumsum",
    ]
    assert str(schema.arguments[4].type) == "Optional[Tensor]"
    assert pe.gather_pa_kv_cache is not None


def test_eager_defaults_and_keywords():
    case = sized_case(3, with_seq_offset=False)
    out = torch.ops.pakv.gather_pa_kv_cache(case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    assert_matches_golden(out, case)


def test_eager_rejects_contract_violations():
    cache = torch.zeros(4, 2, 1, 1, dtype=torch.bfloat16)
    tables = torch.tensor([[7]], dtype=torch.int32)  # block 7 of 4
    seq_lens = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\] = 7"):
        torch.ops.pakv.gather_pa_kv_cache(cache, cache, tables, seq_lens)
    with pytest.raises(ValueError, match="cache_mode"):
        torch.ops.pakv.gather_pa_kv_cache(cache, cache, tables % 4, seq_lens, None, "ND", True)


@pytest.mark.parametrize(
    "cache_mode,is_cumsum,with_offset",
    [(CacheMode.NORM, True, True), (CacheMode.PA_NZ, False, False), (CacheMode.PA_NZ, True, True)],
)
def test_torch_export_matches_golden_at_several_sizes(cache_mode, is_cumsum, with_offset):
    cases = [
        sized_case(s, cache_mode=cache_mode, is_seq_lens_cumsum=is_cumsum, with_seq_offset=with_offset, min_size=m)
        for s, m in ((10, 2), (11, 1), (12, 1), (13, 1))
    ]
    module = GatherModule(cache_mode, is_cumsum)
    shapes = pe.op_dynamic_shapes(is_seq_lens_cumsum=is_cumsum, with_seq_offset=with_offset)
    program = torch.export.export(module, module_args(cases[0]), dynamic_shapes=shapes[: len(module_args(cases[0]))])
    (node,) = [n for n in program.graph.nodes if n.op == "call_function" and "gather_pa_kv_cache" in str(n.target)]
    key_meta = node.meta["val"][0]
    assert isinstance(key_meta.shape[0], torch.SymInt)  # T is symbolic (data-dependent)
    exported = program.module()
    for case in cases:
        assert_matches_golden(exported(*module_args(case)), case)


class AttentionLike(torch.nn.Module):
    """Gather then compute with T (the data-dependent size) downstream."""

    def forward(self, key_cache, value_cache, block_tables, seq_lens, seq_offset):
        key, value = torch.ops.pakv.gather_pa_kv_cache(
            key_cache, value_cache, block_tables, seq_lens, seq_offset, "Norm", True
        )
        torch._check(key.shape[0] >= 1)
        scores = key.float().sum(dim=(1, 2))  # [T]
        return key, value, scores


@pytest.mark.slow  # inductor compiles the graph: about 30 s
def test_torch_compile_matches_golden():
    torch._dynamo.reset()
    module = AttentionLike()
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for seed in (20, 21):
        case = sized_case(seed, dtype=torch.float16)
        assert int(case.seq_lens[-1]) >= 1
        key, value, scores = compiled(*case.inputs())
        assert_matches_golden((key, value), case)
        assert torch.equal(scores, case.golden()[0].float().sum(dim=(1, 2)))


# --------------------------------------------------------------------------- #
# The op's signature comes from spec; torch.library.opcheck (as vLLM runs on its custom ops)
# --------------------------------------------------------------------------- #
def test_torch_schema_is_spec_signature():
    from pakv_onnx.export import torch_op
    from pakv_onnx.spec import ATTRIBUTE_DEFAULTS, PARAMETER_NAMES

    schema = torch.ops.pakv.gather_pa_kv_cache.default._schema
    assert tuple(a.name for a in schema.arguments) == PARAMETER_NAMES
    defaults = {a.name: a.default_value for a in schema.arguments if a.name in ATTRIBUTE_DEFAULTS}
    assert defaults == ATTRIBUTE_DEFAULTS
    assert str(schema).endswith(torch_op.torch_schema().split("->")[-1].strip())


def test_translation_signatures_are_checked_against_spec():
    from pakv_onnx.export import translation

    def wrong(
        key_cache, value_cache, block_tables, seq_lens, seq_offset=None, cache_mode="ND", is_seq_lens_cumsum=True
    ):
        return None

    with pytest.raises(AssertionError, match=r"default of cache_mode is 'ND'"):
        translation.check_signature(wrong)


OPCHECK_CASES = [
    (40, torch.bfloat16, CacheMode.NORM, True),
    (41, torch.float16, CacheMode.PA_NZ, False),
    (42, torch.int8, CacheMode.NORM, False),
    (43, torch.uint16, CacheMode.PA_NZ, True),  # (opcheck's own schema test cannot multiply float8)
    (44, torch.float32, CacheMode.NORM, True),
]


@pytest.mark.parametrize("seed, dtype, mode, is_cumsum", OPCHECK_CASES, ids=lambda v: str(v))
def test_opcheck(seed, dtype, mode, is_cumsum):
    case = random_case(seed, dtype=dtype, cache_mode=mode, is_seq_lens_cumsum=is_cumsum)
    kwargs = {"cache_mode": mode.value, "is_seq_lens_cumsum": is_cumsum}
    result = torch.library.opcheck(torch.ops.pakv.gather_pa_kv_cache.default, case.inputs(), kwargs)
    assert set(result.values()) == {"SUCCESS"}, result


def test_opcheck_mixed_dtypes():
    from conftest import with_value_dtype

    case = with_value_dtype(random_case(45, dtype=torch.bfloat16, cache_mode=CacheMode.PA_NZ), torch.int8, 1)
    kwargs = {"cache_mode": "PA_NZ", "is_seq_lens_cumsum": case.is_seq_lens_cumsum}
    result = torch.library.opcheck(torch.ops.pakv.gather_pa_kv_cache.default, case.inputs(), kwargs)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("key_dtype, value_dtype", [(torch.float8_e4m3fn, torch.bfloat16), (torch.int8, torch.float16)])
def test_torch_export_mixed_dtypes(key_dtype, value_dtype):
    from conftest import with_value_dtype

    cases = [
        with_value_dtype(sized_case(s, dtype=key_dtype, min_size=m), value_dtype, s) for s, m in ((50, 2), (51, 1))
    ]
    module = GatherModule(CacheMode.NORM, True)
    program = torch.export.export(module, module_args(cases[0]), dynamic_shapes=pe.op_dynamic_shapes())
    for case in cases:
        key, value = program.module()(*module_args(case))
        assert (key.dtype, value.dtype) == (key_dtype, value_dtype)
        assert_matches_golden((key, value), case)
