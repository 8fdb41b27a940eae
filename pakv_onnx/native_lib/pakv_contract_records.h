/* The pieces every op's validator shares (pakv_contract_records.c): reading tensor records (element
 * type names, ranks, extents, host-readable index entries), the caches' geometry and rules, the
 * index tensors' form, the output rules (shape, dtype, device, contiguity, no overlap) and the report
 * the exported entry points return. Internal to the contract units (pakv_contract_*.c): no other unit
 * includes it. The messages these pieces fail with are the contract's too, written here once. */
#ifndef PAKV_CONTRACT_RECORDS_H
#define PAKV_CONTRACT_RECORDS_H

#include <stddef.h>
#include <stdint.h>

#include "pakv_contract.h"
#include "pakv_dtypes.h"

/* A cache's geometry as its record gives it (Norm or PA_NZ). */
typedef struct {
  int itemsize;
  int64_t num_blocks, block_size, row_bytes, block_bytes, block_stride;
  int64_t token_dims[2]; /* Norm (H, D); PA_NZ (H*D, unused) */
} pakv_cache_geometry;

/* Records -------------------------------------------------------------------------------------- */
const char* pakv_type_name(int onnx_type); /* ONNX element type as torch spells it */

static inline int pakv_is_index_type(int t) { return t == PAKV_ONNX_INT32 || t == PAKV_ONNX_INT64; }

static inline int pakv_index_itemsize(int t) { return t == PAKV_ONNX_INT64 ? 8 : 4; }

/* "[6, 4, 16]" (or "rank N" past PAKV_MAX_RANK), into buf. */
const char* pakv_format_list(const int64_t* values, int32_t n, char* buf, size_t size);
#define SHAPE(t, buf) pakv_format_list((t)->dims, (t)->ndim, buf, sizeof(buf))
#define STRIDES(t, buf) pakv_format_list((t)->strides, (t)->ndim, buf, sizeof(buf))

int pakv_require_rank(const pakv_tensor* t, const char* name, int rank, const char* form, pakv_err* err);
int pakv_record_ok(const pakv_tensor* t, const char* name, pakv_err* err); /* no negative rank, dim or stride */
int pakv_has_elements(const pakv_tensor* t);
/* The product of a record's dims (0 for an empty or unsizable record). */
int64_t pakv_element_count(const pakv_tensor* t);
/* The address a plan keeps for record t: its data, or, for a record with no elements and no address (torch's
 * empty tensors), a static one that nothing reads or writes: plans never hold NULL for an empty tensor, so the
 * cores' NULL checks (for non-empty ones) pass valid degenerate calls and no offset is added to NULL. */
void* pakv_plan_address(const pakv_tensor* t);
/* [first, end) of the bytes a record may touch; 0 when it has no elements (or cannot be sized). */
int pakv_byte_extent(const pakv_tensor* t, int itemsize, uintptr_t* first, uintptr_t* end);
int pakv_element_size(int onnx_type);
int pakv_require_present(const pakv_tensor* t, const char* name, pakv_err* err);

/* Entry i of a vector record readable on the host. */
static inline int64_t pakv_vector_at(const pakv_tensor* t, int64_t i) {
  const char* at = (const char*)t->host_data + i * t->strides[0] * pakv_index_itemsize(t->elem_type);
  return t->elem_type == PAKV_ONNX_INT64 ? *(const int64_t*)at : (int64_t) * (const int32_t*)at;
}

/* Entry (q, c) of a matrix record readable on the host. */
static inline int64_t pakv_table_at(const pakv_tensor* bt, int64_t q, int64_t c) {
  const char* at =
      (const char*)bt->host_data + (q * bt->strides[0] + c * bt->strides[1]) * pakv_index_itemsize(bt->elem_type);
  return bt->elem_type == PAKV_ONNX_INT64 ? *(const int64_t*)at : (int64_t) * (const int32_t*)at;
}

/* Caches --------------------------------------------------------------------------------------- */
int pakv_cache_dtype(const pakv_tensor* t, const char* name, pakv_err* err); /* one of the contract's (TYPE) */
/* Rank 4 with the layout's shape (nz: PA_NZ); fills the geometry but the block stride. */
int pakv_cache_shape(const pakv_tensor* t, const char* name, int nz, pakv_cache_geometry* g, pakv_err* err);
/* Each block row-major contiguous (dims 1..3; size-1 dims may have any stride); the block axis
 * any stride >= 0 whose extent (num_blocks - 1) * stride + one block fits int64. */
int pakv_cache_layout(const pakv_tensor* t, const char* name, pakv_cache_geometry* g, pakv_err* err);
/* Both caches: dtype, one device, shape, one num_blocks and block_size (>= 1), layout. */
int pakv_check_caches(const pakv_tensor* kc, const pakv_tensor* vc, int nz, pakv_cache_geometry* k,
                      pakv_cache_geometry* v, pakv_err* err);

/* Caches a call writes: each cache's blocks apart (a block stride below one block would make two
 * slots one), and the two caches sharing no bytes (pool views side by side in one pool are fine);
 * vc may be absent (one cache). */
int pakv_caches_apart(const pakv_tensor* kc, const pakv_tensor* vc, const pakv_cache_geometry* k,
                      const pakv_cache_geometry* v, pakv_err* err);

/* query float32, float16 or bfloat16: the types both paged-attention ops compute in (TYPE). */
int pakv_require_compute_dtype(const pakv_tensor* query, pakv_err* err);
/* block_size >= 1 (key_cache's geometry). */
int pakv_check_block_size(const pakv_cache_geometry* k, pakv_err* err);

/* Index tensors -------------------------------------------------------------------------------- */
/* Present, int32/int64 (TYPE), of the rank, readable on the host. */
int pakv_index_record(const pakv_tensor* t, const char* name, int rank, const char* form, pakv_err* err);
/* The record's data readable on the host (host_data set). */
int pakv_require_host(const pakv_tensor* t, const char* name, pakv_err* err);
/* The rule of every cumulative-lengths input (`name`; `rule` the name the message gives the rule, e.g.
 * "seq_lens (cumsum)"): its count + 1 entries start at 0 and never decrease. Entry i's start and count
 * (entry i + 1 minus entry i) into starts[i], counts[i], the last entry into *total; each read once. */
int pakv_cumulative_counts(const pakv_tensor* cu, const char* rule, const char* name, int64_t count, int64_t* starts,
                           int64_t* counts, int64_t* total, pakv_err* err);
/* The rule of every id an op reads or writes through (a block id, a slot): in [0, bound), or negative where
 * the input lets a negative id mean "none" (negative_ok). Each op names its own input and bound: */
typedef struct {
  const char* name;  /* the input, e.g. "block_tables" */
  const char* bound; /* what the bound is, e.g. "num_blocks of key_cache" */
  const char* after; /* appended to the message (a note on the input's other entries), or "" */
  int negative_ok;   /* a negative id is padding (the write ops' slots) */
} pakv_id_rule;
int pakv_fail_id(const pakv_id_rule* rule, int64_t id, int64_t bound, int64_t row, int64_t col, int64_t reader,
                 pakv_err* err);
/* 0 when `id` keeps the rule; else its error: the entry (NAME[row, col]; col < 0: a vector, NAME[row]), its
 * value, the bound and what it is, the sequence that reads it when reader >= 0, then the rule's note. */
static inline int pakv_check_id(const pakv_id_rule* rule, int64_t id, int64_t bound, int64_t row, int64_t col,
                                int64_t reader, pakv_err* err) {
  if (id < bound && (id >= 0 || rule->negative_ok)) return 0;
  return pakv_fail_id(rule, id, bound, row, col, reader, err);
}
/* The caches' part of a plan, its fields named alike in pakv_plan, pakv_scatter_plan and pakv_attention_plan:
 * the geometry of both caches (k, v: pakv_cache_geometry) and their addresses. */
#define PAKV_PLAN_CACHES(plan, k, v, key_address, value_address) \
  do {                                                           \
    (plan)->num_blocks = (k).num_blocks;                         \
    (plan)->block_size = (k).block_size;                         \
    (plan)->key_cache = (key_address);                           \
    (plan)->value_cache = (value_address);                       \
    (plan)->key_block_stride = (k).block_stride;                 \
    (plan)->value_block_stride = (v).block_stride;               \
  } while (0)
/* A record on torch's meta device (no data) refused by name. */
int pakv_refuse_meta(const pakv_tensor* t, const char* name, pakv_err* err);
/* The block_table [B, cols] entries each sequence with new tokens reads (counts[b] new tokens, a
 * context of lengths[b] positions: columns up to ceil(length / bs), from the one of the first position
 * its first new token sees: 0, or with a window >= 0 (pakv_attention_plan's) past - window), each in
 * [0, nb); the row long enough for them. */
int pakv_check_table_reads(const pakv_tensor* bt, const int64_t* counts, const int64_t* lengths, int64_t bs, int64_t nb,
                           int64_t window, pakv_err* err);
/* A token and the slot it writes (the write ops' duplicate-slot check). */
typedef struct {
  int64_t slot, token;
} pakv_slot_pair;
/* The first token (in token order) that repeats an earlier token's slot among pairs[0..n) (sorted in
 * place), with that earlier token in *first; -1 when no slot repeats. */
int64_t pakv_first_repeated_slot(pakv_slot_pair* pairs, int64_t n, int64_t* first);
/* The write ops' refusal of token `token` writing the slot an earlier token `first` writes; returns -1. */
int pakv_fail_repeated_slot(pakv_err* err, int64_t token, int64_t slot, int64_t first);

/* Outputs and sources -------------------------------------------------------------------------- */
int pakv_same_dtype(const pakv_tensor* t, const char* name, const pakv_tensor* cache, const char* cache_name,
                    pakv_err* err);
int pakv_same_device(const pakv_tensor* t, const char* name, const pakv_tensor* cache, pakv_err* err);
/* An output (dense, of its cache's dtype and device) of the given dims. */
int pakv_output_record(const pakv_tensor* t, const char* name, const pakv_tensor* cache, const char* cache_name,
                       const int64_t* dims, int32_t rank, pakv_err* err);
int pakv_overlaps(const pakv_tensor* a, const pakv_tensor* b);
/* Output t[which] overlaps none of the inputs t[0 .. inputs), except that it may be exactly input
 * `in_place` (the same buffer: an in-place update; -1: none may). */
int pakv_output_apart(const pakv_tensor* t, const char* const* names, int which, int inputs, int in_place,
                      pakv_err* err);
/* The two outputs t[inputs], t[inputs + 1] overlap neither each other nor any input, except that
 * output i may be exactly its input in_place[i] (the same buffer: an in-place update). */
int pakv_outputs_apart(const pakv_tensor* t, const char* const* names, int inputs, const int* in_place,
                       pakv_err* err);
/* A rank-3 [T, H, D] record whose tokens are each row-major (any token stride >= 0: a slice of a
 * fused QKV projection is fine); the token stride in bytes. */
int pakv_token_layout(const pakv_tensor* t, const char* name, int itemsize, int64_t* token_stride, pakv_err* err);
/* Dim 0's stride of `t` in bytes (its token stride), or an error naming it when that overflows int64. */
int pakv_token_stride(const pakv_tensor* t, const char* name, int itemsize, int64_t* token_stride, pakv_err* err);

/* 0, or the error's kind (PAKV_ERR_VALUE / PAKV_ERR_TYPE) with its message copied to err_out. */
int pakv_report(int rc, const pakv_err* err, char* err_out, size_t err_len);

#endif /* PAKV_CONTRACT_RECORDS_H */
