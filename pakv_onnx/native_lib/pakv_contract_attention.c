/* pakv::PagedAttention's contract: every rule of the attention (pakv_contract.h, at
 * pakv_validate_attention), with its message, once. Shared pieces: pakv_contract_records.c. */
#include <string.h>

#include "pakv_contract_records.h"

static const char* const ATTENTION_NAMES[PAKV_ATTENTION_RECORDS] = {
    "query", "key_cache", "value_cache", "block_table", "cumulative_sequence_lengths", "past_sequence_lengths",
    "output"};

/* 1 / sqrt(d) rounded to float, for d >= 1 (Newton's iteration in double: the library needs no libm).
 * It starts at x itself, which is >= sqrt(x) for every x >= 1: from above, Newton's steps decrease
 * until they reach sqrt(x), so the first step that does not decrease ends it. (A start at x / 2 is
 * below sqrt(x) for x < 4: the first step rose and stopped it at once, so head_dim 2 and 3 got a
 * scale of 1 and 2/3 instead of 1/sqrt(2) and 1/sqrt(3).) ~36 steps for d = 2^62. */
static float inverse_sqrt(int64_t d) {
  double x = (double)d, s = x > 1.0 ? x : 1.0;
  for (int i = 0; i < 200; i++) {
    double next = 0.5 * (s + x / s);
    if (next >= s) break; /* from above it decreases until it reaches sqrt(x) */
    s = next;
  }
  return (float)(1.0 / s);
}

/* [N, Hq, D] of a dtype attention computes in, on the caches' device, D = key_cache's head_dim, Hq a
 * multiple of key_cache's kv heads; every token row-major (any token stride). */
static int attention_query(const pakv_tensor* t, const pakv_cache_geometry* k, const pakv_cache_geometry* v, pakv_err* err) {
  const pakv_tensor *q = &t[PAKV_ATTENTION_QUERY], *kc = &t[PAKV_ATTENTION_KEY_CACHE];
  char shape[160], key_shape[160];
  if (pakv_same_device(q, "query", kc, err) || pakv_require_rank(q, "query", 3, "[num_tokens, heads, head_dim]", err)) return -1;
  if (q->dims[2] != k->token_dims[1])
    return pakv_fail(err, "query head_dim %lld must be key_cache's head_dim %lld (query shape %s, key_cache shape %s)",
                     (long long)q->dims[2], (long long)k->token_dims[1], SHAPE(q, shape), SHAPE(kc, key_shape));
  if (k->token_dims[0] < 1)
    return pakv_fail(err, "key_cache must have at least one (kv) head, got shape %s", SHAPE(kc, key_shape));
  if (v->token_dims[0] != k->token_dims[0])
    return pakv_fail(err, "value_cache must have key_cache's %lld kv heads, got shape %s", (long long)k->token_dims[0],
                     SHAPE(&t[PAKV_ATTENTION_VALUE_CACHE], shape));
  if (q->dims[1] % k->token_dims[0])
    return pakv_fail(err, "query's %lld heads must be a multiple of key_cache's %lld kv heads (GQA), query shape %s",
                     (long long)q->dims[1], (long long)k->token_dims[0], SHAPE(q, shape));
  return 0;
}

/* block_table [B, cols], cumulative_sequence_lengths [B+1], past_sequence_lengths [B]. */
static int attention_indices(const pakv_tensor* t, pakv_err* err) {
  const pakv_tensor *bt = &t[PAKV_ATTENTION_BLOCK_TABLE], *cu = &t[PAKV_ATTENTION_CU_SEQ_LENS],
                    *past = &t[PAKV_ATTENTION_PAST_LENS];
  char shape[160];
  if (pakv_index_record(bt, "block_table", 2, "[batch, max_blocks]", err) ||
      pakv_index_record(cu, "cumulative_sequence_lengths", 1, "a vector", err) ||
      pakv_index_record(past, "past_sequence_lengths", 1, "a vector", err))
    return -1;
  int64_t B = bt->dims[0], entries;
  if (pakv_add(B, 1, &entries) || cu->dims[0] != entries)
    return pakv_fail(err, "cumulative_sequence_lengths must have B+1 entries for block_table with B = %lld rows, got shape %s",
                     (long long)B, SHAPE(cu, shape));
  if (past->dims[0] != B)
    return pakv_fail(err, "past_sequence_lengths must have B = %lld entries (block_table's rows), got shape %s",
                     (long long)B, SHAPE(past, shape));
  return 0;
}

/* Per sequence: query start, new tokens and context (past + new) into `starts`, `counts`, `lengths`;
 * the lengths' rules; the table rows and block ids a sequence with new tokens reads. */
static int attention_sequences(const pakv_tensor* t, int64_t N, int64_t bs, int64_t nb, int64_t* starts,
                               int64_t* counts, int64_t* lengths, pakv_err* err) {
  const pakv_tensor *bt = &t[PAKV_ATTENTION_BLOCK_TABLE], *cu = &t[PAKV_ATTENTION_CU_SEQ_LENS],
                    *past = &t[PAKV_ATTENTION_PAST_LENS];
  int64_t B = bt->dims[0], total = 0;
  if (pakv_cumulative_counts(cu, "cumulative_sequence_lengths", "cumulative_sequence_lengths", B, starts, counts, &total,
                             err))
    return -1;
  for (int64_t b = 0; b < B; b++) { /* each entry read once: a snapshot */
    int64_t before = pakv_vector_at(past, b);
    if (before < 0)
      return pakv_fail(err, "past_sequence_lengths must be non-negative, got past_sequence_lengths[%lld] = %lld",
                       (long long)b, (long long)before);
    if (pakv_add(before, counts[b], &lengths[b]))
      return pakv_fail(err, "past_sequence_lengths[%lld] = %lld plus its %lld new tokens overflows int64", (long long)b,
                       (long long)before, (long long)counts[b]);
  }
  if (total != N)
    return pakv_fail(err, "cumulative_sequence_lengths must end at query's %lld tokens, got cumulative_sequence_lengths[%lld] = %lld",
                     (long long)N, (long long)B, (long long)total);
  return pakv_check_table_reads(bt, counts, lengths, bs, nb, -1, err);
}

int64_t pakv_attention_scratch_len(const pakv_tensor t[PAKV_ATTENTION_RECORDS]) {
  const pakv_tensor* bt = &t[PAKV_ATTENTION_BLOCK_TABLE];
  int64_t len;
  if (!bt->present || bt->ndim != 2 || bt->dims[0] < 0) return 0;
  return pakv_mul(bt->dims[0], 3, &len) ? -1 : len;
}

int pakv_validate_attention_output(const pakv_tensor t[PAKV_ATTENTION_RECORDS], const pakv_attention_plan* plan,
                                   pakv_err* err) {
  const pakv_tensor* out = &t[PAKV_ATTENTION_OUT];
  int64_t dims[3] = {plan->num_tokens, plan->num_heads, plan->value_head_dim};
  if (!out->present) return 0;
  if (pakv_record_ok(out, "output", err) || pakv_output_record(out, "output", &t[PAKV_ATTENTION_QUERY], "query", dims, 3, err))
    return -1;
  return pakv_output_apart(t, ATTENTION_NAMES, PAKV_ATTENTION_OUT, PAKV_ATTENTION_INPUTS, -1, err);
}

int pakv_validate_attention(const pakv_tensor t[PAKV_ATTENTION_RECORDS], float scale, pakv_attention_plan* plan,
                            int64_t* scratch, int64_t scratch_len, pakv_err* err) {
  pakv_cache_geometry k, v;
  const pakv_tensor *q = &t[PAKV_ATTENTION_QUERY], *kc = &t[PAKV_ATTENTION_KEY_CACHE],
                    *vc = &t[PAKV_ATTENTION_VALUE_CACHE], *bt = &t[PAKV_ATTENTION_BLOCK_TABLE];
  for (int i = 0; i < PAKV_ATTENTION_INPUTS; i++)
    if (t[i].present && pakv_record_ok(&t[i], ATTENTION_NAMES[i], err)) return -1;
  if (pakv_require_present(q, "query", err)) return -1;
  if (pakv_require_compute_dtype(q, err)) return -1;
  if (pakv_require_present(kc, "key_cache", err) || pakv_same_dtype(kc, "key_cache", q, "query", err) ||
      pakv_require_present(vc, "value_cache", err) || pakv_same_dtype(vc, "value_cache", q, "query", err))
    return -1;
  if (pakv_check_caches(kc, vc, 0, &k, &v, err) || attention_query(t, &k, &v, err)) return -1;
  int64_t query_stride;
  if (pakv_token_layout(q, "query", k.itemsize, &query_stride, err) || attention_indices(t, err)) return -1;
  if (!(scale > -3.4e38f && scale < 3.4e38f))
    return pakv_fail(err, "scale must be a finite float (0: 1 / sqrt(head_dim)), got %.9g", (double)scale);
  int64_t B = bt->dims[0], N = q->dims[0], out_bytes, needed = pakv_attention_scratch_len(t);
  if (needed < 0 || scratch_len < needed || (needed > 0 && !scratch))
    return pakv_fail(err, "block_table has %lld rows: no memory for the plan's 3 x %lld per-sequence entries",
                     (long long)B, (long long)B);
  int64_t *starts = scratch, *counts = scratch + B, *lengths = scratch + 2 * B;
  if (attention_sequences(t, N, k.block_size, k.num_blocks, starts, counts, lengths, err)) return -1;
  if (pakv_mul(N, q->dims[1], &out_bytes) || pakv_mul(out_bytes, v.token_dims[1], &out_bytes) ||
      pakv_mul(out_bytes, k.itemsize, &out_bytes))
    return pakv_fail(err, "an output of %lld tokens x %lld heads x %lld values overflows int64 byte offsets",
                     (long long)N, (long long)q->dims[1], (long long)v.token_dims[1]);

  memset(plan, 0, sizeof(*plan));
  plan->abi_version = PAKV_ABI_VERSION;
  plan->struct_size = sizeof(pakv_attention_plan);
  plan->query_type = plan->out_type = plan->key_type = plan->value_type = q->elem_type;
  plan->causal = 1;
  plan->window = -1;
  plan->tables64 = bt->elem_type == PAKV_ONNX_INT64;
  PAKV_PLAN_CACHES(plan, k, v, pakv_plan_address(kc), pakv_plan_address(vc));
  plan->key_head_stride = k.token_dims[1] * k.itemsize; /* Norm [nb, bs, Hk, D]: heads dense in a row */
  plan->value_head_stride = v.token_dims[1] * v.itemsize;
  plan->key_row_stride = k.row_bytes;
  plan->value_row_stride = v.row_bytes;
  plan->num_heads = q->dims[1];
  plan->num_kv_heads = k.token_dims[0];
  plan->head_dim = k.token_dims[1];
  plan->value_head_dim = v.token_dims[1];
  plan->query = pakv_plan_address(q);
  plan->query_token_stride = query_stride;
  plan->query_head_stride = plan->head_dim * k.itemsize;
  plan->num_tokens = N;
  plan->num_seqs = B;
  plan->table_cols = bt->dims[1];
  plan->block_tables = bt->host_data;
  plan->table_row_stride = bt->strides[0] * pakv_index_itemsize(bt->elem_type);
  plan->table_col_stride = bt->strides[1] * pakv_index_itemsize(bt->elem_type);
  plan->query_starts = starts;
  plan->query_counts = counts;
  plan->context_lens = lengths;
  plan->scale = scale != 0.0f ? scale : plan->head_dim > 0 ? inverse_sqrt(plan->head_dim) : 1.0f;
  if (pakv_validate_attention_output(t, plan, err)) return -1;
  plan->out = t[PAKV_ATTENTION_OUT].present ? (void*)t[PAKV_ATTENTION_OUT].data : NULL;
  return pakv_check_attention_plan(plan, err); /* the attention core's memory-safety view of the same plan */
}

/* Exported entry points (pakv_onnx/validator.py). */
PAKV_EXPORT int pakv_plan_attention(pakv_attention_call* call) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  if (!call) return PAKV_ERR_VALUE;
  int rc = pakv_validate_attention(call->records, call->scale, &call->plan, call->scratch, call->scratch_len, &err);
  return pakv_report(rc, &err, call->error, call->error ? PAKV_ERR_LEN : 0);
}

PAKV_EXPORT int pakv_check_attention_output(const pakv_attention_call* call) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  if (!call) return PAKV_ERR_VALUE;
  return pakv_report(pakv_validate_attention_output(call->records, &call->plan, &err), &err, call->error,
                     call->error ? PAKV_ERR_LEN : 0);
}

PAKV_EXPORT size_t pakv_attention_call_size(void) { return sizeof(pakv_attention_call); }
