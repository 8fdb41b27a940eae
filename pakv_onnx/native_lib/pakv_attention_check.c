/* The attention core's view of a plan (pakv_core.h: pakv_attention_plan): the types and features it
 * computes, and every extent it reads and writes, checked with int64 overflow checks. A plan this
 * accepts is memory-safe to run (pakv_attention.c); any other is refused with a message naming the
 * field and value. The ops' validators (pakv_contract_attention.c, the fused op's) make the plans and
 * call this last. */
#include <string.h>

#include "pakv_attention_core.h"
#include "pakv_float.h"

static int is_float_type(int32_t t) { return t == ONNX_FLOAT || t == ONNX_FLOAT16 || t == ONNX_BFLOAT16; }
static int is_quantized_type(int32_t t) { return t == ONNX_INT8 || t == ONNX_FLOAT8E4M3FN; }

/* A cache's element type and quantization: a float type is read as is (PAKV_QUANT_NONE); int8 and
 * float8e4m3fn are stored elements times a scale (PER_TENSOR: scale[0]; PER_CHANNEL: one per kv head
 * and channel, `channels` of them, that count checked for overflow). */
static int check_cache_type(const char* name, int32_t type, int32_t quant, const float* scale, int64_t channels,
                            pakv_err* err) {
  if (!is_float_type(type) && !is_quantized_type(type))
    return pakv_fail_type(err,
                          "attention plan: %s type %d is not one the attention core reads (float32 1, float16 10, "
                          "bfloat16 16, int8 3, float8e4m3fn 17)",
                          name, type);
  if (is_float_type(type) ? quant != PAKV_QUANT_NONE : quant != PAKV_QUANT_PER_TENSOR && quant != PAKV_QUANT_PER_CHANNEL)
    return pakv_fail_type(err,
                          "attention plan: %s of type %d has quantization %d: float types take none (%d), int8 and "
                          "float8e4m3fn per-tensor (%d) or per-channel (%d) scales",
                          name, type, quant, PAKV_QUANT_NONE, PAKV_QUANT_PER_TENSOR, PAKV_QUANT_PER_CHANNEL);
  if (quant != PAKV_QUANT_NONE && !scale)
    return pakv_fail(err, "attention plan: %s is quantized (mode %d) but its scale is NULL", name, quant);
  if (quant == PAKV_QUANT_PER_CHANNEL && channels < 0)
    return pakv_fail(err, "attention plan: %s's per-channel scales (kv heads x channels) overflow int64", name);
  return 0;
}

/* Bytes [0, extent) one cache's reads span (block, position, kv head, elements), or -1 on overflow
 * or a negative stride. */
static int64_t cache_extent(const pakv_attention_plan* p, int64_t block_stride, int64_t row_stride,
                            int64_t head_stride, int64_t dim, int32_t type) {
  int64_t span = 0, term;
  if (block_stride < 0 || row_stride < 0 || head_stride < 0) return -1;
  if (p->num_blocks == 0 || dim == 0) return 0;
  if (pakv_mul(block_stride, p->num_blocks - 1, &span) || pakv_mul(row_stride, p->block_size - 1, &term) ||
      pakv_add(span, term, &span) || pakv_mul(head_stride, p->num_kv_heads - 1, &term) || pakv_add(span, term, &span) ||
      pakv_mul(dim, item_size(type), &term) || pakv_add(span, term, &span))
    return -1;
  return span;
}

static int check_types(const pakv_attention_plan* p, pakv_err* err) {
  int64_t key_channels = -1, value_channels = -1;
  if (!is_float_type(p->query_type) || !is_float_type(p->out_type))
    return pakv_fail_type(err,
                          "attention plan: query type %d / output type %d: each must be float32 (1), float16 (10) or "
                          "bfloat16 (16)",
                          p->query_type, p->out_type);
  if (p->num_kv_heads >= 0 && p->head_dim >= 0 && pakv_mul(p->num_kv_heads, p->head_dim, &key_channels))
    key_channels = -1;
  if (p->num_kv_heads >= 0 && p->value_head_dim >= 0 && pakv_mul(p->num_kv_heads, p->value_head_dim, &value_channels))
    value_channels = -1;
  if (p->dequantized_type != 0 && p->dequantized_type != ONNX_FLOAT16 && p->dequantized_type != ONNX_BFLOAT16)
    return pakv_fail_type(err,
                          "attention plan: dequantized_type %d: 0 (dequantized elements exact), float16 (10) or "
                          "bfloat16 (16)",
                          p->dequantized_type);
  return check_cache_type("key_cache", p->key_type, p->key_quant, p->key_scale, key_channels, err) ||
         check_cache_type("value_cache", p->value_type, p->value_quant, p->value_scale, value_channels, err);
}

/* The scores' scale, softcap, window and causal flag. */
static int check_features(const pakv_attention_plan* p, pakv_err* err) {
  if (!(p->scale > -3.4e38f && p->scale < 3.4e38f))
    return pakv_fail(err, "attention plan: scale must be finite, got %.9g", (double)p->scale);
  if (!(p->softcap >= 0.0f && p->softcap < 3.4e38f))
    return pakv_fail(err, "attention plan: softcap must be finite and >= 0 (0: off), got %.9g", (double)p->softcap);
  if (p->window < -1)
    return pakv_fail(err, "attention plan: window must be >= 0 (positions seen back) or -1 (off), got %lld",
                     (long long)p->window);
  if (p->causal != 0 && p->causal != 1)
    return pakv_fail(err, "attention plan: causal must be 0 or 1, got %d", p->causal);
  return 0;
}

static int check_sizes(const pakv_attention_plan* p, pakv_err* err) {
  if (p->block_size < 1 || p->num_blocks < 0 || p->num_heads < 0 || p->num_kv_heads < 1 || p->head_dim < 0 ||
      p->value_head_dim < 0 || p->num_tokens < 0 || p->num_seqs < 0 || p->table_cols < 0 ||
      p->num_heads % p->num_kv_heads)
    return pakv_fail(err,
                     "attention plan: sizes out of range (block_size %lld, num_blocks %lld, heads %lld / %lld, "
                     "dims %lld / %lld, tokens %lld, sequences %lld, columns %lld)",
                     (long long)p->block_size, (long long)p->num_blocks, (long long)p->num_heads,
                     (long long)p->num_kv_heads, (long long)p->head_dim, (long long)p->value_head_dim,
                     (long long)p->num_tokens, (long long)p->num_seqs, (long long)p->table_cols);
  return 0;
}

/* The caches, the query rows, the output and the block table fit int64 byte offsets. */
static int check_extents(const pakv_attention_plan* p, pakv_err* err) {
  if (cache_extent(p, p->key_block_stride, p->key_row_stride, p->key_head_stride, p->head_dim, p->key_type) < 0 ||
      cache_extent(p, p->value_block_stride, p->value_row_stride, p->value_head_stride, p->value_head_dim,
                   p->value_type) < 0)
    return pakv_fail(err, "attention plan: a cache's %lld blocks overflow int64 byte offsets (or a negative stride)",
                     (long long)p->num_blocks);
  int64_t row, span, out_bytes;
  if (p->query_token_stride < 0 || p->query_head_stride < 0 ||
      pakv_mul(p->num_heads - (p->num_heads > 0), p->query_head_stride, &row) ||
      pakv_mul(p->head_dim, item_size(p->query_type), &span) || pakv_add(row, span, &row) ||
      (p->num_tokens > 0 && (pakv_mul(p->num_tokens - 1, p->query_token_stride, &span) || pakv_add(span, row, &span))))
    return pakv_fail(err, "attention plan: the query's %lld rows overflow int64 byte offsets", (long long)p->num_tokens);
  if (pakv_mul(p->num_tokens, p->num_heads, &out_bytes) || pakv_mul(out_bytes, p->value_head_dim, &out_bytes) ||
      pakv_mul(out_bytes, item_size(p->out_type), &out_bytes))
    return pakv_fail(err, "attention plan: the output of %lld rows overflows int64 byte offsets",
                     (long long)p->num_tokens);
  int64_t rows_extent, cols_extent;
  if (p->table_row_stride < 0 || p->table_col_stride < 0 ||
      (p->num_seqs > 0 && p->table_cols > 0 &&
       (pakv_mul(p->num_seqs - 1, p->table_row_stride, &rows_extent) ||
        pakv_mul(p->table_cols - 1, p->table_col_stride, &cols_extent) ||
        pakv_add(rows_extent, cols_extent, &rows_extent))))
    return pakv_fail(err, "attention plan: a block table of %lld x %lld entries overflows int64 offsets",
                     (long long)p->num_seqs, (long long)p->table_cols);
  return 0;
}

/* Each sequence's query rows and context, and every block id it will read: the columns from the
 * block of the first position its first new token sees (a window leaves earlier ones unread: their
 * entries may hold anything) to the one of its context's last position. */
static int check_sequences(const pakv_attention_plan* p, int* any, pakv_err* err) {
  if (p->num_seqs > 0 && (!p->query_starts || !p->query_counts || !p->context_lens))
    return pakv_fail(err, "attention plan: a NULL per-sequence array for %lld sequences", (long long)p->num_seqs);
  for (int64_t b = 0; b < p->num_seqs; b++) {
    int64_t start = p->query_starts[b], n = p->query_counts[b], length = p->context_lens[b], lo, hi;
    if (n < 0 || start < 0 || start > p->num_tokens || n > p->num_tokens - start || length < n)
      return pakv_fail(err, "attention plan: sequence %lld has query rows [%lld, +%lld) of %lld and a context of %lld",
                       (long long)b, (long long)start, (long long)n, (long long)p->num_tokens, (long long)length);
    if (n == 0) continue;
    *any = 1;
    pakv_visible(p, b, 0, &lo, &hi);
    int64_t need = length / p->block_size + (length % p->block_size != 0);
    if (need > p->table_cols || !p->block_tables)
      return pakv_fail(err, "attention plan: sequence %lld reads %lld block-table columns of %lld", (long long)b,
                       (long long)need, (long long)p->table_cols);
    for (int64_t c = lo / p->block_size; c < need; c++) {
      int64_t block = pakv_table_entry(p, b, c);
      if (block < 0 || block >= p->num_blocks)
        return pakv_fail(err,
                         "attention plan: block_tables changed after validation (or the plan is not the "
                         "validator's): entry (%lld, %lld) = %lld is outside [0, %lld)",
                         (long long)b, (long long)c, (long long)block, (long long)p->num_blocks);
    }
  }
  return 0;
}

int pakv_check_attention_plan(const pakv_attention_plan* p, pakv_err* err) {
  if (!p) return pakv_fail(err, "NULL attention plan");
  if (p->abi_version != PAKV_ABI_VERSION || p->struct_size != sizeof(pakv_attention_plan))
    return pakv_fail(err, "attention plan ABI mismatch: caller has version %u / %u bytes, library has %d / %zu bytes",
                     p->abi_version, p->struct_size, PAKV_ABI_VERSION, sizeof(pakv_attention_plan));
  int any = 0;
  if (check_types(p, err) || check_features(p, err) || check_sizes(p, err) || check_extents(p, err) ||
      check_sequences(p, &any, err))
    return -1;
  if (any && p->num_heads > 0 && (!p->query || !p->key_cache || !p->value_cache))
    return pakv_fail(err, "attention plan: a NULL input pointer for a non-empty attention");
  return 0;
}
