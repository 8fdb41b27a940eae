/* com.microsoft::PagedAttention's contract, part one: its attributes and every input's and output's
 * form (presence, element type, shape, layout), with their messages, once. The index values, slots,
 * scales and the plan are pakv_contract_fused_values.c; shared pieces pakv_contract_records.c.
 *
 * The rules follow ORT's paged_attention_helper.h (CheckInputs) and bert_defs.cc; where this CPU
 * kernel differs (float32 tensors, int64 index tensors, no GPU tiling limits, values checked on the
 * host) docs/ort-paged-attention.md says so. */
#include <stdio.h>
#include <string.h>

#include "pakv_contract_fused_internal.h"

const char* const PAKV_FUSED_NAMES[PAKV_FUSED_RECORDS] = {
    "query",       "key",          "value",         "key_cache",     "value_cache",
    "cumulative_sequence_length",  "past_seqlens",  "block_table",   "cos_cache",
    "sin_cache",   "slot_mapping", "head_sink",     "q_norm_weight", "k_norm_weight",
    "k_scale",     "v_scale",      "attention_metadata", "output",   "key_cache_out",
    "value_cache_out"};

void pakv_fused_default_attributes(pakv_fused_attributes* a) {
  memset(a, 0, sizeof(*a));
  a->local_window_size = -1;
  a->is_causal = 1;
  a->qk_norm_epsilon = 1e-6f;
  strcpy(a->k_quant_type, "NONE");
  strcpy(a->v_quant_type, "NONE");
  strcpy(a->kv_cache_layout, "SEPARATE");
}

/* ------------------------------------------------------------------------------------------- */
/* Attributes                                                                                  */
/* ------------------------------------------------------------------------------------------- */
static const char* const QUANT_NAMES[] = {"NONE", "PER_TENSOR", "PER_CHANNEL"}; /* = PAKV_QUANT_* */

int pakv_fused_quant(const char* value) {
  for (int i = 0; i < 3; i++)
    if (strcmp(value, QUANT_NAMES[i]) == 0) return i;
  return -1;
}

void pakv_fused_string(char* field, const char* text, size_t length) {
  const char* nul = text ? memchr(text, 0, length) : NULL;
  if (!text) /* too long to read: described (and refused: no allowed value is that long) */
    snprintf(field, PAKV_FUSED_STRING_LEN, "(a string of %llu bytes)", (unsigned long long)(length < 99999999 ? length : 99999999));
  else if (nul) /* "NONE\0X" is not "NONE": described, so the rule refuses it by name */
    snprintf(field, PAKV_FUSED_STRING_LEN, "(a NUL at byte %u)", (unsigned)(nul - text < 99999 ? nul - text : 99999));
  else {
    size_t kept = length < PAKV_FUSED_STRING_LEN ? length : PAKV_FUSED_STRING_LEN - 1; /* cut: matches nothing */
    memcpy(field, text, kept);
    field[kept] = 0;
  }
}

PAKV_EXPORT void pakv_fused_string_attribute(char* field, const char* text, size_t length) {
  pakv_fused_string(field, text, length);
}

int pakv_fused_latent(const pakv_fused_attributes* a) { return strcmp(a->kv_cache_layout, "LATENT") == 0; }

static int is_finite(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof(bits));
  return (bits & 0x7F800000u) != 0x7F800000u; /* not inf, not NaN */
}

static int flag(int64_t value, const char* name, pakv_err* err) {
  if (value == 0 || value == 1) return 0;
  return pakv_fail(err, "%s must be 0 (off) or 1 (on), got %lld", name, (long long)value);
}

/* k_cache_dtype / v_cache_dtype: "" or a cache type's ONNX name; the packed sub-byte ones refused by name. */
static int cache_dtype_name(const char* value, const char* name, pakv_err* err) {
  static const char* const known[] = {"", "float16", "bfloat16", "int8", "float8e4m3fn"};
  for (int i = 0; i < 5; i++)
    if (strcmp(value, known[i]) == 0) return 0;
  if (strcmp(value, "int4") == 0 || strcmp(value, "float4e2m1") == 0)
    return pakv_fail(err,
                     "%s '%s' (two values packed per byte in a uint8 cache) is not implemented by this CPU kernel",
                     name, value);
  return pakv_fail(err, "%s must be '' (the cache tensor's own element type), 'float16', 'bfloat16', 'int8' or "
                   "'float8e4m3fn', got '%.31s'", name, value);
}

int pakv_check_fused_attributes(const pakv_fused_attributes* a, pakv_err* err) {
  static const char* const heads[2] = {"num_heads", "kv_num_heads"};
  const int64_t counts[2] = {a->num_heads, a->kv_num_heads};
  for (int i = 0; i < 2; i++) {
    if (!(a->given & (i ? PAKV_FUSED_HAS_KV_NUM_HEADS : PAKV_FUSED_HAS_NUM_HEADS)))
      return pakv_fail(err, "%s must be given (an INT attribute >= 1)", heads[i]);
    if (counts[i] < 1) return pakv_fail(err, "%s must be at least 1, got %lld", heads[i], (long long)counts[i]);
  }
  if (a->num_heads % a->kv_num_heads)
    return pakv_fail(err, "num_heads (%lld) must be a multiple of kv_num_heads (%lld)", (long long)a->num_heads,
                     (long long)a->kv_num_heads);
  if (flag(a->is_causal, "is_causal", err) || flag(a->do_rotary, "do_rotary", err) ||
      flag(a->rotary_interleaved, "rotary_interleaved", err))
    return -1;
  if (a->local_window_size < -1)
    return pakv_fail(err, "local_window_size must be -1 or 0 (no window) or a window W >= 1 (position p sees p - W + 1 .. p), "
                     "got %lld", (long long)a->local_window_size);
  if (a->v_head_size < 0)
    return pakv_fail(err, "v_head_size must be 0 (head_size) or a width >= 1, got %lld", (long long)a->v_head_size);
  if (a->rotary_offset < 0 || a->rotary_offset % 8)
    return pakv_fail(err, "rotary_offset must be non-negative and a multiple of 8, got %lld", (long long)a->rotary_offset);
  if (!is_finite(a->scale))
    return pakv_fail(err, "scale must be a finite float (0: 1 / sqrt(head_size)), got %.9g", (double)a->scale);
  if (!is_finite(a->softcap) || a->softcap < 0.0f)
    return pakv_fail(err, "softcap must be a finite float >= 0 (0: off), got %.9g", (double)a->softcap);
  if (!is_finite(a->qk_norm_epsilon) || !(a->qk_norm_epsilon > 0.0f))
    return pakv_fail(err, "qk_norm_epsilon must be a positive finite float, got %.9g", (double)a->qk_norm_epsilon);
  if (pakv_fused_quant(a->k_quant_type) < 0)
    return pakv_fail(err, "k_quant_type must be 'NONE', 'PER_TENSOR' or 'PER_CHANNEL', got '%.31s'", a->k_quant_type);
  if (pakv_fused_quant(a->v_quant_type) < 0)
    return pakv_fail(err, "v_quant_type must be 'NONE', 'PER_TENSOR' or 'PER_CHANNEL', got '%.31s'", a->v_quant_type);
  if (cache_dtype_name(a->k_cache_dtype, "k_cache_dtype", err) || cache_dtype_name(a->v_cache_dtype, "v_cache_dtype", err))
    return -1;
  if (strcmp(a->kv_cache_layout, "SEPARATE") != 0 && strcmp(a->kv_cache_layout, "LATENT") != 0)
    return pakv_fail(err, "kv_cache_layout must be 'SEPARATE' or 'LATENT', got '%.31s'", a->kv_cache_layout);
  if (pakv_fused_latent(a)) {
    if (a->kv_num_heads != 1)
      return pakv_fail(err, "kv_num_heads must be 1 when kv_cache_layout is 'LATENT', got %lld",
                       (long long)a->kv_num_heads);
    if (strcmp(a->v_quant_type, "NONE") != 0 || a->v_cache_dtype[0])
      return pakv_fail(err, "v_quant_type and v_cache_dtype must be unset when kv_cache_layout is 'LATENT': the value "
                       "elements are the key elements, so k_quant_type and k_cache_dtype describe both");
  }
  return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* Inputs                                                                                      */
/* ------------------------------------------------------------------------------------------- */
int pakv_fused_is_quantized(int t) { return t == PAKV_ONNX_INT8 || t == PAKV_ONNX_FLOAT8E4M3FN; }

/* The refusal of a record whose shape is not `dims` (described by `form`); returns -1. */
static int wrong_shape(pakv_err* err, const char* name, const int64_t* dims, int rank, const char* form,
                       const pakv_tensor* t) {
  char want[160], got[160];
  return pakv_fail(err, "%s must be shaped %s (%s), not %s", name, pakv_format_list(dims, rank, want, sizeof(want)),
                   form, SHAPE(t, got));
}

/* Each row of a rank-2 record dense (any row stride: a column slice of a wider projection is fine). */
static int dense_rows(const pakv_tensor* t, const char* name, pakv_err* err) {
  char shape[160], strides[160];
  if (!pakv_has_elements(t) || t->dims[1] <= 1 || t->strides[1] == 1) return 0;
  return pakv_fail(err, "%s must be dense within each token (only dim 0 may be strided); got strides %s for shape %s",
                   name, STRIDES(t, strides), SHAPE(t, shape));
}

/* A whole record dense (row-major, no gaps) and readable on the host. */
static int dense_on_host(const pakv_tensor* t, const char* name, pakv_err* err) {
  char shape[160], strides[160];
  int64_t expected = 1;
  for (int32_t d = t->ndim - 1; d >= 0 && pakv_has_elements(t); d--) {
    if (t->dims[d] != 1 && t->strides[d] != expected)
      return pakv_fail(err, "%s must be a dense tensor (row-major, no gaps): got strides %s for shape %s", name,
                       STRIDES(t, strides), SHAPE(t, shape));
    expected *= t->dims[d];
  }
  return pakv_has_elements(t) ? pakv_require_host(t, name, err) : 0;
}

/* A rank-2 [rows, width] record of query's dtype and device, each row dense (any row stride). */
static int token_matrix(const pakv_tensor* t, int which, const pakv_tensor* query, int64_t rows, int64_t width,
                        const char* form, pakv_err* err) {
  const char* name = PAKV_FUSED_NAMES[which];
  int64_t dims[2] = {rows, width};
  if (pakv_same_dtype(t, name, query, "query", err) || pakv_same_device(t, name, query, err)) return -1;
  if (t->ndim != 2 || t->dims[0] != rows || t->dims[1] != width) return wrong_shape(err, name, dims, 2, form, t);
  return dense_rows(t, name, err);
}

/* query, key, value: the form (packed QKV, separate, LATENT) and head_size. */
static int fused_qkv(const pakv_tensor* t, const pakv_fused_attributes* a, pakv_fused_shape* s, pakv_err* err) {
  const pakv_tensor *q = &t[PAKV_FUSED_QUERY], *k = &t[PAKV_FUSED_KEY], *v = &t[PAKV_FUSED_VALUE];
  char shape[160];
  if (pakv_require_present(q, "query", err) || pakv_require_compute_dtype(q, err) ||
      pakv_require_rank(q, "query", 2, "[num_tokens, hidden_size]", err) || dense_rows(q, "query", err))
    return -1;
  s->latent = pakv_fused_latent(a);
  s->packed = !s->latent && !k->present;
  if (s->latent && !k->present) return pakv_fail(err, "key must be given when kv_cache_layout is 'LATENT'");
  if (s->latent && v->present)
    return pakv_fail(err, "value must not be given when kv_cache_layout is 'LATENT': every head's value is the leading "
                     "v_head_size channels of the latent key");
  if (!s->latent && k->present != v->present)
    return pakv_fail(err, "key and value must be both present, or both absent (query is then packed QKV)");
  int64_t heads = a->num_heads, hidden = q->dims[1], kv_columns = 0;
  if (s->packed && (pakv_mul(a->kv_num_heads, 2, &kv_columns) || pakv_add(heads, kv_columns, &heads)))
    return pakv_fail(err, "num_heads (%lld) + 2 x kv_num_heads (%lld) overflows int64 (query is packed QKV)",
                     (long long)a->num_heads, (long long)a->kv_num_heads);
  s->num_tokens = q->dims[0];
  s->head_dim = hidden / heads;
  if (hidden % heads || s->head_dim < 1)
    return pakv_fail(err, "query hidden size %lld must be %s = %lld x head_size with head_size >= 1 (query shape %s)",
                     (long long)hidden, s->packed ? "(num_heads + 2 x kv_num_heads) x head_size (packed QKV)" : "num_heads",
                     (long long)heads, SHAPE(q, shape));
  if (pakv_mul(a->kv_num_heads, s->head_dim, &s->kv_width)) /* never: kv_num_heads <= heads, so <= hidden */
    return pakv_fail(err, "kv_num_heads (%lld) x head_size (%lld) overflows int64", (long long)a->kv_num_heads,
                     (long long)s->head_dim);
  if (s->packed) return 0;
  if (token_matrix(k, PAKV_FUSED_KEY, q, s->num_tokens, s->kv_width, "num_tokens, kv_num_heads x head_size", err))
    return -1;
  return v->present ? token_matrix(v, PAKV_FUSED_VALUE, q, s->num_tokens, s->kv_width,
                                   "num_tokens, kv_num_heads x head_size", err)
                    : 0;
}

/* v_head_size, and which inputs LATENT forbids or SEPARATE needs. */
static int fused_layout(const pakv_tensor* t, const pakv_fused_attributes* a, pakv_fused_shape* s, pakv_err* err) {
  int64_t d = s->head_dim;
  s->value_head_dim = a->v_head_size ? a->v_head_size : d;
  if (a->v_head_size > d)
    return pakv_fail(err, "v_head_size must be 0 (head_size) or in [1, head_size = %lld], got %lld", (long long)d,
                     (long long)a->v_head_size);
  if (s->value_head_dim != d && !s->latent)
    return pakv_fail(err, "v_head_size (%lld) may differ from head_size (%lld) only when kv_cache_layout is 'LATENT'",
                     (long long)s->value_head_dim, (long long)d);
  if (s->value_head_dim != d && a->scale == 0.0f)
    return pakv_fail(err, "an explicit scale attribute must be given when v_head_size (%lld) differs from head_size "
                     "(%lld): 1 / sqrt(head_size) is not absorbed MLA's scale", (long long)s->value_head_dim, (long long)d);
  if (!s->latent) return pakv_require_present(&t[PAKV_FUSED_VALUE_CACHE], "value_cache (unless kv_cache_layout is 'LATENT')", err);
  static const int forbidden[] = {PAKV_FUSED_VALUE_CACHE, PAKV_FUSED_HEAD_SINK, PAKV_FUSED_Q_NORM_WEIGHT,
                                  PAKV_FUSED_K_NORM_WEIGHT, PAKV_FUSED_V_SCALE};
  for (int i = 0; i < 5; i++)
    if (t[forbidden[i]].present)
      return pakv_fail(err, "%s must be absent when kv_cache_layout is 'LATENT'%s", PAKV_FUSED_NAMES[forbidden[i]],
                       forbidden[i] == PAKV_FUSED_VALUE_CACHE ? " (V is read from key_cache's leading v_head_size channels)"
                       : forbidden[i] == PAKV_FUSED_V_SCALE  ? " (V is dequantized with k_scale)"
                                                             : " (no absorbed-MLA model uses it)");
  return 0;
}

/* The caches: query's dtype or a quantized one, both of one dtype and device, [nb, bs, Hk, D]. */
static int fused_caches(const pakv_tensor* t, const pakv_fused_attributes* a, pakv_fused_shape* s, pakv_err* err) {
  const pakv_tensor *q = &t[PAKV_FUSED_QUERY], *kc = &t[PAKV_FUSED_KEY_CACHE], *vc = &t[PAKV_FUSED_VALUE_CACHE];
  if (pakv_require_present(kc, "key_cache", err)) return -1;
  if (kc->elem_type == PAKV_ONNX_UINT8)
    return pakv_fail(err, "key_cache dtype uint8 holds packed int4 / float4e2m1 values (k_cache_dtype), which this "
                     "CPU kernel does not implement");
  if (kc->elem_type != q->elem_type && !pakv_fused_is_quantized(kc->elem_type))
    return pakv_fail_type(err, "key_cache dtype %s must be query's dtype %s or a quantized one (int8, float8_e4m3fn)",
                          pakv_type_name(kc->elem_type), pakv_type_name(q->elem_type));
  if ((vc->present && pakv_same_dtype(vc, "value_cache", kc, "key_cache", err)) ||
      pakv_same_device(kc, "key_cache", q, err) || (vc->present && pakv_same_device(vc, "value_cache", q, err)))
    return -1;
  const pakv_tensor* caches[2] = {kc, vc};
  pakv_cache_geometry* geometry[2] = {&s->key, &s->value};
  for (int i = 0; i < 2 && caches[i]->present; i++) {
    const pakv_tensor* c = caches[i];
    const char* name = PAKV_FUSED_NAMES[PAKV_FUSED_KEY_CACHE + i];
    int64_t dims[4] = {i ? kc->dims[0] : (c->ndim == 4 ? c->dims[0] : 0), i ? kc->dims[1] : (c->ndim == 4 ? c->dims[1] : 0),
                       a->kv_num_heads, s->head_dim};
    if (c->ndim != 4 || c->dims[0] != dims[0] || c->dims[1] != dims[1] || c->dims[2] != dims[2] || c->dims[3] != dims[3])
      return wrong_shape(err, name, dims, 4, "num_blocks, block_size, kv_num_heads, head_size", c);
    if (pakv_cache_shape(c, name, 0, geometry[i], err) || (i == 0 && pakv_check_block_size(geometry[0], err)) ||
        pakv_cache_layout(c, name, geometry[i], err))
      return -1;
  }
  if (!vc->present) s->value = s->key;
  return pakv_caches_apart(kc, vc, &s->key, &s->value, err);
}

/* cumulative_sequence_length [B+1], past_seqlens [B], block_table [B, cols]. */
static int fused_indices(const pakv_tensor* t, pakv_err* err) {
  const pakv_tensor *cu = &t[PAKV_FUSED_CU_SEQLENS], *past = &t[PAKV_FUSED_PAST_SEQLENS], *bt = &t[PAKV_FUSED_BLOCK_TABLE];
  char shape[160];
  if (pakv_index_record(cu, "cumulative_sequence_length", 1, "[batch_size + 1]", err) ||
      pakv_index_record(past, "past_seqlens", 1, "[batch_size]", err) ||
      pakv_index_record(bt, "block_table", 2, "[batch_size, max_blocks_per_sequence]", err))
    return -1;
  int64_t b = cu->dims[0] - 1;
  if (cu->dims[0] < 1) return pakv_fail(err, "cumulative_sequence_length must have batch_size + 1 >= 1 entries, got shape %s", SHAPE(cu, shape));
  if (past->dims[0] != b)
    return pakv_fail(err, "past_seqlens must have batch_size = %lld entries (cumulative_sequence_length has %lld), got shape %s",
                     (long long)b, (long long)cu->dims[0], SHAPE(past, shape));
  if (bt->dims[0] != b)
    return pakv_fail(err, "block_table must have batch_size = %lld rows, got shape %s", (long long)b, SHAPE(bt, shape));
  return 0;
}

/* A small dense input of query's dtype: [count] (norm weights, head_sink) read on the host. */
static int small_vector(const pakv_tensor* t, int which, const pakv_tensor* query, int64_t count, const char* form,
                        pakv_err* err) {
  const char* name = PAKV_FUSED_NAMES[which];
  if (pakv_same_dtype(t, name, query, "query", err)) return -1;
  if (t->ndim != 1 || t->dims[0] != count) return wrong_shape(err, name, &count, 1, form, t);
  return dense_on_host(t, name, err);
}

/* slot_mapping, head_sink, the norm weights, cos/sin, attention_metadata. */
static int fused_optional(const pakv_tensor* t, const pakv_fused_attributes* a, pakv_fused_shape* s, pakv_err* err) {
  const pakv_tensor *q = &t[PAKV_FUSED_QUERY], *cos = &t[PAKV_FUSED_COS_CACHE], *sin = &t[PAKV_FUSED_SIN_CACHE];
  const pakv_tensor *sm = &t[PAKV_FUSED_SLOT_MAPPING], *meta = &t[PAKV_FUSED_ATTENTION_METADATA];
  char shape[160], sin_shape[160];
  if (sm->present && pakv_index_record(sm, "slot_mapping", 1, "[num_tokens]", err)) return -1;
  if (sm->present && sm->dims[0] != s->num_tokens)
    return pakv_fail(err, "slot_mapping must have num_tokens = %lld entries, got shape %s", (long long)s->num_tokens,
                     SHAPE(sm, shape));
  if (t[PAKV_FUSED_HEAD_SINK].present &&
      small_vector(&t[PAKV_FUSED_HEAD_SINK], PAKV_FUSED_HEAD_SINK, q, a->num_heads, "num_heads", err))
    return -1;
  if (t[PAKV_FUSED_Q_NORM_WEIGHT].present != t[PAKV_FUSED_K_NORM_WEIGHT].present)
    return pakv_fail(err, "q_norm_weight and k_norm_weight must be given together");
  for (int w = PAKV_FUSED_Q_NORM_WEIGHT; w <= PAKV_FUSED_K_NORM_WEIGHT && t[w].present; w++)
    if (small_vector(&t[w], w, q, s->head_dim, "head_size", err)) return -1;
  if (cos->present != sin->present) return pakv_fail(err, "cos_cache and sin_cache must be given together");
  if (a->do_rotary && !cos->present) return pakv_fail(err, "do_rotary = 1 needs cos_cache and sin_cache");
  if (cos->present) {
    for (int c = PAKV_FUSED_COS_CACHE; c <= PAKV_FUSED_SIN_CACHE; c++) {
      if (pakv_same_dtype(&t[c], PAKV_FUSED_NAMES[c], q, "query", err) ||
          pakv_require_rank(&t[c], PAKV_FUSED_NAMES[c], 2, "[max_positions, rotary_dim / 2]", err))
        return -1;
      if (dense_on_host(&t[c], PAKV_FUSED_NAMES[c], err)) return -1;
    }
    if (sin->dims[0] != cos->dims[0] || sin->dims[1] != cos->dims[1])
      return pakv_fail(err, "sin_cache must have cos_cache's shape %s, got %s", SHAPE(cos, shape), SHAPE(sin, sin_shape));
    int64_t rotary_dim = 0, rotary_end = 0;
    if (pakv_mul(cos->dims[1], 2, &rotary_dim) || pakv_add(a->rotary_offset, rotary_dim, &rotary_end) ||
        rotary_end > s->head_dim)
      return pakv_fail(err, "rotary_offset (%lld) + rotary_dim (2 x cos_cache's dim 1 = 2 x %lld) must not exceed "
                       "head_size %lld", (long long)a->rotary_offset, (long long)cos->dims[1], (long long)s->head_dim);
    s->rotary_dim = a->do_rotary ? rotary_dim : 0;
  }
  if (meta->present) {
    if (pakv_index_record(meta, "attention_metadata", 1, "[2] or [3]", err)) return -1;
    if (meta->dims[0] != 2 && meta->dims[0] != 3)
      return pakv_fail(err, "attention_metadata holds 2 or 3 entries (max_query_len_bound, max_kv_len_bound, optional "
                       "max_kv_len_lower_bound), not shape %s", SHAPE(meta, shape));
  }
  return 0;
}

static const char* dtype_attribute_name(int onnx_type) { /* as k_cache_dtype names it ("float8e4m3fn") */
  switch (onnx_type) {
    case PAKV_ONNX_FLOAT16: return "float16";
    case PAKV_ONNX_BFLOAT16: return "bfloat16";
    case PAKV_ONNX_INT8: return "int8";
    case PAKV_ONNX_FLOAT8E4M3FN: return "float8e4m3fn";
    default: return pakv_type_name(onnx_type);
  }
}

/* One side's k_scale / v_scale and k_quant_type / k_cache_dtype against its cache. */
static int fused_scale(const pakv_tensor* t, const pakv_fused_attributes* a, const pakv_fused_shape* s, int side,
                       pakv_err* err) {
  const pakv_tensor *scale = &t[side ? PAKV_FUSED_V_SCALE : PAKV_FUSED_K_SCALE], *cache = &t[PAKV_FUSED_KEY_CACHE];
  const char *name = side ? "v_scale" : "k_scale", *attr = side ? "v_quant_type" : "k_quant_type";
  const char* cache_name = side && !s->latent ? "value_cache" : "key_cache";
  const char* dtype_attr = side ? a->v_cache_dtype : a->k_cache_dtype;
  int quant = pakv_fused_quant(side ? a->v_quant_type : a->k_quant_type), quantized = pakv_fused_is_quantized(cache->elem_type);
  char shape[160];
  if (dtype_attr[0] && strcmp(dtype_attr, dtype_attribute_name(cache->elem_type)) != 0)
    return pakv_fail(err, "%s is '%s' but %s's element type is %s: leave it '' to use the tensor's element type",
                     side ? "v_cache_dtype" : "k_cache_dtype", dtype_attr, cache_name, pakv_type_name(cache->elem_type));
  if (side && s->latent) return 0; /* LATENT: V is dequantized as K (its attributes were checked unset) */
  if (quant == PAKV_QUANT_NONE && scale->present) return pakv_fail(err, "%s must be absent when %s is 'NONE'", name, attr);
  if (quant == PAKV_QUANT_NONE && quantized)
    return pakv_fail(err, "%s holds %s values: %s must be 'PER_TENSOR' or 'PER_CHANNEL'", cache_name,
                     pakv_type_name(cache->elem_type), attr);
  if (quant == PAKV_QUANT_NONE) return 0;
  if (!quantized)
    return pakv_fail(err, "%s is '%s' but %s holds %s: use an int8 or float8_e4m3fn cache, or set %s to 'NONE'", attr,
                     side ? a->v_quant_type : a->k_quant_type, cache_name, pakv_type_name(cache->elem_type), attr);
  if (!scale->present) return pakv_fail(err, "%s must be given when %s is not 'NONE'", name, attr);
  if (scale->elem_type != PAKV_ONNX_FLOAT32)
    return pakv_fail_type(err, "%s must be float32, got %s", name, pakv_type_name(scale->elem_type));
  int64_t count = pakv_element_count(scale), want = quant == PAKV_QUANT_PER_TENSOR ? 1 : s->kv_width;
  if (quant == PAKV_QUANT_PER_TENSOR && count != 1)
    return pakv_fail(err, "%s must have exactly 1 element for PER_TENSOR, got shape %s", name, SHAPE(scale, shape));
  int64_t dims[3] = {a->kv_num_heads, 1, s->head_dim};
  if (quant == PAKV_QUANT_PER_CHANNEL &&
      (count != want || scale->ndim < 1 || scale->ndim > PAKV_MAX_RANK || scale->dims[scale->ndim - 1] != s->head_dim))
    return wrong_shape(err, name, dims, 3, "kv_num_heads, 1, head_size for PER_CHANNEL; any shape of those elements "
                       "ending in head_size", scale);
  return pakv_require_host(scale, name, err);
}

/* The call writes the caches (in place when it has no cache outputs): an input stored inside one would
 * change under the call, whichever order the rows are written in. Each extent computed once: O(inputs). */
static int inputs_apart_from_caches(const pakv_tensor* t, pakv_err* err) {
  uintptr_t first[2] = {0, 0}, end[2] = {0, 0}, a0, a1;
  for (int c = 0; c < 2; c++) {
    const pakv_tensor* cache = &t[PAKV_FUSED_KEY_CACHE + c];
    if (!cache->present || !pakv_byte_extent(cache, pakv_element_size(cache->elem_type), &first[c], &end[c]))
      first[c] = end[c] = 0; /* no bytes: nothing to share */
  }
  for (int src = 0; src < PAKV_FUSED_INPUTS; src++) {
    if (src == PAKV_FUSED_KEY_CACHE || src == PAKV_FUSED_VALUE_CACHE || !t[src].present ||
        !pakv_byte_extent(&t[src], pakv_element_size(t[src].elem_type), &a0, &a1))
      continue;
    for (int c = 0; c < 2; c++) {
      const pakv_tensor* cache = &t[PAKV_FUSED_KEY_CACHE + c];
      if (a0 < end[c] && first[c] < a1 && strncmp(t[src].device, cache->device, PAKV_DEVICE_LEN) == 0)
        return pakv_fail(err, "%s overlaps %s in memory: the call writes %s, so no input may share bytes with it",
                         PAKV_FUSED_NAMES[src], PAKV_FUSED_NAMES[PAKV_FUSED_KEY_CACHE + c],
                         PAKV_FUSED_NAMES[PAKV_FUSED_KEY_CACHE + c]);
    }
  }
  return 0;
}

int pakv_fused_inputs(const pakv_tensor* t, const pakv_fused_attributes* a, pakv_fused_shape* s, pakv_err* err) {
  memset(s, 0, sizeof(*s));
  for (int i = 0; i < PAKV_FUSED_RECORDS; i++)
    if (t[i].present && (pakv_record_ok(&t[i], PAKV_FUSED_NAMES[i], err) || pakv_refuse_meta(&t[i], PAKV_FUSED_NAMES[i], err)))
      return -1;
  if (pakv_check_fused_attributes(a, err) || fused_qkv(t, a, s, err) || fused_layout(t, a, s, err) ||
      fused_caches(t, a, s, err) || fused_indices(t, err) || fused_optional(t, a, s, err) ||
      fused_scale(t, a, s, 0, err) || fused_scale(t, a, s, 1, err))
    return -1;
  return inputs_apart_from_caches(t, err);
  return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* Outputs                                                                                     */
/* ------------------------------------------------------------------------------------------- */
int pakv_fused_cache_outputs(int latent, int key_cache_out, int value_cache_out, pakv_err* err) {
  if (latent && value_cache_out)
    return pakv_fail(err, "value_cache_out has no place when kv_cache_layout is 'LATENT' (there is one cache)");
  if (!latent && key_cache_out != value_cache_out)
    return pakv_fail(err, "key_cache_out and value_cache_out must be both present or both absent");
  return 0;
}

int pakv_validate_fused_outputs(const pakv_tensor t[PAKV_FUSED_RECORDS], const pakv_fused_plan* plan, pakv_err* err) {
  const pakv_tensor *out = &t[PAKV_FUSED_OUTPUT], *kco = &t[PAKV_FUSED_KEY_CACHE_OUT], *vco = &t[PAKV_FUSED_VALUE_CACHE_OUT];
  int64_t dims[2] = {plan->num_tokens, plan->num_heads * plan->attention.value_head_dim};
  if (pakv_fused_cache_outputs(plan->latent, kco->present, vco->present, err)) return -1;
  for (int i = PAKV_FUSED_OUTPUT; i < PAKV_FUSED_RECORDS; i++)
    if (t[i].present && (pakv_record_ok(&t[i], PAKV_FUSED_NAMES[i], err) || pakv_refuse_meta(&t[i], PAKV_FUSED_NAMES[i], err)))
      return -1;
  if (out->present && pakv_output_record(out, "output", &t[PAKV_FUSED_QUERY], "query", dims, 2, err)) return -1;
  for (int i = 0; i < 2; i++) {
    const pakv_tensor *o = &t[PAKV_FUSED_KEY_CACHE_OUT + i], *cache = &t[PAKV_FUSED_KEY_CACHE + i];
    if (o->present && pakv_output_record(o, PAKV_FUSED_NAMES[PAKV_FUSED_KEY_CACHE_OUT + i], cache,
                                         PAKV_FUSED_NAMES[PAKV_FUSED_KEY_CACHE + i], cache->dims, 4, err))
      return -1;
  }
  static const int in_place[PAKV_FUSED_OUTPUTS] = {-1, PAKV_FUSED_KEY_CACHE, PAKV_FUSED_VALUE_CACHE};
  for (int i = 0; i < PAKV_FUSED_OUTPUTS; i++)
    if (pakv_output_apart(t, PAKV_FUSED_NAMES, PAKV_FUSED_OUTPUT + i, PAKV_FUSED_INPUTS, in_place[i], err)) return -1;
  for (int i = PAKV_FUSED_OUTPUT; i < PAKV_FUSED_RECORDS; i++)
    for (int j = i + 1; j < PAKV_FUSED_RECORDS; j++)
      if (t[i].present && pakv_overlaps(&t[i], &t[j]))
        return pakv_fail(err, "%s and %s overlap in memory; pass separate tensors", PAKV_FUSED_NAMES[i], PAKV_FUSED_NAMES[j]);
  return 0;
}
