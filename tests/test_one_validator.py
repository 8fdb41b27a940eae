"""One validator (issue 19): every rule of the contract is written once, in the contract units
(``native_lib/pakv_contract_*.c``: one per op, and the pieces they share).

Each message the validator can give is found by parsing the C sources (every ``pakv_fail`` /
``pakv_fail_type`` format there); its longest literal stretch must appear once in those files and in
no other source of the package (Python or C). A second copy of a rule would have to word its
refusal, and so would show up here. Then the two defects that one rule for every path mended:
outputs a host binds in ORT are checked for overlap like the front's, and every backend reads
caches whose blocks overlap (stride 0 or less than a block).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import ORT_ERRORS
from onnx_graphs import plugin_model_for
from validator_records import index_record, record, validate

import pakv_onnx
from pakv_onnx import golden, kernels, runtime_plugin
from pakv_onnx.plans import GatherTensors
from pakv_onnx.spec import bitwise_equal
from pakv_onnx.validator import plan_gather

PACKAGE = Path(pakv_onnx.__file__).resolve().parent
CONTRACT_UNITS = sorted((PACKAGE / "native_lib").glob("pakv_contract_*.c"))
_CALL = re.compile(r"pakv_fail(?:_type)?\(\s*err,\s*((?:\"(?:[^\"\\]|\\.)*\"\s*)+)")
_LITERAL = re.compile(r"\"((?:[^\"\\]|\\.)*)\"")
_SPECIFIER = re.compile(r"%[-.0-9]*(?:lld|zu|s|d)")
# A string literal continued on the next line (C's and Python's implicit concatenation, f-strings too).
_CONTINUED = re.compile(r"[\"']\s*\n\s*(?:[rf]{0,2})[\"']")


def contract_messages() -> list[str]:
    """Every format string the validator fails with (adjacent C literals joined)."""
    source = "\n".join(unit.read_text() for unit in CONTRACT_UNITS)
    return ["".join(_LITERAL.findall(match.group(1))) for match in _CALL.finditer(source)]


def copy_pattern(message: str) -> re.Pattern:
    """A message's literal stretches in order, anything (an f-string field, a C specifier, a value
    written in) between them on one line: what any other copy of the rule would have to say."""
    parts = [p for p in _SPECIFIER.split(message) if p.strip()]
    return re.compile(r"[^\n]{0,80}?".join(re.escape(p) for p in parts))


def package_sources() -> dict[Path, str]:
    """Every source of the package, continued string literals joined."""
    files = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.c"), *PACKAGE.rglob("*.h")]
    return {path: _CONTINUED.sub("", path.read_text()) for path in files}


def test_the_validator_has_the_contracts_messages() -> None:
    messages = contract_messages()
    assert len(messages) >= 35, messages  # every rule of pakv_contract.h's list has its message
    for needle in ("must start at 0", "non-decreasing", "is outside [0, ", "is too short", "overlaps %s in memory",
                   "must be int32 or int64", "is not in the contract", "PA_NZ last dim", "row-major contiguous"):
        assert any(needle in m for m in messages), needle


@pytest.mark.parametrize("message", contract_messages(), ids=lambda m: m[:50])
def test_each_rule_is_written_once_in_the_c_validator(message: str) -> None:
    literal = "".join(_SPECIFIER.split(message)).strip()
    assert len(literal) >= 10, f"{message!r}: too little literal text to find a copy by"
    pattern = copy_pattern(message)
    sources = package_sources()
    found = sum(len(pattern.findall(sources[unit])) for unit in CONTRACT_UNITS)
    assert found == 1, f"{message!r} is written {found} times in the contract units"
    copies = [
        path.relative_to(PACKAGE) for path, text in sources.items() if path not in CONTRACT_UNITS and pattern.search(text)
    ]
    assert not copies, f"the rule worded {message!r} is written again in {copies}"


def test_the_check_finds_a_copied_rule() -> None:
    """The check above can fail: a Python re-check of the cumsum rule, worded as an f-string, is found."""
    copy = 'raise ValueError(f"seq_lens (cumsum) must start at 0, got seq_lens[0] = {first}")'
    message = next(m for m in contract_messages() if "must start at 0" in m)
    assert copy_pattern(message).search(copy)
    split = '    raise ValueError(\n        f"block_tables row {q} is too short: sequence {q} has {n} tokens "\n        f"= {b} blocks'
    message = next(m for m in contract_messages() if "block_tables row %lld is too short" in m)
    assert copy_pattern(message.split("= %lld blocks")[0] + "= %lld blocks").search(_CONTINUED.sub("", split))


# --------------------------------------------------------------------------- #
# Outputs a host binds in ORT: checked like the front's, before anything is written
# --------------------------------------------------------------------------- #
def square_call():
    """A call whose key and value outputs have one shape (so one buffer could be bound as both)."""
    gen = torch.Generator().manual_seed(3)
    key_cache = torch.randn(6, 4, 2, 8, generator=gen).to(torch.bfloat16)
    value_cache = torch.randn(6, 4, 2, 8, generator=gen).to(torch.bfloat16)
    feeds = {
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": torch.tensor([[0, 5], [3, 1]], dtype=torch.int32),
        "seq_lens": torch.tensor([0, 5, 8], dtype=torch.int32),
        "seq_offset": None,
    }
    return feeds


def bound_outputs(feeds):
    shared = torch.zeros(8, 2, 8, dtype=torch.bfloat16)
    return {
        "one buffer for both": ({"key": shared, "value": shared}, "key_out and value_out overlap in memory"),
        "key over key_cache": (
            {"key": feeds["key_cache"].view(-1)[64:192].view(8, 2, 8), "value": torch.zeros(8, 2, 8, dtype=torch.bfloat16)},
            "key_out overlaps key_cache in memory",
        ),
        "value over value_cache": (
            {"key": torch.zeros(8, 2, 8, dtype=torch.bfloat16), "value": feeds["value_cache"][1:3].reshape(8, 2, 8)},
            "value_out overlaps value_cache in memory",
        ),
    }


@pytest.mark.parametrize("case", list(bound_outputs(square_call())))
@pytest.mark.parametrize("backend", ["native", "golden"])
def test_outputs_bound_over_each_other_or_an_input_are_refused_in_ort(case: str, backend: str) -> None:
    feeds = square_call()
    out, text = bound_outputs(feeds)[case]
    model = plugin_model_for(*(feeds[n] for n in ("key_cache", "value_cache", "block_tables", "seq_lens", "seq_offset")))
    session = runtime_plugin.make_session(model, backend=backend)
    before = {n: t.clone() for n, t in feeds.items() if t is not None}
    with pytest.raises(ORT_ERRORS, match=re.escape(f"ValueError: {text}")):
        runtime_plugin.run(session, feeds, out=out)
    for name, tensor in before.items():
        assert bitwise_equal(feeds[name], tensor), f"{name} was written before the refusal"
    # The same outputs as the front's caller outputs: the same message.
    with pytest.raises(ValueError, match=re.escape(text)):
        pakv_onnx.gather_pa_kv_cache(**feeds, key_out=out["key"], value_out=out["value"], backend=backend)


def test_outputs_bound_apart_still_run_in_ort() -> None:
    feeds = square_call()
    out = {"key": torch.zeros(8, 2, 8, dtype=torch.bfloat16), "value": torch.zeros(8, 2, 8, dtype=torch.bfloat16)}
    model = plugin_model_for(*(feeds[n] for n in ("key_cache", "value_cache", "block_tables", "seq_lens", "seq_offset")))
    got = runtime_plugin.run(runtime_plugin.make_session(model), feeds, out=out)
    want = pakv_onnx.gather_pa_kv_cache(**feeds, backend="golden")
    assert got["key"] is out["key"] and bitwise_equal(out["key"], want[0]) and bitwise_equal(out["value"], want[1])


# --------------------------------------------------------------------------- #
# Caches whose blocks overlap: one rule (any stride >= 0) for every backend
# --------------------------------------------------------------------------- #
def overlapping_caches(heads: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    one_block = torch.randn(1, 4, heads, 8, generator=gen).to(torch.bfloat16)
    rows = torch.randn(40, heads, 8, generator=gen).to(torch.bfloat16)
    row = heads * 8
    return {
        "expanded (stride 0)": one_block.expand(6, 4, heads, 8),
        "half-block stride": rows.as_strided((6, 4, heads, 8), (2 * row, row, 8, 1)),
    }


@pytest.mark.parametrize("name", list(overlapping_caches(2, 9)))
@pytest.mark.parametrize("backend", ["auto", "native", "torch", "golden"])
def test_caches_whose_blocks_overlap_are_read_by_every_backend(name: str, backend: str) -> None:
    key_cache, value_cache = overlapping_caches(2, 9)[name], overlapping_caches(1, 10)[name]
    tables = torch.tensor([[5, 0, 3], [2, 4, 1]], dtype=torch.int64)
    seq_lens = torch.tensor([0, 10, 21])
    plan = plan_gather(key_cache, value_cache, tables, seq_lens)
    if backend == "auto":
        assert kernels.resolve_backend("auto", plan, key_cache, value_cache).name == "native"
    want = (torch.empty(plan.key_out_shape, dtype=torch.bfloat16), torch.empty(plan.value_out_shape, dtype=torch.bfloat16))
    golden.gather_golden(plan, GatherTensors(key_cache, value_cache, *want))
    for t in range(21):  # the golden itself, token by token: out[t] = cache[table[q, t // bs], t % bs]
        q, local = (0, t) if t < 10 else (1, t - 10)
        assert bitwise_equal(want[0][t], key_cache[int(tables[q, local // 4]), local % 4])
    key, value = pakv_onnx.gather_pa_kv_cache(key_cache, value_cache, tables, seq_lens, backend=backend)
    assert bitwise_equal(key, want[0]) and bitwise_equal(value, want[1])


def test_a_negative_block_stride_is_refused_for_every_backend() -> None:
    """No torch tensor has a negative stride; a raw record can, and the validator refuses it by name."""
    tables, seq_lens = torch.zeros(1, 1, dtype=torch.int64), torch.tensor([0, 1])
    answer = validate({
        "key_cache": record((2, 4, 2, 8), strides=(-64, 16, 8, 1)),
        "value_cache": record((2, 4, 2, 8)),
        "block_tables": index_record(tables),
        "seq_lens": index_record(seq_lens),
    })
    assert answer == (ValueError, "key_cache has a negative stride -64")
