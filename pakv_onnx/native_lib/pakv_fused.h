/* com.microsoft::PagedAttention, ONNX Runtime's own fused paged-attention contract (bert_defs.cc,
 * opset 1), served on the CPU: the records of one call, its attributes as a node gives them, and
 * the plan the validator (pakv_contract_fused*.c) makes of them for the prologue and attention
 * cores (pakv_fused.c, then pakv_attention.c). docs/ort-paged-attention.md says what each input
 * means and where ORT's sources say so.
 *
 * One call: the prologue writes each new token's key and value into its slot of the caches
 * (q/k RMSNorm, then rotary at position past + j, then quantization for int8 / float8 caches),
 * prepares the query rows (the same norm and rotary), then the attention core reads the updated
 * caches through the block table, exactly as pakv::PagedAttention does.
 */
#ifndef PAKV_FUSED_H
#define PAKV_FUSED_H

#include <stddef.h>
#include <stdint.h>

#include "pakv_contract.h"
#include "pakv_core.h"

/* The records of one call: ORT's 17 inputs in the schema's order, then its 3 outputs (an absent
 * optional input or output has present = 0). */
enum {
  PAKV_FUSED_QUERY = 0,
  PAKV_FUSED_KEY,
  PAKV_FUSED_VALUE,
  PAKV_FUSED_KEY_CACHE,
  PAKV_FUSED_VALUE_CACHE,
  PAKV_FUSED_CU_SEQLENS,
  PAKV_FUSED_PAST_SEQLENS,
  PAKV_FUSED_BLOCK_TABLE,
  PAKV_FUSED_COS_CACHE,
  PAKV_FUSED_SIN_CACHE,
  PAKV_FUSED_SLOT_MAPPING,
  PAKV_FUSED_HEAD_SINK,
  PAKV_FUSED_Q_NORM_WEIGHT,
  PAKV_FUSED_K_NORM_WEIGHT,
  PAKV_FUSED_K_SCALE,
  PAKV_FUSED_V_SCALE,
  PAKV_FUSED_ATTENTION_METADATA,
  PAKV_FUSED_OUTPUT,
  PAKV_FUSED_KEY_CACHE_OUT,
  PAKV_FUSED_VALUE_CACHE_OUT,
  PAKV_FUSED_RECORDS
};
#define PAKV_FUSED_INPUTS 17

/* ONNX element types the op's tensors have (TensorProto.DataType). */
enum {
  PAKV_ONNX_FLOAT32 = 1,
  PAKV_ONNX_UINT8 = 2,
  PAKV_ONNX_INT8 = 3,
  PAKV_ONNX_FLOAT16 = 10,
  PAKV_ONNX_BFLOAT16 = 16,
  PAKV_ONNX_FLOAT8E4M3FN = 17
};
#define PAKV_FUSED_OUTPUTS 3
/* The records' names: ORT's input and output names (pakv_contract_fused.c). */
extern const char* const PAKV_FUSED_NAMES[PAKV_FUSED_RECORDS];

#define PAKV_FUSED_STRING_LEN 32 /* longer attribute strings are cut (they match no allowed value) */
/* pakv_fused_attributes.given: which required attributes the node has. */
#define PAKV_FUSED_HAS_NUM_HEADS 1
#define PAKV_FUSED_HAS_KV_NUM_HEADS 2

/* The node's attributes as given (absent ones hold their defaults, pakv_fused_default_attributes);
 * pakv_check_fused_attributes says whether they are valid. Names and defaults are ORT's schema's. */
typedef struct {
  int64_t num_heads;         /* required, >= 1 */
  int64_t kv_num_heads;      /* required, >= 1, divides num_heads */
  int64_t local_window_size; /* -1 (or 0): off; W > 0: position p sees p - W + 1 .. p */
  int64_t is_causal;         /* 1 (default) or 0 */
  int64_t do_rotary;         /* 0 (default) or 1 */
  int64_t rotary_interleaved;
  int64_t v_head_size;       /* 0: head_size */
  int64_t rotary_offset;     /* a multiple of 8 */
  float scale;               /* 0: 1 / sqrt(head_size) */
  float softcap;             /* 0: off */
  float qk_norm_epsilon;     /* 1e-6 */
  int32_t given;             /* PAKV_FUSED_HAS_* */
  char k_quant_type[PAKV_FUSED_STRING_LEN]; /* "NONE", "PER_TENSOR", "PER_CHANNEL" */
  char v_quant_type[PAKV_FUSED_STRING_LEN];
  char k_cache_dtype[PAKV_FUSED_STRING_LEN]; /* "" or the cache's own type's name */
  char v_cache_dtype[PAKV_FUSED_STRING_LEN];
  char kv_cache_layout[PAKV_FUSED_STRING_LEN]; /* "SEPARATE" or "LATENT" */
} pakv_fused_attributes;

/* One call in bytes, for the prologue (pakv_fused.c) and, in `attention`, the attention core.
 * Token t of sequence b (its j-th new token) is at position positions[t] = past_seqlens[b] + j;
 * its key (and value) rows go to slot slots[t] (block slot / block_size, row slot % block_size)
 * unless slots[t] < 0. A row of head h of token t of query / key / value is head_dim elements of
 * query_type at base + t * token_stride + h * head_dim * itemsize. */
typedef struct pakv_fused_plan {
  uint32_t abi_version; /* PAKV_ABI_VERSION */
  uint32_t struct_size; /* sizeof(pakv_fused_plan) */
  int32_t query_type;   /* ONNX type T of query, key, value, cos/sin, norm weights, head_sink, output */
  int32_t cache_type;   /* ONNX type of both caches: T, int8 (3) or float8e4m3fn (17) */
  int32_t key_quant;    /* PAKV_QUANT_* of key_cache */
  int32_t value_quant;
  int32_t latent;       /* 1: one cache, no value rows written (V is the keys' leading channels) */
  int32_t normalize;    /* 1: RMSNorm of each q / k head with the norm weights, before rotary */
  int32_t rotary_interleaved;
  int32_t prepare_query; /* 1 (norm or rotary): the prologue writes query_rows, which attention reads */
  int64_t num_tokens;    /* N */
  int64_t num_heads;     /* Hq */
  int64_t num_kv_heads;  /* Hk */
  int64_t head_dim;      /* D of query, key and the caches */
  const void* query;
  int64_t query_token_stride; /* bytes */
  const void* key;
  int64_t key_token_stride;
  const void* value;          /* NULL for LATENT */
  int64_t value_token_stride;
  const void* q_norm_weight;  /* [D] of T, dense; NULL without norm */
  const void* k_norm_weight;
  float epsilon;              /* the norm's, > 0 */
  int32_t reserved;
  const void* cos_cache;      /* [rotary_rows, rotary_dim / 2] of T, dense; NULL without rotary */
  const void* sin_cache;
  int64_t rotary_dim;         /* channels rotated: [rotary_offset, rotary_offset + rotary_dim); 0: none */
  int64_t rotary_offset;
  int64_t rotary_rows;        /* positions cos/sin cover */
  const float* key_scale;     /* [1] or [Hk * D] fp32 (the validator's copy); NULL for NONE */
  const float* value_scale;
  void* key_cache;            /* written in place: the input cache, or the output the caller copied it to */
  void* value_cache;          /* NULL for LATENT */
  int64_t num_blocks;
  int64_t block_size;
  int64_t key_block_stride;   /* bytes */
  int64_t value_block_stride;
  int64_t key_row_bytes;      /* bytes of one position of a block (Hk * D elements) */
  int64_t value_row_bytes;
  const int64_t* slots;       /* [N]: each token's slot, or -1 (not written) */
  const int64_t* positions;   /* [N] */
  void* query_rows;           /* [N, Hq, D] of query_type, dense: the caller's buffer when prepare_query */
  pakv_attention_plan attention; /* over the caches above; its query is query_rows or query */
} pakv_fused_plan;

/* One validation handed over in one piece (pakv_onnx/validator.py), as pakv_attention_call. */
typedef struct {
  pakv_fused_plan plan;
  pakv_tensor records[PAKV_FUSED_RECORDS];
  pakv_fused_attributes attributes;
  int64_t scratch_len;
  int64_t* scratch;
  char* error;
} pakv_fused_call;

/* Contract (pakv_contract_fused.c, pakv_contract_fused_values.c) ------------------------------- */
void pakv_fused_default_attributes(pakv_fused_attributes* a);
/* A string attribute of `length` bytes (text NULL: too long to read) into its field as the rules see it:
 * cut past PAKV_FUSED_STRING_LEN - 1 bytes, or, with a NUL byte inside, described instead. */
void pakv_fused_string(char* field, const char* text, size_t length);
int pakv_fused_latent(const pakv_fused_attributes* a); /* kv_cache_layout is 'LATENT' */
/* Every attribute rule (values, names, combinations the attributes alone decide). */
int pakv_check_fused_attributes(const pakv_fused_attributes* a, pakv_err* err);
/* int64 scratch entries a call's plan needs (read from the records' shapes), or -1 (overflow). */
int64_t pakv_fused_scratch_len(const pakv_tensor t[PAKV_FUSED_RECORDS]);
/* Validate a call and fill `plan` (its caches are the input caches; index arrays and scale copies in
 * `scratch`, which must outlive the plan). Present outputs are checked too. 0, or -1 with err. */
int pakv_validate_fused(const pakv_tensor t[PAKV_FUSED_RECORDS], const pakv_fused_attributes* a,
                        pakv_fused_plan* plan, int64_t* scratch, int64_t scratch_len, pakv_err* err);
/* Which cache outputs a call may have (the rule the node's declared outputs meet before any run). */
int pakv_fused_cache_outputs(int latent, int key_cache_out, int value_cache_out, pakv_err* err);
/* The output rules alone, for outputs obtained after planning (ORT's buffers). */
int pakv_validate_fused_outputs(const pakv_tensor t[PAKV_FUSED_RECORDS], const pakv_fused_plan* plan, pakv_err* err);
/* Bytes of the query rows buffer a plan needs (0 when it reads the query in place). */
int64_t pakv_fused_query_rows_bytes(const pakv_fused_plan* plan);
/* Point a validated plan at its buffers: the output, the query rows (when it needs them), and the
 * caches it writes and reads (the input caches, or the outputs they were copied to). */
void pakv_fused_bind(pakv_fused_plan* plan, void* out, void* query_rows, void* key_cache, void* value_cache);

/* Cores (pakv_fused.c) -------------------------------------------------------------------------- */
/* What keeps the plan memory-safe (every extent the prologue reads and writes, then the attention's). */
int pakv_check_fused_plan(const pakv_fused_plan* p, pakv_err* err);
/* The prologue on `par` (ORT's pool; NULL: this thread), then the attention. */
int pakv_run_fused_on(const pakv_fused_plan* p, const pakv_parallel* par, pakv_err* err);

#endif /* PAKV_FUSED_H */
