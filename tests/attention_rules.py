"""PagedAttention's non-finite rules, position by position in numpy fp64, and the hand-placed cases that
exercise them: the reference every path is held to (tests/test_attention_nonfinite.py, and the ASan
build inside ORT: tests/native/hardening_session.py). No torch.

The rules (docs/reliability.md, "Non-finite values in attention"): a position a query does not see
(another sequence's, a later one, past the context) is never read; scores are ``scale * q . k`` at the
visible positions; a NaN or +inf score makes the query's whole row NaN; a -inf score takes the position
out (weight 0, its value row never read); no position left makes the row NaN; the rest are weighted by
softmax and every one of them counts as weight > 0, so a NaN in its value row gives NaN in that channel,
+inf gives +inf, -inf gives -inf, +inf and -inf together NaN.
"""

from __future__ import annotations

import math

import numpy as np

# The cases' geometry: sequence 0 has 5 past + 3 new tokens, sequence 1 has 6 past + 1 new; 2 kv heads,
# 2 query heads each (GQA), head_dim 8, block_size 4 (contexts of 8 and 7: the last block of sequence 1
# has a row past its context). Blocks: sequence 0 reads 3, 0; sequence 1 reads 1, 4; block 2 is unused.
NEW, PAST, KV_HEADS, GROUP, DIM, BLOCK = (3, 1), (5, 6), 2, 2, 8, 4
TABLE = np.array([[3, 0], [1, 4]], np.int64)


def where(b: int, pos: int) -> tuple[int, int]:
    """(block, row) of position ``pos`` of sequence ``b``."""
    return int(TABLE[b, pos // BLOCK]), pos % BLOCK


def token(b: int, j: int) -> int:
    """Query row of new token ``j`` of sequence ``b``."""
    return sum(NEW[:b]) + j


def base_case(seed: int = 0) -> dict[str, np.ndarray]:
    """Finite random inputs (fp64) in the op's order; every case below changes a few entries."""
    rng = np.random.default_rng(seed)
    heads = KV_HEADS * GROUP
    return {
        "query": rng.standard_normal((sum(NEW), heads, DIM)),
        "key_cache": rng.standard_normal((5, BLOCK, KV_HEADS, DIM)),
        "value_cache": rng.standard_normal((5, BLOCK, KV_HEADS, DIM)),
        "block_table": TABLE.copy(),
        "cumulative_sequence_lengths": np.concatenate([[0], np.cumsum(NEW)]).astype(np.int64),
        "past_sequence_lengths": np.array(PAST, np.int64),
    }


def _queries_of(a: dict, b: int, kv_head: int) -> tuple[slice, slice]:
    return slice(token(b, 0), token(b, NEW[b])), slice(kv_head * GROUP, (kv_head + 1) * GROUP)


def key_plus_inf_against_negative_queries(a: dict) -> None:
    """Every query of sequence 0, kv head 0, scores -inf at position 2 (channel 0: +inf x negative)."""
    rows, heads = _queries_of(a, 0, 0)
    a["query"][rows, heads, 0] = -np.abs(a["query"][rows, heads, 0]) - 0.5
    a["key_cache"][(*where(0, 2), 0, 0)] = np.inf


def and_its_value_nan(a: dict) -> None:
    """As above, and position 2's value row is NaN: weight 0, so never read (0 x NaN must not poison)."""
    key_plus_inf_against_negative_queries(a)
    a["value_cache"][(*where(0, 2), 0)] = np.nan


def key_minus_inf_against_positive_queries(a: dict) -> None:
    rows, heads = _queries_of(a, 1, 1)
    a["query"][rows, heads, 3] = np.abs(a["query"][rows, heads, 3]) + 0.5
    a["key_cache"][(*where(1, 0), 1, 3)] = -np.inf
    a["value_cache"][(*where(1, 0), 1, 5)] = np.inf  # absent: its +inf never reaches the output


def nan_value_of_a_later_new_token(a: dict) -> None:
    """Sequence 0's last new token (position 7) has a NaN value: queries 0 and 1 do not see it; query 2
    does, in channel 3 only."""
    a["value_cache"][(*where(0, 7), 0, 3)] = np.nan


def nan_value_in_the_other_sequence(a: dict) -> None:
    a["value_cache"][(*where(1, 0), 1)] = np.nan


def nan_key_of_a_later_new_token(a: dict) -> None:
    a["key_cache"][(*where(0, 6), 1, 2)] = np.nan


def nan_past_the_context(a: dict) -> None:
    """Row 3 of sequence 1's last block is past its context (7 tokens), block 2 is nobody's."""
    for cache in ("key_cache", "value_cache"):
        a[cache][(*where(1, 7),)] = np.nan
        a[cache][2] = np.nan


def nan_key_at_a_visible_position(a: dict) -> None:
    a["key_cache"][(*where(1, 3), 0, 6)] = np.nan


def plus_inf_score(a: dict) -> None:
    """Query row (0, head 3) has +inf in channel 1 and position 4 a positive key there: score +inf."""
    a["query"][token(0, 0), 3, 1] = np.inf
    a["key_cache"][(*where(0, 4), 1, 1)] = 2.0


def every_visible_score_minus_inf(a: dict) -> None:
    """Sequence 1's query, head 0: -inf in channel 0, every key positive there: all scores -inf."""
    a["query"][token(1, 0), 0, 0] = -np.inf
    for pos in range(PAST[1] + NEW[1]):
        a["key_cache"][(*where(1, pos), 0, 0)] = 0.25 + pos


def plus_inf_value_of_equal_scores(a: dict) -> None:
    """A zero query (every score 0: equal weights) and +inf in one visible value: +inf in that channel."""
    a["query"][token(0, 1), 2] = 0.0
    a["value_cache"][(*where(0, 3), 1, 4)] = np.inf


def minus_inf_value(a: dict) -> None:
    a["value_cache"][(*where(1, 5), 0, 0)] = -np.inf


def infinities_of_both_signs(a: dict) -> None:
    a["value_cache"][(*where(0, 1), 1, 6)] = np.inf
    a["value_cache"][(*where(0, 4), 1, 6)] = -np.inf


def nan_in_a_query(a: dict) -> None:
    a["query"][token(0, 2), 1, 5] = np.nan


CASES = {f.__name__: f for f in (
    key_plus_inf_against_negative_queries, and_its_value_nan, key_minus_inf_against_positive_queries,
    nan_value_of_a_later_new_token, nan_value_in_the_other_sequence, nan_key_of_a_later_new_token,
    nan_past_the_context, nan_key_at_a_visible_position, plus_inf_score, every_visible_score_minus_inf,
    plus_inf_value_of_equal_scores, minus_inf_value, infinities_of_both_signs, nan_in_a_query,
)}  # fmt: skip


def make_case(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    arrays = base_case(seed)
    CASES[name](arrays)
    return arrays


def attention_by_the_rules(a: dict, scale: float = 0.0) -> np.ndarray:
    """``[N, Hq, Dv]`` in fp64 by the rules, one query row and one position at a time, read through
    the block table. ``scale`` 0 means 1 / sqrt(D)."""
    q, kc, vc = (np.asarray(a[n], np.float64) for n in ("query", "key_cache", "value_cache"))
    table, cu, past = (np.asarray(a[n], np.int64) for n in ("block_table", "cumulative_sequence_lengths", "past_sequence_lengths"))
    hq, d, hk, bs, dv = q.shape[1], q.shape[2], kc.shape[2], kc.shape[1], vc.shape[3]
    scale = scale or (1 / math.sqrt(d) if d else 1.0)
    out = np.full((q.shape[0], hq, dv), np.nan)
    with np.errstate(all="ignore"):
        for b in range(len(past)):
            for j in range(int(cu[b + 1] - cu[b])):
                row, last = int(cu[b]) + j, int(past[b]) + j
                for h in range(hq):
                    g = h // (hq // hk)
                    keys = [kc[table[b, p // bs], p % bs, g] for p in range(last + 1)]
                    values = [vc[table[b, p // bs], p % bs, g] for p in range(last + 1)]
                    scores = np.array([scale * float(np.dot(q[row, h], k)) for k in keys])
                    if np.isnan(scores).any() or (scores == np.inf).any():
                        continue  # NaN row
                    live = [i for i, s in enumerate(scores) if s > -np.inf]
                    if not live:
                        continue
                    top = max(scores[i] for i in live)
                    weights = {i: math.exp(scores[i] - top) for i in live}
                    total = sum(weights.values())
                    out[row, h] = sum((weights[i] / total) * values[i] for i in live)
    return out


def check(got: np.ndarray, want: np.ndarray, atol: float, rtol: float, label: str) -> None:
    """NaN exactly where the rules give NaN, the same infinities, the rest within ``atol + rtol |want|``."""
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, (label, got.shape, want.shape)
    nan_want, nan_got = np.isnan(want), np.isnan(got)
    assert np.array_equal(nan_got, nan_want), f"{label}: NaN at {np.argwhere(nan_got != nan_want).tolist()[:6]} (got / want)"
    inf_want = np.isinf(want)
    assert np.array_equal(np.isinf(got), inf_want) and np.array_equal(got[inf_want], want[inf_want]), f"{label}: infinities"
    finite = ~(nan_want | inf_want)
    err = np.abs(got[finite] - want[finite]) - (atol + rtol * np.abs(want[finite]))
    assert err.size == 0 or err.max() <= 0, f"{label}: finite outputs off by {err.max():.3g} past the tolerance"
