/* The contract's validator: every rule of pakv::GatherPaKvCache, pakv::ScatterPaKvCache and
 * pakv::PagedAttention, written once, with its message.
 *
 * Every path calls it: the ORT kernels (pakv_ort.c), the Python front for every backend and the
 * plugin's Python callback (through pakv_onnx/validator.py). It reads tensor records (element
 * type, rank, dims, strides and a host pointer to each index tensor's data) and returns either
 * a pakv_plan the copy core can run, or one error saying which input, index and value broke
 * which rule, and whether that is a type error or a value error. It never reads a cache or an
 * output: their records contribute metadata and addresses only (so they may live on a device).
 *
 * Gather rules, in the order they are checked (each failure stops the check; the scatter's are
 * at pakv_validate_scatter below, the attention's at pakv_validate_attention):
 *   caches     element type in the contract (TYPE); one device; rank 4 with the layout's shape
 *              (PA_NZ: last dim 32 bytes / element size); same num_blocks and block_size; block_size
 *              >= 1; each block row-major contiguous, block stride >= 0, extent fits int64
 *   indices    int32/int64 (TYPE); block_tables [Q, cols], seq_lens [Q+1] (cumsum) or [Q]
 *              (lengths), seq_offset [Q] (optional); readable on the host
 *   values     seq_lens: cumsum starts at 0 and never decreases, lengths are >= 0 and sum within
 *              int64; seq_offset >= 0 (the FLOOR RULE: first column seq_offset // block_size);
 *              every used table row long enough; every used block id in [0, num_blocks)
 *   outputs    T x bytes per token fits int64; given outputs: the contract's shape, their cache's
 *              element type (TYPE), the caches' device, contiguous, overlapping neither each other
 *              nor any input
 */
#ifndef PAKV_CONTRACT_H
#define PAKV_CONTRACT_H

#include <stdint.h>

#include "pakv_core.h"

#define PAKV_MAX_RANK 8
#define PAKV_DEVICE_LEN 24

/* One tensor as the validator sees it. Dims and strides past PAKV_MAX_RANK are not kept (no
 * contract tensor has that rank: only ndim is then read, to refuse it). */
typedef struct {
  const void* data;      /* first element, on any device: extents, overlap, the copy (never read here) */
  const void* host_data; /* the same elements readable on this host (index tensors), else NULL */
  int32_t present;       /* 0: an absent optional input, or an output the caller did not give */
  int32_t elem_type;     /* ONNX TensorProto element type; 0: a type ONNX has no name for */
  int32_t ndim;
  int32_t reserved;
  char device[PAKV_DEVICE_LEN]; /* "cpu", "cuda:0", ...: tensors on different devices never overlap */
  int64_t dims[PAKV_MAX_RANK];
  int64_t strides[PAKV_MAX_RANK]; /* in elements, as torch reports them; dense for ORT tensors */
} pakv_tensor;

/* The records of one gather call, in this order (the op's inputs, then the caller's outputs). */
enum {
  PAKV_GATHER_KEY_CACHE = 0,
  PAKV_GATHER_VALUE_CACHE,
  PAKV_GATHER_BLOCK_TABLES,
  PAKV_GATHER_SEQ_LENS,
  PAKV_GATHER_SEQ_OFFSET,
  PAKV_GATHER_KEY_OUT,
  PAKV_GATHER_VALUE_OUT,
  PAKV_GATHER_RECORDS
};
#define PAKV_GATHER_INPUTS 5

/* Entries of int64 scratch a gather's plan needs: 3 x Q (lengths, output starts, first columns),
 * Q read from block_tables' record (0 when it is not a matrix: the validator refuses it first). */
int64_t pakv_gather_scratch_len(const pakv_tensor t[PAKV_GATHER_RECORDS]);

/* Validate a gather and fill `plan` (index arrays in `scratch`, which must stay alive as long as
 * the plan). Outputs whose records are present are checked too (pakv_validate_gather_outputs) and
 * set in the plan. Returns 0, or -1 with err set (nothing else written). */
int pakv_validate_gather(const pakv_tensor t[PAKV_GATHER_RECORDS], int nz, int cumsum, pakv_plan* plan,
                         int64_t* scratch, int64_t scratch_len, pakv_err* err);

/* The output rules alone, for outputs obtained after planning (ORT's, a Python allocator's):
 * records t[PAKV_GATHER_KEY_OUT], t[PAKV_GATHER_VALUE_OUT] against the plan made from t[0..4]. */
int pakv_validate_gather_outputs(const pakv_tensor t[PAKV_GATHER_RECORDS], const pakv_plan* plan, pakv_err* err);

/* One gather validation as a caller outside C hands it over in one piece (pakv_onnx/validator.py):
 * the records and attributes in, the plan out, the message (PAKV_ERR_LEN bytes) at `error`. */
typedef struct {
  pakv_plan plan;
  pakv_tensor records[PAKV_GATHER_RECORDS];
  int32_t nz;
  int32_t cumsum;
  int64_t scratch_len;
  int64_t* scratch;
  char* error;
} pakv_gather_call;

/* The records of one ScatterPaKvCache call: the op's inputs, then the updated caches (ORT's
 * outputs; absent in the Python API, which writes the caches in place). */
enum {
  PAKV_SCATTER_KEY = 0,
  PAKV_SCATTER_VALUE,
  PAKV_SCATTER_KEY_CACHE,
  PAKV_SCATTER_VALUE_CACHE,
  PAKV_SCATTER_SLOT_MAPPING,
  PAKV_SCATTER_KEY_CACHE_OUT,
  PAKV_SCATTER_VALUE_CACHE_OUT,
  PAKV_SCATTER_RECORDS
};
#define PAKV_SCATTER_INPUTS 5

/* Entries of int64 scratch a scatter's validation needs: 2 x T (T read from key's record). */
int64_t pakv_scatter_scratch_len(const pakv_tensor t[PAKV_SCATTER_RECORDS]);

/* Validate a scatter and fill `plan` (its caches are the input caches; a caller whose updated
 * caches live elsewhere copies each cache there first and points the plan at the copy).
 * Rules, after the caches' (as the gather's): key / value [T, H, D] of their cache's dtype,
 * device and row (each token row-major, any token stride >= 0), one T; slot_mapping int32/int64
 * [T], readable on the host; every slot < num_blocks x block_size (a negative slot is padding),
 * no slot twice; present outputs: their cache's shape, dtype and device, contiguous, either that
 * cache itself (in place) or overlapping no input and not each other. */
int pakv_validate_scatter(const pakv_tensor t[PAKV_SCATTER_RECORDS], int nz, pakv_scatter_plan* plan,
                          int64_t* scratch, int64_t scratch_len, pakv_err* err);

/* The output rules alone (the records t[PAKV_SCATTER_KEY_CACHE_OUT..] against their caches), for
 * outputs obtained after the inputs were validated (ORT's). */
int pakv_validate_scatter_outputs(const pakv_tensor t[PAKV_SCATTER_RECORDS], pakv_err* err);

/* One scatter validation handed over in one piece (as pakv_gather_call). */
typedef struct {
  pakv_scatter_plan plan;
  pakv_tensor records[PAKV_SCATTER_RECORDS];
  int32_t nz;
  int32_t reserved;
  int64_t scratch_len;
  int64_t* scratch;
  char* error;
} pakv_scatter_call;

/* The records of one PagedAttention call: the op's inputs, then its output (absent when a caller
 * lets the front allocate it; ORT's buffer, checked with pakv_validate_attention_output). */
enum {
  PAKV_ATTENTION_QUERY = 0,
  PAKV_ATTENTION_KEY_CACHE,
  PAKV_ATTENTION_VALUE_CACHE,
  PAKV_ATTENTION_BLOCK_TABLE,
  PAKV_ATTENTION_CU_SEQ_LENS,
  PAKV_ATTENTION_PAST_LENS,
  PAKV_ATTENTION_OUT,
  PAKV_ATTENTION_RECORDS
};
#define PAKV_ATTENTION_INPUTS 6

/* Entries of int64 scratch an attention's plan needs: 3 x B (query starts, new tokens, contexts). */
int64_t pakv_attention_scratch_len(const pakv_tensor t[PAKV_ATTENTION_RECORDS]);

/* Validate a PagedAttention and fill `plan` (per-sequence arrays in `scratch`, which must outlive
 * it). `scale` is the attribute (0: 1 / sqrt(head_dim)). Rules, in order: query float32, float16 or
 * bfloat16 (TYPE), both caches of its dtype (TYPE); the caches as the gather's (Norm layout); query
 * [N, Hq, D] on the caches' device with key_cache's D, Hk >= 1 kv heads in both caches, Hq a
 * multiple of Hk, each token row-major (any token stride); block_table [B, cols],
 * cumulative_sequence_lengths [B+1], past_sequence_lengths [B], int32/int64 (TYPE), host-readable;
 * scale finite; cumulative_sequence_lengths starts at 0, never decreases and ends at N;
 * past_sequence_lengths >= 0 and past + new within int64; every sequence with new tokens has a
 * table row of ceil((past + new) / block_size) columns whose ids are in [0, num_blocks) (others are
 * not read, and unread entries may hold anything); N x Hq x Dv bytes fit int64; a present output
 * [N, Hq, Dv] of query's dtype and device, contiguous, overlapping no input. */
int pakv_validate_attention(const pakv_tensor t[PAKV_ATTENTION_RECORDS], float scale, pakv_attention_plan* plan,
                            int64_t* scratch, int64_t scratch_len, pakv_err* err);

/* The output rule alone (t[PAKV_ATTENTION_OUT] against the plan), for an output obtained after planning. */
int pakv_validate_attention_output(const pakv_tensor t[PAKV_ATTENTION_RECORDS], const pakv_attention_plan* plan,
                                   pakv_err* err);

/* One attention validation handed over in one piece (as pakv_gather_call). */
typedef struct {
  pakv_attention_plan plan;
  pakv_tensor records[PAKV_ATTENTION_RECORDS];
  float scale;
  int32_t reserved;
  int64_t scratch_len;
  int64_t* scratch;
  char* error;
} pakv_attention_call;

/* A dense record of `ndim` dims (strides row-major), for tensors that are dense by construction. */
void pakv_dense_record(pakv_tensor* t, const void* data, int elem_type, int ndim, const int64_t* dims,
                       const char* device);

#endif /* PAKV_CONTRACT_H */
