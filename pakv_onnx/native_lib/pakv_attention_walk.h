/* The attention core's hot loop, written once for any vector width: a unit defines PAKV_W (floats
 * per vector), PAKV_WALK (its entry's name) and PAKV_WALK_ATTRIBUTES (its target), PAKV_QK_ROWS (the
 * score tile's query rows: 8 or 4; the tile keeps 16 or 8 accumulators) and PAKV_PV_ROWS / PAKV_PV_VECS (the output tile: rows x value
 * vectors), then includes this file. See pakv_attention_core.h for the state it advances.
 *
 * Per chunk of PAKV_ATTN_CHUNK positions and kv head: the chunk's K rows (read in place when fp32,
 * else widened) are transposed in registers into keys_t [d][chunk], so scores are a register-blocked
 * GEMM (a query element broadcast times a vector of keys: no horizontal sums); the online softmax
 * runs a vector pass per row over its visible columns (mask, softcap, the non-finite rules, max, exp);
 * the output tile adds weights x V rows, rows that see the same columns together. Tokens whose
 * window or causal bound leaves a chunk unseen skip it (the causal triangle past a tile is never
 * visited). Small row counts (decode) prefetch the next chunk's rows of every kv head of the part. */
#include "pakv_attention_core.h"
#include "pakv_float.h"
#include "pakv_vec.h"

#define C PAKV_ATTN_CHUNK
#define INF __builtin_inff()
#define HOT static inline __attribute__((always_inline))

/* How a chunk's rows are read: fp32 rows in place (aligned, whole vectors: dim a multiple of
 * PAKV_W), bfloat16 rows in place (whole vectors, widened in registers), or any other row widened
 * into scratch (with zero padding to a multiple of PAKV_W). */
enum { ROWS_F32 = 0, ROWS_BF16 = 1, ROWS_STAGED = 2 };

HOT int row_kind(int32_t type, int64_t dim) {
  if (dim % PAKV_W) return ROWS_STAGED;
  return type == ONNX_FLOAT ? ROWS_F32 : type == ONNX_BFLOAT16 ? ROWS_BF16 : ROWS_STAGED;
}

/* A row at `at` read the way `kind` says: itself, or its widened copy in `into` (stride padded). */
HOT const float* row_at(const char* at, int64_t dim, int64_t padded, int32_t type, int kind, float* into) {
  if (kind == ROWS_BF16 || (kind == ROWS_F32 && ((uintptr_t)at & (sizeof(float) - 1)) == 0)) return (const float*)at;
  if (type == ONNX_BFLOAT16 && dim % PAKV_W == 0) { /* whole vectors: widened in registers */
    for (int64_t e = 0; e < dim; e += PAKV_W) vstore(into + e, vload_bf16((const uint16_t*)at + e));
  } else {
    widen(into, at, dim, type);
  }
  for (int64_t e = dim; e < padded; e++) into[e] = 0.0f;
  return into;
}

/* How the walk stages one side's rows of kv head g (pakv_rounds_dequantized): `type` 0 as stored (their
 * scale applied apart), else each element as fp32 e x scale (per tensor, or channel c's of the head:
 * channel[c]) rounded to `type`. */
typedef struct { int32_t type; float tensor; const float* channel; } row_scaling;

HOT row_scaling scaling_of(const pakv_attention_plan* p, int32_t quant, const float* scale, int64_t dim, int64_t g) {
  row_scaling r = {0, 1.0f, NULL};
  if (!pakv_rounds_dequantized(p, quant)) return r;
  r.type = p->dequantized_type;
  if (quant == PAKV_QUANT_PER_CHANNEL) r.channel = scale + g * dim;
  else r.tensor = scale[0];
  return r;
}

/* `rows` staged rows of `dim` stored elements (widened, unscaled), `stride` floats apart, dequantized in
 * place as `r` says: fp32 e x scale rounded to r.type. */
HOT void dequantize_rows(float* row, int64_t rows, int64_t dim, int64_t stride, row_scaling r) {
  const int bf16 = r.type == ONNX_BFLOAT16;
  for (int64_t i = 0; i < rows; i++, row += stride) {
    int64_t e = 0;
    for (; e + PAKV_W <= dim; e += PAKV_W) {
      const vf x = vload(row + e) * (r.channel ? vload(r.channel + e) : vsplat(r.tensor));
      vstore(row + e, bf16 ? vround_bf16(x) : vround_f16(x));
    }
    for (; e < dim; e++) {
      const float x = row[e] * (r.channel ? r.channel[e] : r.tensor);
      row[e] = bf16 ? bf16_to_float(float_to_bf16(x)) : f16_to_float(float_to_f16(x));
    }
  }
}

/* V rows are K rows' leading channels (LATENT), read through the K rows: same cache, type and strides,
 * and, when the walk dequantizes, the same scales for those channels. */
HOT int values_are_keys(const pakv_attention_plan* p) {
  const int same_channels = p->key_quant != PAKV_QUANT_PER_CHANNEL || p->num_kv_heads == 1 || p->value_head_dim == p->head_dim;
  const int same_scaling = !p->dequantized_type ||
                           (p->value_quant == p->key_quant && p->value_scale == p->key_scale && same_channels);
  return p->value_cache == p->key_cache && p->value_type == p->key_type && p->value_head_dim <= p->head_dim &&
         p->value_block_stride == p->key_block_stride && p->value_row_stride == p->key_row_stride &&
         p->value_head_stride == p->key_head_stride && same_scaling;
}

/* The kinds of a plan's K rows, and of its V rows when K rows are read as `kread` (LATENT shares the
 * rows: a widened K row is an fp32 row; a bf16 one is V's only in whole vectors). */
HOT int key_kind(const pakv_attention_plan* p) { return row_kind(p->key_type, p->head_dim); }
HOT int value_kind(const pakv_attention_plan* p, int kread) {
  if (!values_are_keys(p)) return row_kind(p->value_type, p->value_head_dim);
  return kread != ROWS_BF16 ? ROWS_F32 : p->value_head_dim % PAKV_W ? ROWS_STAGED : ROWS_BF16;
}

/* kv head g's rows of positions [c0, c0 + n): K rows into key_rows [C + PAKV_W] (rows n .. the next
 * multiple of PAKV_W point at zeros) and, with `transpose`, transposed into keys_t; V rows into
 * value_rows (bfloat16 ones in place, as value_kind says). Rows of a quantized cache are always
 * staged, and dequantized there when the plan asks (scaling_of). Returns 1 on a block id outside the
 * pool. */
HOT int load_chunk(const pakv_attention_plan* p, pakv_part_state* s, int64_t b, int64_t g, int64_t c0, int64_t n,
                   int kkind, int vkind, int transpose, const float** key_rows) {
  const int64_t bs = p->block_size, d = s->d, dp = s->dp, ncp = (n + PAKV_W - 1) / PAKV_W * PAKV_W;
  const int shared = values_are_keys(p) && vkind != ROWS_STAGED;
  const row_scaling key_scaling = scaling_of(p, p->key_quant, p->key_scale, d, g);
  const row_scaling value_scaling = scaling_of(p, p->value_quant, p->value_scale, s->dv, g);
  for (int64_t pos = c0, end = c0 + n; pos < end;) {
    const int64_t slot = pos % bs, run = bs - slot < end - pos ? bs - slot : end - pos;
    const int64_t block = pakv_table_entry(p, b, pos / bs);
    if (block < 0 || block >= p->num_blocks) return 1;
    const char* k = (const char*)p->key_cache + block * p->key_block_stride + slot * p->key_row_stride +
                    g * p->key_head_stride;
    const char* v = (const char*)p->value_cache + block * p->value_block_stride + slot * p->value_row_stride +
                    g * p->value_head_stride;
    for (int64_t r = 0; r < run; r++, pos++, k += p->key_row_stride, v += p->value_row_stride) {
      const int64_t i = pos - c0;
      key_rows[i] = row_at(k, d, dp, p->key_type, kkind, s->key_rows + i * dp);
      s->value_rows[i] = shared ? key_rows[i] : row_at(v, s->dv, s->dv, p->value_type, vkind, s->values + i * s->dv);
    }
  }
  /* Quantized rows (always staged) dequantized after the chunk's reads: its loads stay in flight together. */
  if (key_scaling.type) dequantize_rows(s->key_rows, n, d, dp, key_scaling);
  if (!shared && value_scaling.type) dequantize_rows(s->values, n, s->dv, s->dv, value_scaling);
  for (int64_t i = n; i < ncp; i++) key_rows[i] = s->key_rows + C * dp; /* the zero row (zero in bf16 too) */
  for (int64_t c = 0; c < ncp && transpose; c += PAKV_W)
    for (int64_t e = 0; e < d; e += PAKV_W) {
      vf block[PAKV_W];
      if (kkind == ROWS_BF16)
        for (int i = 0; i < PAKV_W; i++) block[i] = vload_bf16((const uint16_t*)key_rows[c + i] + e);
      else
        for (int i = 0; i < PAKV_W; i++) block[i] = vload(key_rows[c + i] + e);
      vtranspose(block);
      for (int i = 0; i < PAKV_W && e + i < d; i++) vstore(s->keys_t + (e + i) * C + c, block[i]);
    }
  return 0;
}

/* scores[i][0 .. vecs x PAKV_W) = q_i . keys_t columns, for R rows of q (stride d): R x V
 * accumulators in registers (V key vectors per step), one query element broadcast per key vector. */
#define PAKV_QK_TILE(R, V)                                                                                 \
  HOT void qk_tile_##R(const float* q, int64_t d, const float* kt, int64_t vecs, float* scores) {          \
    for (int64_t v0 = 0; v0 < vecs; v0 += V) {                                                             \
      vf acc[R][V];                                                                                        \
      for (int i = 0; i < R; i++)                                                                          \
        for (int j = 0; j < V; j++) acc[i][j] = vsplat(0.0f);                                              \
      const float* k = kt + v0 * PAKV_W;                                                                   \
      for (int64_t e = 0; e < d; e++, k += C) {                                                            \
        vf keys[V];                                                                                        \
        for (int j = 0; j < V; j++) keys[j] = vload(k + j * PAKV_W);                                       \
        for (int i = 0; i < R; i++) {                                                                      \
          const vf x = vsplat(q[i * d + e]);                                                               \
          for (int j = 0; j < V; j++) acc[i][j] += x * keys[j];                                            \
        }                                                                                                  \
      }                                                                                                    \
      for (int i = 0; i < R; i++)                                                                          \
        for (int j = 0; j < V; j++) vstore(scores + i * C + (v0 + j) * PAKV_W, acc[i][j]);                 \
    }                                                                                                      \
  }

/* acc[i][x .. x + NV W) += sum over columns c in [c0, c1) of w[i][c] x value_rows[c][x ..], for R rows:
 * R x NV accumulators in registers, each added to in column order. */
#define PAKV_PV_SPAN(R, NV, LOAD, ELEMENT)                                                                 \
  {                                                                                                        \
    vf a[R][NV];                                                                                           \
    for (int i = 0; i < R; i++)                                                                            \
      for (int j = 0; j < NV; j++) a[i][j] = vload(acc + i * dv + x + j * PAKV_W);                         \
    for (int64_t c = c0; c < c1; c++) {                                                                    \
      vf v[NV];                                                                                            \
      for (int j = 0; j < NV; j++) v[j] = LOAD((const ELEMENT*)rows[c] + x + j * PAKV_W);                  \
      for (int i = 0; i < R; i++) {                                                                        \
        const vf weight = vsplat(w[i * C + c]);                                                            \
        for (int j = 0; j < NV; j++) a[i][j] += weight * v[j];                                             \
      }                                                                                                    \
    }                                                                                                      \
    for (int i = 0; i < R; i++)                                                                            \
      for (int j = 0; j < NV; j++) vstore(acc + i * dv + x + j * PAKV_W, a[i][j]);                         \
  }

/* acc[i][0 .. dv) += sum over columns c in [c0, c1) of w[i][c] x value_rows[c], for R rows that all
 * see exactly those columns (and weigh none of them 0): spans of PAKV_PV_VECS value vectors, then of
 * 2 and 1 (a head of 2 vectors keeps R x 2 independent sums, not one sum at a time: a decode step of
 * head size 32 waited on each add's latency), in registers. Every element is summed in column order
 * whatever its span, so the result does not depend on the span. NAME f32 reads fp32 rows, bf16
 * bfloat16 rows (dv a multiple of PAKV_W: no tails). */
#define PAKV_PV_TILE(NAME, R, LOAD, ELEMENT)                                                               \
  HOT void pv_##NAME##_##R(float* acc, int64_t dv, const float* w, const float* const* rows, int64_t c0,  \
                           int64_t c1) {                                                                   \
    int64_t x = 0;                                                                                         \
    for (; x + PAKV_PV_VECS * PAKV_W <= dv; x += PAKV_PV_VECS * PAKV_W) PAKV_PV_SPAN(R, PAKV_PV_VECS, LOAD, ELEMENT) \
    for (; x + 2 * PAKV_W <= dv; x += 2 * PAKV_W) PAKV_PV_SPAN(R, 2, LOAD, ELEMENT)                        \
    for (; x + PAKV_W <= dv; x += PAKV_W) PAKV_PV_SPAN(R, 1, LOAD, ELEMENT)                                \
    for (; x < dv; x++) /* fp32 rows only: bf16 rows come in whole vectors */                              \
      for (int i = 0; i < R; i++) {                                                                        \
        float a = acc[i * dv + x];                                                                         \
        for (int64_t c = c0; c < c1; c++) a += w[i * C + c] * rows[c][x];                                  \
        acc[i * dv + x] = a;                                                                               \
      }                                                                                                    \
  }

/* Few rows (decode) take more key vectors per step: the same accumulator budget, fewer broadcasts. */
#if PAKV_QK_ROWS > 4
PAKV_QK_TILE(1, 4)
PAKV_QK_TILE(2, 4)
PAKV_QK_TILE(3, 4)
PAKV_QK_TILE(4, 4)
PAKV_QK_TILE(5, 2)
PAKV_QK_TILE(6, 2)
PAKV_QK_TILE(7, 2)
PAKV_QK_TILE(8, 2)
#else
PAKV_QK_TILE(1, 4)
PAKV_QK_TILE(2, 4)
PAKV_QK_TILE(3, 2)
PAKV_QK_TILE(4, 2)
#endif
#include "pakv_attention_decode.h"

PAKV_PV_TILE(f32, 1, vload, float)
PAKV_PV_TILE(f32, 2, vload, float)
PAKV_PV_TILE(f32, 3, vload, float)
PAKV_PV_TILE(f32, 4, vload, float)
PAKV_PV_TILE(bf16, 1, vload_bf16, uint16_t)
PAKV_PV_TILE(bf16, 2, vload_bf16, uint16_t)
PAKV_PV_TILE(bf16, 3, vload_bf16, uint16_t)
PAKV_PV_TILE(bf16, 4, vload_bf16, uint16_t)

/* Scores of `rows` query rows (stride d) over the chunk's first `vecs` key vectors. */
HOT void chunk_scores(const float* q, int64_t rows, int64_t d, const float* kt, int64_t vecs, float* scores) {
  int64_t i = 0;
  for (; i + PAKV_QK_ROWS <= rows; i += PAKV_QK_ROWS) {
#if PAKV_QK_ROWS > 4
    qk_tile_8(q + i * d, d, kt, vecs, scores + i * C);
#else
    qk_tile_4(q + i * d, d, kt, vecs, scores + i * C);
#endif
  }
  switch (rows - i) {
#if PAKV_QK_ROWS > 4
    case 7: qk_tile_7(q + i * d, d, kt, vecs, scores + i * C); break;
    case 6: qk_tile_6(q + i * d, d, kt, vecs, scores + i * C); break;
    case 5: qk_tile_5(q + i * d, d, kt, vecs, scores + i * C); break;
    case 4: qk_tile_4(q + i * d, d, kt, vecs, scores + i * C); break;
#endif
    case 3: qk_tile_3(q + i * d, d, kt, vecs, scores + i * C); break;
    case 2: qk_tile_2(q + i * d, d, kt, vecs, scores + i * C); break;
    case 1: qk_tile_1(q + i * d, d, kt, vecs, scores + i * C); break;
    default: break;
  }
}

/* Weighted values of `rows` rows that see columns [c0, c1) alike (no zero weight among them), V
 * rows read as `vkind` says (bf16 in place, else fp32). */
HOT void add_values(float* acc, int64_t rows, int64_t dv, const float* w, const float* const* vrows, int64_t c0,
                    int64_t c1, int vkind) {
  int64_t i = 0;
  if (vkind == ROWS_BF16) {
    for (; i + 4 <= rows; i += 4) pv_bf16_4(acc + i * dv, dv, w + i * C, vrows, c0, c1);
    switch (rows - i) {
      case 3: pv_bf16_3(acc + i * dv, dv, w + i * C, vrows, c0, c1); break;
      case 2: pv_bf16_2(acc + i * dv, dv, w + i * C, vrows, c0, c1); break;
      case 1: pv_bf16_1(acc + i * dv, dv, w + i * C, vrows, c0, c1); break;
      default: break;
    }
    return;
  }
  for (; i + 4 <= rows; i += 4) pv_f32_4(acc + i * dv, dv, w + i * C, vrows, c0, c1);
  switch (rows - i) {
    case 3: pv_f32_3(acc + i * dv, dv, w + i * C, vrows, c0, c1); break;
    case 2: pv_f32_2(acc + i * dv, dv, w + i * C, vrows, c0, c1); break;
    case 1: pv_f32_1(acc + i * dv, dv, w + i * C, vrows, c0, c1); break;
    default: break;
  }
}

/* One row's scores of columns [c0, c1) (its visible ones) into its state: softcap, -inf outside
 * the range, the non-finite rules, a new max rescaling what was summed, then the weights e^(s - max)
 * in place of the scores (exactly 0 for -inf). Returns 0 when nothing is to be added (the row NaN
 * or every score -inf), 1 with weights, 2 with weights some of which are 0 (a -inf score). Vectors
 * wholly inside the range skip the masks. */
HOT int fold_row(const pakv_attention_plan* p, float* max, float* sum, float* acc, int64_t dv, float* row, int64_t c0,
                 int64_t c1) {
  if (*sum != *sum) return 0; /* already NaN */
  const vf minus_inf = vsplat(-INF), cap = vsplat(p->softcap), inverse_cap = vsplat(1.0f / p->softcap);
  const int64_t first = c0 / PAKV_W * PAKV_W, last = (c1 + PAKV_W - 1) / PAKV_W * PAKV_W;
  vi lane, finite = ~(vi){0};
  for (int i = 0; i < PAKV_W; i++) lane[i] = i;
  vf top = minus_inf;
  for (int64_t c = first; c < last; c += PAKV_W) {
    vf x = vload(row + c);
    if (p->softcap > 0.0f) x = vtanh(x * inverse_cap) * cap;
    if (c < c0 || c + PAKV_W > c1) { /* a vector at the range's edge */
      const vi at = lane + (int32_t)c;
      x = vselect((at >= (int32_t)c0) & (at < (int32_t)c1), x, minus_inf);
      vstore(row + c, x);
    } else if (p->softcap > 0.0f) {
      vstore(row + c, x);
    }
    finite &= x < vsplat(INF); /* false for NaN and +inf */
    top = vmax2(top, x);
  }
  if (vany(~finite)) {
    *sum = __builtin_nanf("");
    return 0;
  }
  const float chunk_max = vmax_all(top);
  if (chunk_max == -INF) return 0;
  if (*sum > 0.0f && chunk_max > *max) { /* a new max: rescale what was summed so far */
    const float correction = exp_nonpositive(*max - chunk_max);
    *sum *= correction;
    for (int64_t x = 0; x < dv; x++) acc[x] *= correction;
  }
  if (*sum == 0.0f || chunk_max > *max) *max = chunk_max;
  const vf shift = vsplat(*max);
  vf total = vsplat(0.0f);
  vi holes = (vi){0};
  for (int64_t c = first; c < last; c += PAKV_W) {
    const vf x = vload(row + c);
    const vi none = x == minus_inf;
    if (c < c0 || c + PAKV_W > c1) {
      const vi at = lane + (int32_t)c;
      holes |= none & (at >= (int32_t)c0) & (at < (int32_t)c1);
    } else {
      holes |= none;
    }
    const vf e = vselect(none, vsplat(0.0f), vexp_nonpositive(x - shift));
    total += e;
    vstore(row + c, e);
  }
  *sum += vsum_all(total);
  return vany(holes) ? 2 : 1;
}

/* One row's weighted values when some visible weights are 0: only the rows with weight (0 x a NaN
 * or inf value must not poison the row). */
HOT void add_values_sparse(float* acc, int64_t dv, const float* w, const float* const* vrows, int64_t c0, int64_t c1,
                           int vkind) {
  for (int64_t c = c0; c < c1; c++)
    if (w[c] != 0.0f) add_values(acc, 1, dv, w, vrows, c, c + 1, vkind);
}

/* Hint bytes [at, at + bytes) into L2, one line at a time. */
HOT void prefetch_range(const char* at, int64_t bytes) {
  for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(at + x, 0, 2);
}

/* Hint the next chunk's K and V rows of kv heads [g0, g1) into L2 (decode: memory-bound): a block's
 * run of positions at once when its rows are dense (the part's heads fill each row). */
HOT void prefetch_chunk(const pakv_attention_plan* p, int64_t b, int64_t c0, int64_t c1, int64_t g0, int64_t g1) {
  const int64_t bs = p->block_size;
  const int64_t key_span = (g1 - g0 - 1) * p->key_head_stride + p->head_dim * item_size(p->key_type);
  const int64_t value_span = (g1 - g0 - 1) * p->value_head_stride + p->value_head_dim * item_size(p->value_type);
  for (int64_t pos = c0; pos < c1;) {
    const int64_t slot = pos % bs, run = bs - slot < c1 - pos ? bs - slot : c1 - pos;
    const int64_t block = pakv_table_entry(p, b, pos / bs);
    if (block < 0 || block >= p->num_blocks) return; /* load_chunk reports it */
    const char* k = (const char*)p->key_cache + block * p->key_block_stride + slot * p->key_row_stride +
                    g0 * p->key_head_stride;
    const char* v = (const char*)p->value_cache + block * p->value_block_stride + slot * p->value_row_stride +
                    g0 * p->value_head_stride;
    if (p->key_row_stride == key_span) prefetch_range(k, run * key_span);
    else for (int64_t r = 0; r < run; r++) prefetch_range(k + r * p->key_row_stride, key_span);
    if (p->value_row_stride == value_span) prefetch_range(v, run * value_span);
    else for (int64_t r = 0; r < run; r++) prefetch_range(v + r * p->value_row_stride, value_span);
    pos += run;
  }
}

/* Fold kv head g's rows (state rows [base, base + tokens x group)) over the chunk [c0, c0 + n).
 * Consecutive rows that see the same columns with plain weights add their values in one output
 * tile (a decode token's group of heads; in a prefill every token of a chunk under the diagonal);
 * a row with a zero weight adds its own, skipping those columns. */
HOT int walk_head(const pakv_attention_plan* p, const pakv_attention_part* part, pakv_part_state* s, int64_t g,
                  int64_t c0, int64_t n) {
  const int64_t b = part->seq, group = s->group, dv = s->dv, base = (g - part->kv_begin) * s->tokens * group;
  int64_t first = -1, last = -1, lo, hi;
  for (int64_t t = 0; t < s->tokens; t++) {
    pakv_visible(p, b, part->token_begin + t, &lo, &hi);
    if (hi >= c0 && lo < c0 + n) {
      if (first < 0) first = t;
      last = t;
    }
  }
  if (first < 0) return 0;
  const int kkind = key_kind(p);
  const int64_t row0 = first * group, rows = (last + 1 - first) * group; /* scores row 0 is row row0 */
  /* Few rows (decode) score the key rows themselves (fp32 in place, else widened); more score a
   * transposed copy (a GEMM tile). */
  const int direct = rows <= PAKV_ROWS_SCORES_MAX, kread = direct && kkind == ROWS_BF16 ? ROWS_STAGED : kkind;
  /* bf16 V rows are widened in registers when each is used by few rows (decode), once into scratch
   * when a chunk serves many (prefill). */
  const int vkind = value_kind(p, kread) == ROWS_BF16 && s->tokens * group > 8 ? ROWS_STAGED : value_kind(p, kread);
  const float* key_rows[C + PAKV_W];
  if (load_chunk(p, s, b, g, c0, n, kread, vkind, !direct, key_rows)) return 1;
  float* const acc = s->acc + base * dv;
  const int64_t vecs = (n + PAKV_W - 1) / PAKV_W;
  if (direct)
    rows_scores(s->queries + (base + row0) * s->d, rows, s->d, kread == ROWS_F32 ? s->d : s->dp, key_rows,
                vecs * PAKV_W, s->keys_t, s->scores);
  else
    chunk_scores(s->queries + (base + row0) * s->d, rows, s->d, s->keys_t, vecs, s->scores);
  int64_t run_first = 0, run_rows = 0, run_lo = 0, run_hi = 0; /* plain rows [run_first, + run_rows) */
  signed char status[64];
  for (int64_t t = first; t <= last; t++) {
    pakv_visible(p, b, part->token_begin + t, &lo, &hi);
    const int64_t c_lo = lo > c0 ? lo - c0 : 0, c_hi = (hi + 1 < c0 + n ? hi + 1 : c0 + n) - c0;
    for (int64_t i0 = 0; i0 < group && c_lo < c_hi; i0 += 64) { /* the token's rows, 64 at a time */
      const int64_t i1 = group - i0 < 64 ? group : i0 + 64, row = t * group + i0;
      int plain = 1;
      for (int64_t r = row; r < row + i1 - i0; r++) {
        float* w = s->scores + (r - row0) * C;
        status[r - row] = (signed char)fold_row(p, &s->max[base + r], &s->sum[base + r], acc + r * dv, dv, w, c_lo, c_hi);
        if (status[r - row] == 2) add_values_sparse(acc + r * dv, dv, w, s->value_rows, c_lo, c_hi, vkind);
        plain &= status[r - row] == 1;
      }
      const int joins = run_rows && run_first + run_rows == row && run_lo == c_lo && run_hi == c_hi;
      if (run_rows && !(plain && joins)) {
        add_values(acc + run_first * dv, run_rows, dv, s->scores + (run_first - row0) * C, s->value_rows, run_lo, run_hi, vkind);
        run_rows = 0;
      }
      if (plain) {
        if (!run_rows) run_first = row, run_lo = c_lo, run_hi = c_hi;
        run_rows += i1 - i0;
      } else {
        for (int64_t r = row; r < row + i1 - i0; r++)
          if (status[r - row] == 1) add_values(acc + r * dv, 1, dv, s->scores + (r - row0) * C, s->value_rows, c_lo, c_hi, vkind);
      }
    }
  }
  if (run_rows)
    add_values(acc + run_first * dv, run_rows, dv, s->scores + (run_first - row0) * C, s->value_rows, run_lo, run_hi, vkind);
  return 0;
}

PAKV_WALK_ATTRIBUTES int PAKV_WALK(const pakv_attention_plan* p, const pakv_attention_part* part, pakv_part_state* s) {
  const int64_t b = part->seq;
  int64_t lo, hi, first_lo, last_hi;
  pakv_visible(p, b, part->token_begin, &first_lo, &hi);
  pakv_visible(p, b, part->token_end - 1, &lo, &last_hi);
  const int64_t begin = first_lo > part->pos_begin ? first_lo : part->pos_begin;
  const int64_t end = last_hi + 1 < part->pos_end ? last_hi + 1 : part->pos_end;
  const int prefetch = s->tokens * s->group <= 8;
  for (int64_t c0 = begin; c0 < end; c0 += C) {
    const int64_t n = end - c0 < C ? end - c0 : C;
    if (prefetch && c0 + n < end) prefetch_chunk(p, b, c0 + n, end - c0 - n < C ? end : c0 + n + C, part->kv_begin, part->kv_end);
    for (int64_t g = part->kv_begin; g < part->kv_end; g++)
      if (walk_head(p, part, s, g, c0, n)) return 1;
  }
  return 0;
}

#undef C
#undef INF
#undef HOT
