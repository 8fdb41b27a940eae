/* The copy core of GatherPaKvCache: no ONNX Runtime, no Python.
 *
 * A pakv_plan describes one gather in bytes: where each cache's blocks are (base + block stride),
 * how many bytes one output row (token) has per cache, the outputs, and the per-sequence index
 * arrays. pakv_check_plan validates everything the copy reads (memory safety, checked arithmetic);
 * pakv_run_plan does one memcpy per contiguous (sequence, block) run, on threads for big copies.
 *
 *   Norm : cache block = [bs, H, D]        row = H*D*itemsize, token (b, s) at b*stride + s*row
 *   PA_NZ: cache block = [H*D/E, bs, E]    row = H*D*itemsize, fractal f of token (b, s) is 32 bytes
 *                                          at b*stride + (f*bs + s)*32   (E*itemsize = 32)
 *
 * The struct is the library's ABI with Python (pakv_onnx/native_lib/__init__.py mirrors it as a
 * ctypes.Structure and checks PAKV_ABI_VERSION and sizeof(pakv_plan) when it loads the library).
 * Bump PAKV_ABI_VERSION whenever the struct or an exported signature changes.
 */
#ifndef PAKV_CORE_H
#define PAKV_CORE_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define PAKV_EXPORT __attribute__((visibility("default")))
#else
#define PAKV_EXPORT
#endif

#define PAKV_ABI_VERSION 7
#define PAKV_ERR_LEN 1024
#define PAKV_NZ_FRACTAL_BYTES 32
#define PAKV_LAYOUT_NORM 0
#define PAKV_LAYOUT_NZ 1

/* Error kinds: what a Python caller raises (ValueError / TypeError); an ORT status says it too. */
#define PAKV_ERR_VALUE 1
#define PAKV_ERR_TYPE 2

typedef struct {
  int kind; /* PAKV_ERR_VALUE or PAKV_ERR_TYPE */
  char msg[PAKV_ERR_LEN];
} pakv_err;

typedef struct pakv_plan {
  uint32_t abi_version; /* PAKV_ABI_VERSION */
  uint32_t struct_size; /* sizeof(pakv_plan) as the caller compiled it */
  int32_t layout;       /* PAKV_LAYOUT_NORM / PAKV_LAYOUT_NZ */
  int32_t tables64;     /* block_tables elements: 1 = int64, 0 = int32 */
  int64_t num_blocks;
  int64_t block_size;
  const void* key_cache;
  const void* value_cache;
  int64_t key_block_stride;   /* bytes from one block to the next, >= 0 (a pool view may leave gaps;
                                 an expanded pool's blocks may overlap: stride 0 reads one block) */
  int64_t value_block_stride;
  int64_t key_row_bytes;      /* bytes of one output row (token) of each output */
  int64_t value_row_bytes;
  void* key_out;              /* [num_tokens, key_row_bytes] dense */
  void* value_out;
  int64_t num_seqs;           /* Q */
  int64_t table_cols;         /* block_tables is [Q, table_cols] */
  const void* block_tables;   /* entry (q, c) at block_tables + q*table_row_stride + c*table_col_stride */
  int64_t table_row_stride;   /* bytes */
  int64_t table_col_stride;   /* bytes */
  const int64_t* seq_lengths; /* [Q] tokens of each sequence */
  const int64_t* out_starts;  /* [Q] first output row of each sequence */
  const int64_t* col_starts;  /* [Q] first block-table column of each sequence (seq_offset // bs) */
  int64_t num_tokens;         /* T */
  /* The outputs' shapes (the contract's, for the caller that allocates them; the copy reads
   * only num_tokens and the row bytes): Norm [T, H, D] (rank 3), PA_NZ [T, H*D] (rank 2). */
  int32_t out_rank;
  int32_t reserved;
  int64_t key_out_dims[3];
  int64_t value_out_dims[3];
} pakv_plan;

/* One ScatterPaKvCache in bytes: token t of `key` / `value` (rows of key_row_bytes / value_row_bytes
 * at t * token stride) goes to slot s = slot_mapping[t] of its cache: block s / block_size, row
 * s % block_size (PA_NZ: its 32-byte fractals f at block*stride + (f*bs + row)*32). A negative slot
 * is padding and skipped. Made by pakv_validate_scatter (pakv_contract_scatter.c). */
typedef struct pakv_scatter_plan {
  uint32_t abi_version; /* PAKV_ABI_VERSION */
  uint32_t struct_size; /* sizeof(pakv_scatter_plan) */
  int32_t layout;       /* PAKV_LAYOUT_NORM / PAKV_LAYOUT_NZ */
  int32_t slots64;      /* slot_mapping elements: 1 = int64, 0 = int32 */
  int64_t num_blocks;
  int64_t block_size;
  void* key_cache;      /* written in place */
  void* value_cache;
  int64_t key_block_stride; /* bytes, >= 0 */
  int64_t value_block_stride;
  int64_t key_row_bytes;    /* bytes of one token row of each cache */
  int64_t value_row_bytes;
  const void* key;          /* [T] rows of key_row_bytes, token t at key + t * key_token_stride */
  const void* value;
  int64_t key_token_stride; /* bytes */
  int64_t value_token_stride;
  int64_t num_tokens;       /* T */
  const void* slot_mapping; /* [T], entry t at slot_mapping + t * slot_stride */
  int64_t slot_stride;      /* bytes */
} pakv_scatter_plan;

/* How a cache's stored elements become the values attention uses: element x scale (symmetric). */
#define PAKV_QUANT_NONE 0        /* the element is the value (float32, float16, bfloat16 caches) */
#define PAKV_QUANT_PER_TENSOR 1  /* one scale: scale[0] */
#define PAKV_QUANT_PER_CHANNEL 2 /* one scale per (kv head, channel): scale[h * head_dim + d] */

/* One paged attention in bytes (pakv_attention.c runs it), for pakv::PagedAttention and for
 * com.microsoft::PagedAttention (whose rotary, norms and cache write run before it, so its query is
 * the prepared fp32 rows). Sequence b's n = query_counts[b] new tokens are query rows
 * [query_starts[b], +n) at positions L - n .. L - 1 of its context (L = context_lens[b]).
 *
 * What new token j (position p = L - n + j) of sequence b, query head h, attends to: positions
 * [lo, hi] with hi = p when causal (else L - 1) and lo = max(0, p - window) when window >= 0 (else 0),
 * read in place: kv head g = h / (Hq / Hk) (GQA) of position q is head_dim elements at
 *   key_cache + block_tables[b, q / bs] * key_block_stride + (q % bs) * key_row_stride + g * key_head_stride
 * (value_cache likewise, value_head_dim elements; LATENT: value_cache is key_cache, its rows and
 * strides, and V is each row's leading value_head_dim channels). A stored element e of a quantized
 * cache is the value e x scale (PAKV_QUANT_*). Scores s = scale * q . k, then softcap * tanh(s /
 * softcap) when softcap > 0; softmax over the visible positions plus, with head_sink, one more logit
 * head_sink[h] that has no value; out[token, h] = sum of weights x v, fp32 throughout, written as
 * out_type into `out`, [N, Hq, value_head_dim] dense. Made by a contract unit's validator
 * (pakv_contract_attention.c for pakv::PagedAttention).
 *
 * Non-finite scores (after softcap, which maps +-inf to +-softcap): positions a token does not see
 * are never read (nor their block-table entries: a window leaves the columns before the first new
 * token's window unread); a -inf score weighs exactly 0 and its value row is not multiplied in; a
 * NaN or +inf score, or sink, makes the row NaN; a row whose every score is -inf is NaN, or 0 when
 * a finite sink gives the denominator (a -inf sink is no sink).
 *
 * Dequantized elements: with dequantized_type 0 a quantized element's value e x scale is exact (the
 * scales are folded into the query and the finished row). With dequantized_type float16 or bfloat16
 * each element of a quantized cache is first dequantized as fp32 e x scale and rounded to that type
 * (nearest even), as ORT's CUDA com.microsoft::PagedAttention does for T float16 / bfloat16 (its
 * validator sets it so: pakv_contract_fused_values.c); float caches are unaffected. */
typedef struct pakv_attention_plan {
  uint32_t abi_version; /* PAKV_ABI_VERSION */
  uint32_t struct_size; /* sizeof(pakv_attention_plan) */
  int32_t query_type;   /* ONNX type of query rows: 1 float32, 10 float16, 16 bfloat16 */
  int32_t out_type;     /* ONNX type of out: 1 float32, 10 float16, 16 bfloat16 */
  int32_t tables64;     /* block_tables elements: 1 = int64, 0 = int32 */
  int32_t causal;       /* 1: position p sees up to p; 0: every position of its context */
  int64_t num_blocks;
  int64_t block_size;
  const void* key_cache;
  const void* value_cache;
  int32_t key_type;   /* ONNX type of key_cache's elements: 1, 10, 16, 3 int8, 17 float8e4m3fn */
  int32_t value_type; /* value_cache's, likewise */
  int32_t key_quant;  /* PAKV_QUANT_*: NONE for the float types, PER_TENSOR or PER_CHANNEL for int8 / fp8 */
  int32_t value_quant;
  const float* key_scale; /* [1] (PER_TENSOR) or [num_kv_heads * head_dim] (PER_CHANNEL); NULL for NONE */
  const float* value_scale; /* [1] or [num_kv_heads * value_head_dim]; NULL for NONE */
  int64_t key_block_stride; /* bytes, >= 0 */
  int64_t value_block_stride;
  int64_t key_row_stride;   /* bytes from one position of a block to the next */
  int64_t value_row_stride;
  int64_t key_head_stride;  /* bytes from one kv head of a position to the next */
  int64_t value_head_stride;
  int64_t num_heads;      /* Hq */
  int64_t num_kv_heads;   /* Hk: Hq is a multiple of it */
  int64_t head_dim;       /* D of query and key_cache */
  int64_t value_head_dim; /* Dv of value_cache and out */
  const void* query;
  int64_t query_token_stride; /* bytes */
  int64_t query_head_stride;  /* bytes */
  void* out;
  int64_t num_tokens; /* N */
  int64_t num_seqs;   /* B */
  int64_t table_cols;
  const void* block_tables; /* entry (b, c) at block_tables + b*table_row_stride + c*table_col_stride */
  int64_t table_row_stride; /* bytes */
  int64_t table_col_stride;
  const int64_t* query_starts; /* [B] */
  const int64_t* query_counts; /* [B] */
  const int64_t* context_lens; /* [B] past + new */
  float scale;                 /* the scores' scale (the validator resolved 0 to 1 / sqrt(D)) */
  float softcap;               /* > 0: scores capped by softcap * tanh(s / softcap); 0: off */
  int64_t window;              /* >= 0: position p sees positions >= p - window only; -1: off */
  const float* head_sink;      /* [num_heads] fp32 logits with no value, or NULL */
  int32_t dequantized_type;    /* 0, or 10 float16 / 16 bfloat16: see "Dequantized elements" above */
  int32_t reserved;            /* 0 */
} pakv_attention_plan;

/* Checked int64 arithmetic: 0 on success, -1 on overflow (then *out is unspecified). */
static inline int pakv_mul(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out) ? -1 : 0; }
static inline int pakv_add(int64_t a, int64_t b, int64_t* out) { return __builtin_add_overflow(a, b, out) ? -1 : 0; }

/* Set err (kind PAKV_ERR_VALUE / PAKV_ERR_TYPE) and return -1. */
int pakv_fail(pakv_err* err, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
int pakv_fail_type(pakv_err* err, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

/* Every check the copy needs to stay inside the caches, the tables and the outputs. */
int pakv_check_plan(const pakv_plan* p, pakv_err* err);

/* What keeps a scatter memory-safe (the extents it writes and reads), and the scatter itself:
 * slots are bounds-checked again where they are read (a caller may change slot_mapping while
 * it runs); a slot that became invalid is an error, never a wild write. The scatter first asks
 * whether its caches can be written (pakv_check_scatter_writable): a read-only pool is an error
 * with nothing written, never a signal. */
int pakv_check_scatter_plan(const pakv_scatter_plan* p, pakv_err* err);
int pakv_run_scatter(const pakv_scatter_plan* p, pakv_err* err);

/* Entry t of a scatter plan's slot_mapping, read once (volatile: a caller may be writing it). */
static inline int64_t pakv_slot_entry(const pakv_scatter_plan* p, int64_t t) {
  const char* at = (const char*)p->slot_mapping + t * p->slot_stride;
  if (p->slots64) return *(const volatile int64_t*)at;
  return (int64_t) * (const volatile int32_t*)at;
}

/* Writability, asked of the kernel (pakv_writable.c): never a signal. pakv_first_unwritable: the first of
 * addrs[0..n) whose byte cannot be written (n: all can; -1: the kernel would not say). The checks: 0, or -1
 * with err naming the buffer; "would not say" passes. A checked scatter plan: the lowest and highest byte it
 * writes in each cache (key_name / value_name in the message). A buffer: its first and last byte. */
int64_t pakv_first_unwritable(void* const* addrs, int64_t n);
/* The spans [lo[i], hi[i]] (lo[i] NULL: none) a write op writes, n <= PAKV_MAX_SPANS: each span's first and
 * last byte probed (one probe when both share a page); the message names names[i] of the first that fails. */
#define PAKV_MAX_SPANS 4
int pakv_check_spans_writable(char* const* lo, char* const* hi, const char* const* names, int n, pakv_err* err);
int pakv_check_scatter_writable(const pakv_scatter_plan* p, const char* key_name, const char* value_name,
                                pakv_err* err);
int pakv_check_buffer_writable(void* data, int64_t bytes, const char* name, pakv_err* err);

/* Run a checked plan. Block ids are bounds-checked again where they are read (a caller may change
 * block_tables while the copy runs); an id that became invalid is an error, never a wild read.
 * Large copies are split over the library's own threads (PAKV_ONNX_NUM_THREADS, default 2). */
int pakv_run_plan(const pakv_plan* p, pakv_err* err);

/* A caller's parallel-for (ONNX Runtime's intra-op pool): run(host, fn, parts, data) calls
 * fn(data, i) for every i in [0, parts), on any threads, and returns when all are done; 0, or
 * nonzero if it ran none of them (the copy then runs on the calling thread). */
typedef struct pakv_parallel {
  int (*run)(void* host, void (*fn)(void*, size_t), size_t parts, void* data);
  void* host;
} pakv_parallel;

/* pakv_run_plan with large copies split over `par` instead (NULL: the library's own threads).
 * Copies under PAKV_ONNX_PARALLEL_MIN_BYTES (default 4 MiB) never enter a parallel region. */
int pakv_run_plan_on(const pakv_plan* p, const pakv_parallel* par, pakv_err* err);

/* One contiguous run of a plan: n tokens of one sequence read from block `block`, slots
 * [slot, slot + n), written to output rows [out_row, out_row + n). Return nonzero to stop. */
typedef int (*pakv_run_fn)(void* ctx, int64_t block, int64_t slot, int64_t n, int64_t out_row);

/* Call fn for every run of a checked plan that covers output rows [lo, hi), in output order.
 * Block ids are read and bounds-checked here; an id outside [0, num_blocks) (block_tables changed
 * since the check) is skipped and counted in *bad. Returns 0, or fn's nonzero result. */
int pakv_for_each_run(const pakv_plan* p, int64_t lo, int64_t hi, pakv_run_fn fn, void* ctx, int64_t* bad);

/* The message of a run that skipped block ids (pakv_for_each_run's *bad > 0); returns -1. */
int pakv_fail_changed_tables(const pakv_plan* p, pakv_err* err);

/* What keeps an attention plan memory-safe (every extent it reads and writes, every block id it
 * will read, now), and the attention itself (block ids checked again where they are read: one
 * that became invalid is an error, never a wild read), on `par` (ORT's pool: a part per (sequence,
 * kv head, query tile)) or, with par NULL, on the calling thread. */
int pakv_check_attention_plan(const pakv_attention_plan* p, pakv_err* err);
int pakv_run_attention_on(const pakv_attention_plan* p, const pakv_parallel* par, pakv_err* err);

#endif /* PAKV_CORE_H */
