/* pakv::GatherPaKvCache's contract: every rule of the gather (pakv_contract.h lists them in order),
 * with its message, once. The pieces the ops share are in pakv_contract_records.c. */
#include <stdio.h>
#include <string.h>

#include "pakv_contract_records.h"

static const char* const GATHER_NAMES[PAKV_GATHER_RECORDS] = {
    "key_cache", "value_cache", "block_tables", "seq_lens", "seq_offset", "key_out", "value_out"};

/* ------------------------------------------------------------------------------------------- */
/* Index tensors                                                                               */
/* ------------------------------------------------------------------------------------------- */
static int check_indices(const pakv_tensor* t, int cumsum, pakv_err* err) {
  const pakv_tensor *bt = &t[PAKV_GATHER_BLOCK_TABLES], *sl = &t[PAKV_GATHER_SEQ_LENS], *so = &t[PAKV_GATHER_SEQ_OFFSET];
  char shape[160];
  if (pakv_index_record(bt, "block_tables", 2, "[Q, max_blocks_per_seq]", err)) return -1;
  if (pakv_index_record(sl, "seq_lens", 1, "a vector", err)) return -1;
  int64_t Q = bt->dims[0], expected = Q;
  if (cumsum && pakv_add(Q, 1, &expected))
    return pakv_fail(err, "block_tables has %lld rows: Q+1 (seq_lens entries) overflows int64", (long long)Q);
  if (sl->dims[0] != expected)
    return pakv_fail(err, "seq_lens must have %s = %lld entries for block_tables with Q = %lld rows, got shape %s",
                     cumsum ? "Q+1 (cumsum)" : "Q (lengths)", (long long)expected, (long long)Q, SHAPE(sl, shape));
  if (so->present) {
    if (pakv_index_record(so, "seq_offset", 1, "a vector", err)) return -1;
    if (so->dims[0] != Q)
      return pakv_fail(err, "seq_offset must have Q = %lld entries, got shape %s", (long long)Q, SHAPE(so, shape));
  }
  return 0;
}

/* The block ids a gather reads (every column a sequence's tokens span, from its seq_offset's). */
static const pakv_id_rule TABLE_ID = {"block_tables", "num_blocks of key_cache", "", 0};

/* Per-sequence lengths and output starts from seq_lens (each entry read once: a snapshot). */
static int read_lengths(const pakv_tensor* sl, int cumsum, int64_t Q, int64_t* lengths, int64_t* starts,
                        int64_t* total_out, pakv_err* err) {
  int64_t total = 0;
  if (cumsum) {
    if (pakv_cumulative_counts(sl, "seq_lens (cumsum)", "seq_lens", Q, starts, lengths, &total, err)) return -1;
  } else {
    for (int64_t q = 0; q < Q; q++) {
      int64_t n = pakv_vector_at(sl, q);
      if (n < 0)
        return pakv_fail(err, "seq_lens (lengths) must be non-negative, got seq_lens[%lld] = %lld", (long long)q,
                         (long long)n);
      if (n > INT64_MAX - total)
        return pakv_fail(err, "seq_lens (lengths): the total token count overflows int64 at seq_lens[%lld]",
                         (long long)q);
      lengths[q] = n;
      starts[q] = total;
      total += n;
    }
  }
  *total_out = total;
  return 0;
}

/* First block-table column of each sequence: the FLOOR RULE, seq_offset[q] // block_size. */
static int read_col_starts(const pakv_tensor* so, int64_t Q, int64_t bs, int64_t* cols0, pakv_err* err) {
  for (int64_t q = 0; q < Q; q++) {
    int64_t off = so->present ? pakv_vector_at(so, q) : 0;
    if (off < 0)
      return pakv_fail(err, "seq_offset must be non-negative, got seq_offset[%lld] = %lld", (long long)q,
                       (long long)off);
    cols0[q] = off / bs; /* any offset; the remainder is ignored */
  }
  return 0;
}

/* Every row long enough for its sequence (all rows first), then every used id in range. */
static int check_tables(const pakv_tensor* bt, int64_t Q, int64_t bs, int64_t nb, const int64_t* lengths,
                        const int64_t* cols0, pakv_err* err) {
  int64_t cols = bt->dims[1];
  for (int64_t q = 0; q < Q; q++) {
    int64_t need = lengths[q] / bs + (lengths[q] % bs != 0); /* ceil without forming len + bs - 1 */
    if (need > cols - cols0[q])
      return pakv_fail(err,
                       "block_tables row %lld is too short: sequence %lld has %lld tokens = %lld blocks of %lld "
                       "starting at column %lld (seq_offset), but block_tables has %lld columns",
                       (long long)q, (long long)q, (long long)lengths[q], (long long)need, (long long)bs,
                       (long long)cols0[q], (long long)cols);
  }
  for (int64_t q = 0; q < Q; q++) {
    int64_t need = lengths[q] / bs + (lengths[q] % bs != 0);
    for (int64_t c = cols0[q]; c < cols0[q] + need; c++)
      if (pakv_check_id(&TABLE_ID, pakv_table_at(bt, q, c), nb, q, c, q, err)) return -1;
  }
  return 0;
}

int pakv_validate_gather_outputs(const pakv_tensor t[PAKV_GATHER_RECORDS], const pakv_plan* plan, pakv_err* err) {
  for (int which = PAKV_GATHER_KEY_OUT; which <= PAKV_GATHER_VALUE_OUT; which++) {
    const pakv_tensor* out = &t[which];
    if (!out->present) continue;
    if (pakv_record_ok(out, GATHER_NAMES[which], err)) return -1;
    const int64_t* dims = which == PAKV_GATHER_KEY_OUT ? plan->key_out_dims : plan->value_out_dims;
    int cache = which - PAKV_GATHER_KEY_OUT;
    if (pakv_output_record(out, GATHER_NAMES[which], &t[cache], GATHER_NAMES[cache], dims, plan->out_rank, err)) return -1;
  }
  return pakv_outputs_apart(t, GATHER_NAMES, PAKV_GATHER_INPUTS, NULL, err);
}

/* ------------------------------------------------------------------------------------------- */
/* The gather                                                                                  */
/* ------------------------------------------------------------------------------------------- */
int64_t pakv_gather_scratch_len(const pakv_tensor t[PAKV_GATHER_RECORDS]) {
  const pakv_tensor* bt = &t[PAKV_GATHER_BLOCK_TABLES];
  int64_t len;
  if (!bt->present || bt->ndim != 2 || bt->dims[0] < 0) return 0;
  return pakv_mul(bt->dims[0], 3, &len) ? -1 : len;
}

int pakv_validate_gather(const pakv_tensor t[PAKV_GATHER_RECORDS], int nz, int cumsum, pakv_plan* plan,
                         int64_t* scratch, int64_t scratch_len, pakv_err* err) {
  pakv_cache_geometry k, v;
  for (int i = 0; i < PAKV_GATHER_INPUTS; i++)
    if (t[i].present && pakv_record_ok(&t[i], GATHER_NAMES[i], err)) return -1;
  if (pakv_check_caches(&t[PAKV_GATHER_KEY_CACHE], &t[PAKV_GATHER_VALUE_CACHE], nz, &k, &v, err) ||
      check_indices(t, cumsum, err))
    return -1;
  const pakv_tensor* bt = &t[PAKV_GATHER_BLOCK_TABLES];
  int64_t Q = bt->dims[0], total = 0, needed = pakv_gather_scratch_len(t);
  if (needed < 0 || scratch_len < needed || (needed > 0 && !scratch))
    return pakv_fail(err, "block_tables has %lld rows: no memory for the plan's 3 x %lld index entries",
                     (long long)Q, (long long)Q);
  int64_t *lengths = scratch, *starts = scratch + Q, *cols0 = scratch + 2 * Q;
  if (read_lengths(&t[PAKV_GATHER_SEQ_LENS], cumsum, Q, lengths, starts, &total, err)) return -1;
  if (read_col_starts(&t[PAKV_GATHER_SEQ_OFFSET], Q, k.block_size, cols0, err)) return -1;
  if (check_tables(bt, Q, k.block_size, k.num_blocks, lengths, cols0, err)) return -1;
  int64_t key_bytes, value_bytes, both;
  for (int which = 0; which < 2; which++) {
    int64_t row = which ? v.row_bytes : k.row_bytes;
    if (pakv_mul(total, row, which ? &value_bytes : &key_bytes))
      return pakv_fail(err, "%s output of %lld tokens x %lld bytes overflows int64 byte offsets",
                       which ? "value" : "key", (long long)total, (long long)row);
  }
  if (pakv_add(key_bytes, value_bytes, &both))
    return pakv_fail(err, "key and value outputs of %lld tokens (%lld + %lld bytes) overflow int64 byte offsets",
                     (long long)total, (long long)key_bytes, (long long)value_bytes);

  memset(plan, 0, sizeof(*plan));
  plan->abi_version = PAKV_ABI_VERSION;
  plan->struct_size = sizeof(pakv_plan);
  plan->layout = nz ? PAKV_LAYOUT_NZ : PAKV_LAYOUT_NORM;
  plan->tables64 = bt->elem_type == PAKV_ONNX_INT64;
  PAKV_PLAN_CACHES(plan, k, v, t[PAKV_GATHER_KEY_CACHE].data, t[PAKV_GATHER_VALUE_CACHE].data);
  plan->key_row_bytes = k.row_bytes;
  plan->value_row_bytes = v.row_bytes;
  plan->num_seqs = Q;
  plan->table_cols = bt->dims[1];
  plan->block_tables = bt->host_data;
  plan->table_row_stride = bt->strides[0] * pakv_index_itemsize(bt->elem_type);
  plan->table_col_stride = bt->strides[1] * pakv_index_itemsize(bt->elem_type);
  plan->seq_lengths = lengths;
  plan->out_starts = starts;
  plan->col_starts = cols0;
  plan->num_tokens = total;
  plan->out_rank = nz ? 2 : 3;
  plan->key_out_dims[0] = plan->value_out_dims[0] = total;
  plan->key_out_dims[1] = k.token_dims[0];
  plan->key_out_dims[2] = k.token_dims[1];
  plan->value_out_dims[1] = v.token_dims[0];
  plan->value_out_dims[2] = v.token_dims[1];
  if (pakv_validate_gather_outputs(t, plan, err)) return -1;
  plan->key_out = t[PAKV_GATHER_KEY_OUT].present ? (void*)t[PAKV_GATHER_KEY_OUT].data : NULL;
  plan->value_out = t[PAKV_GATHER_VALUE_OUT].present ? (void*)t[PAKV_GATHER_VALUE_OUT].data : NULL;
  return pakv_check_plan(plan, err); /* the copy core's memory-safety view of the same plan */
}

/* Exported entry points (pakv_onnx/validator.py): 0, or the error's kind with its message. */
PAKV_EXPORT int pakv_plan_gather(pakv_gather_call* call) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  if (!call) return PAKV_ERR_VALUE;
  int rc = pakv_validate_gather(call->records, call->nz != 0, call->cumsum != 0, &call->plan, call->scratch,
                                call->scratch_len, &err);
  return pakv_report(rc, &err, call->error, call->error ? PAKV_ERR_LEN : 0);
}

PAKV_EXPORT int pakv_check_gather_outputs(const pakv_gather_call* call) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  if (!call) return PAKV_ERR_VALUE;
  return pakv_report(pakv_validate_gather_outputs(call->records, &call->plan, &err), &err, call->error,
                     call->error ? PAKV_ERR_LEN : 0);
}

PAKV_EXPORT size_t pakv_gather_call_size(void) { return sizeof(pakv_gather_call); }
