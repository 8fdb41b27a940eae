/* One part of a paged attention (pakv_attention_core.h): the query rows of some new tokens of one
 * sequence and some kv heads, over a range of their context, read from the paged caches in place.
 * No ONNX Runtime, no Python, no libm.
 *
 * A part walks its positions in chunks of PAKV_ATTN_CHUNK with an online softmax (running max,
 * running sum, fp32 accumulator per query row): exact softmax, memory independent of the context.
 * Per chunk and kv head, the K/V rows are pointers into an fp32 cache or rows widened once into
 * scratch (16-bit, int8, float8e4m3fn: the stored elements; LATENT reads V from the K rows). The
 * scores' scale and a key scale are folded into the query ((q x s) . k), a value scale into the
 * finished row. Non-finite scores: -inf weighs exactly 0 and its value row is not multiplied in;
 * NaN or +inf makes the query row NaN; a row whose every score is -inf is NaN, or 0 with a finite
 * sink (the sink's own weight is the whole denominator). */
#include <string.h>

#include "pakv_attention_core.h"
#include "pakv_float.h"
#include "pakv_vec.h"

#define PAKV_INF __builtin_inff()
/* Inlined into walk_chunks, so each of its target clones compiles them for its instruction set. */
#define PAKV_HOT static inline __attribute__((always_inline))
#define PAKV_NAN __builtin_nanf("")

typedef struct {
  int64_t rows, tokens, group, d, dv; /* query rows = kv heads x tokens x group */
  float* queries;                     /* [rows][d]: q x scale x key scale */
  float* acc;                         /* [rows][dv] */
  float* max;                         /* [rows] */
  float* sum;                         /* [rows]: 0 until a finite score, NaN once poisoned */
  float* scores;                      /* [tokens x group][CHUNK]: one kv head's rows */
  float* weights;                     /* [CHUNK] */
  float* keys;                        /* [CHUNK][d] widened K rows */
  float* values;                      /* [CHUNK][dv] widened V rows */
} part_state;

int64_t pakv_attention_part_floats(const pakv_attention_plan* p, int64_t tokens, int64_t kv_heads) {
  int64_t group = p->num_heads / p->num_kv_heads, rows, per_row, total, term;
  if (pakv_mul(tokens, kv_heads, &rows) || pakv_mul(rows, group, &rows) || pakv_add(p->head_dim, p->value_head_dim, &per_row) ||
      pakv_add(per_row, 2, &per_row) || pakv_mul(rows, per_row, &total) || pakv_mul(tokens, group, &term) ||
      pakv_mul(term, PAKV_ATTN_CHUNK, &term) || pakv_add(total, term, &total) ||
      pakv_add(p->head_dim, p->value_head_dim, &term) || pakv_add(term, 1, &term) ||
      pakv_mul(term, PAKV_ATTN_CHUNK, &term) || pakv_add(total, term, &total) ||
      (uint64_t)total > SIZE_MAX / sizeof(float))
    return -1;
  return total;
}

static void lay_out(const pakv_attention_plan* p, const pakv_attention_part* part, float* scratch, part_state* s) {
  s->tokens = part->token_end - part->token_begin;
  s->group = p->num_heads / p->num_kv_heads;
  s->rows = (part->kv_end - part->kv_begin) * s->tokens * s->group;
  s->d = p->head_dim;
  s->dv = p->value_head_dim;
  s->queries = scratch;
  s->acc = s->queries + s->rows * s->d;
  s->max = s->acc + s->rows * s->dv;
  s->sum = s->max + s->rows;
  s->scores = s->sum + s->rows;
  s->weights = s->scores + s->tokens * s->group * PAKV_ATTN_CHUNK;
  s->keys = s->weights + PAKV_ATTN_CHUNK;
  s->values = s->keys + PAKV_ATTN_CHUNK * s->d;
}

static inline float exp_nonpositive(float x) {
  v8f v = splat8(x);
  return exp8_nonpositive(&v)[0];
}

/* The part's query rows (kv head, token, head of the group), widened, times the scores' scale and
 * the key scale (per tensor, or per channel of the row's kv head); states empty. */
static void load_queries(const pakv_attention_plan* p, const pakv_attention_part* part, part_state* s) {
  float* row = s->queries;
  for (int64_t g = part->kv_begin; g < part->kv_end; g++) {
    const float* channel = p->key_quant == PAKV_QUANT_PER_CHANNEL ? p->key_scale + g * s->d : NULL;
    const float factor = p->scale * (p->key_quant == PAKV_QUANT_PER_TENSOR ? p->key_scale[0] : 1.0f);
    for (int64_t j = part->token_begin; j < part->token_end; j++)
      for (int64_t i = 0; i < s->group; i++, row += s->d) {
        const int64_t token = p->query_starts[part->seq] + j, head = g * s->group + i;
        widen(row, (const char*)p->query + token * p->query_token_stride + head * p->query_head_stride, s->d,
              p->query_type);
        for (int64_t c = 0; c < s->d; c++) row[c] *= channel ? factor * channel[c] : factor;
      }
  }
  memset(s->acc, 0, (size_t)(s->rows * s->dv) * sizeof(float));
  for (int64_t r = 0; r < s->rows; r++) {
    s->max[r] = -PAKV_INF;
    s->sum[r] = 0.0f;
  }
}

/* V rows are K rows when both are one cache read the same way (LATENT: V is each row's leading
 * value_head_dim channels). */
static int values_are_keys(const pakv_attention_plan* p) {
  return p->value_cache == p->key_cache && p->value_type == p->key_type && p->value_head_dim <= p->head_dim &&
         p->value_block_stride == p->key_block_stride && p->value_row_stride == p->key_row_stride &&
         p->value_head_stride == p->key_head_stride;
}

/* A row of `dim` elements at `at` as fp32: in place (an aligned fp32 row) or widened into `into`. */
PAKV_HOT const float* row_as_floats(const char* at, int64_t dim, int32_t type, float* into) {
  if (type == ONNX_FLOAT && ((uintptr_t)at & (sizeof(float) - 1)) == 0) return (const float*)at;
  widen(into, at, dim, type);
  return into;
}

/* Pointers to kv head g's K and V rows of positions [c0, c1) of sequence b. Returns 1 when a block
 * id read here is outside [0, num_blocks). */
PAKV_HOT int load_rows(const pakv_attention_plan* p, part_state* s, int64_t b, int64_t g, int64_t c0, int64_t c1,
                     const float** key_rows, const float** value_rows) {
  const int64_t bs = p->block_size;
  const int shared = values_are_keys(p);
  for (int64_t pos = c0; pos < c1;) {
    const int64_t slot = pos % bs, run = bs - slot < c1 - pos ? bs - slot : c1 - pos;
    const int64_t block = pakv_table_entry(p, b, pos / bs);
    if (block < 0 || block >= p->num_blocks) return 1;
    const char* k = (const char*)p->key_cache + block * p->key_block_stride + slot * p->key_row_stride +
                    g * p->key_head_stride;
    const char* v = (const char*)p->value_cache + block * p->value_block_stride + slot * p->value_row_stride +
                    g * p->value_head_stride;
    for (int64_t r = 0; r < run; r++, pos++, k += p->key_row_stride, v += p->value_row_stride) {
      const int64_t i = pos - c0;
      key_rows[i] = row_as_floats(k, s->d, p->key_type, s->keys + i * s->d);
      value_rows[i] = shared ? key_rows[i] : row_as_floats(v, s->dv, p->value_type, s->values + i * s->dv);
    }
  }
  return 0;
}

/* scores[q][r] = queries[q] . key_rows[r] for q < nq, r < nk; columns [nk, nk rounded up to 8) set
 * to 0 (vector passes read whole groups of 8). Two queries per key row read. */
PAKV_HOT void chunk_scores(const float* queries, int64_t nq, const float* const* key_rows, int64_t nk, int64_t d,
                         float* scores) {
  for (int64_t r = 0; r < nk; r++) {
    int64_t q = 0;
    for (; q + 1 < nq; q += 2)
      dot2(queries + q * d, queries + (q + 1) * d, key_rows[r], d, &scores[q * PAKV_ATTN_CHUNK + r],
           &scores[(q + 1) * PAKV_ATTN_CHUNK + r]);
    if (q < nq) scores[q * PAKV_ATTN_CHUNK + r] = dot(queries + q * d, key_rows[r], d);
  }
  for (int64_t q = 0; q < nq; q++)
    for (int64_t r = nk; r & 7; r++) scores[q * PAKV_ATTN_CHUNK + r] = 0.0f;
}

/* Fold one query row's scores of chunk rows [r0, r1) (its visible ones) into its state. */
PAKV_HOT void fold_chunk(const pakv_attention_plan* p, part_state* s, int64_t row, float* scores, int64_t r0, int64_t r1,
                       const float* const* value_rows) {
  if (s->sum[row] != s->sum[row]) return; /* already NaN */
  const int64_t padded = (r1 + 7) & ~(int64_t)7;
  if (p->softcap > 0.0f) softcap_rows(scores, p->softcap, padded);
  for (int64_t r = 0; r < r0; r++) scores[r] = -PAKV_INF;
  for (int64_t r = r1; r < padded; r++) scores[r] = -PAKV_INF;
  float top = -PAKV_INF;
  int bad = 0, holes = 0;
  for (int64_t r = r0; r < r1; r++) {
    const float x = scores[r];
    bad |= !(x < PAKV_INF); /* NaN or +inf */
    holes |= x == -PAKV_INF;
    top = x > top ? x : top;
  }
  if (bad) {
    s->sum[row] = PAKV_NAN;
    return;
  }
  if (top == -PAKV_INF) return; /* every visible score here is -inf: nothing to add */
  float* acc = s->acc + row * s->dv;
  if (s->sum[row] > 0.0f && top > s->max[row]) { /* a new max: rescale what was summed so far */
    const float correction = exp_nonpositive(s->max[row] - top);
    s->sum[row] *= correction;
    scale_row(acc, correction, s->dv);
  }
  if (s->sum[row] == 0.0f || top > s->max[row]) s->max[row] = top;
  float* weights = s->weights;
  exp_rows(weights, scores, s->max[row], padded);
  float total = 0.0f;
  for (int64_t r = r0; r < r1; r++) total += weights[r];
  if (!holes) {
    weighted_rows(acc, weights + r0, value_rows + r0, r1 - r0, s->dv);
  } else { /* only the rows with weight: 0 x a NaN or inf value must not poison the row */
    float kept_weights[PAKV_ATTN_CHUNK];
    const float* kept_rows[PAKV_ATTN_CHUNK];
    int64_t kept = 0;
    for (int64_t r = r0; r < r1; r++)
      if (weights[r] != 0.0f) {
        kept_weights[kept] = weights[r];
        kept_rows[kept++] = value_rows[r];
      }
    weighted_rows(acc, kept_weights, kept_rows, kept, s->dv);
  }
  s->sum[row] += total;
}

/* A finished row: the state merged with the head's sink (a logit without value), divided by its
 * sum, times the value scale, written as out_type; NaN when poisoned or when nothing had weight. */
static void finish_row(const pakv_attention_plan* p, int64_t token, int64_t head, int64_t kv_head, float max, float sum,
                       float* acc) {
  const int64_t dv = p->value_head_dim;
  if (p->head_sink) {
    const float sink = p->head_sink[head];
    if (!(sink < PAKV_INF)) {
      sum = PAKV_NAN; /* a NaN or +inf logit */
    } else if (sink > -PAKV_INF) {
      if (sum > 0.0f && max >= sink) {
        sum += exp_nonpositive(sink - max);
      } else if (sum > 0.0f) {
        const float correction = exp_nonpositive(max - sink);
        sum = sum * correction + 1.0f;
        scale_row(acc, correction, dv);
      } else if (sum == 0.0f) {
        sum = 1.0f; /* the sink alone: every score -inf, the output is 0 */
      }
    }
  }
  if (!(sum > 0.0f)) {
    for (int64_t c = 0; c < dv; c++) acc[c] = PAKV_NAN;
  } else {
    const float inverse = 1.0f / sum;
    const float factor = p->value_quant == PAKV_QUANT_PER_TENSOR ? inverse * p->value_scale[0] : inverse;
    if (p->value_quant == PAKV_QUANT_PER_CHANNEL) {
      const float* channel = p->value_scale + kv_head * dv;
      for (int64_t c = 0; c < dv; c++) acc[c] *= factor * channel[c];
    } else {
      scale_row(acc, factor, dv);
    }
  }
  narrow((char*)p->out + (token * p->num_heads + head) * dv * item_size(p->out_type), acc, dv, p->out_type);
}

/* The token, head and kv head of query row `row` of a part. */
static void row_of(const pakv_attention_plan* p, const pakv_attention_part* part, int64_t tokens, int64_t group,
                   int64_t row, int64_t* token, int64_t* head, int64_t* kv_head) {
  const int64_t per_head = tokens * group;
  *kv_head = part->kv_begin + row / per_head;
  *token = p->query_starts[part->seq] + part->token_begin + (row % per_head) / group;
  *head = *kv_head * group + row % group;
}

/* On x86-64 with glibc the chunk loop is compiled for AVX2 + FMA (x86-64-v3) and for the baseline,
 * and the loader picks one per machine (an ifunc): the vector loops run 8 floats wide where the CPU
 * has it, and the library still runs on any x86-64. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__gnu_linux__) && !defined(PAKV_NO_TARGET_CLONES)
#define PAKV_ATTN_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PAKV_ATTN_CLONES
#endif

PAKV_ATTN_CLONES static int walk_chunks(const pakv_attention_plan* p, const pakv_attention_part* part, part_state* s) {
  const int64_t b = part->seq, per_head = s->tokens * s->group;
  const float* key_rows[PAKV_ATTN_CHUNK];
  const float* value_rows[PAKV_ATTN_CHUNK];
  int64_t lo, hi, first_lo, last_hi;
  pakv_visible(p, b, part->token_begin, &first_lo, &hi);
  pakv_visible(p, b, part->token_end - 1, &lo, &last_hi);
  const int64_t begin = first_lo > part->pos_begin ? first_lo : part->pos_begin;
  const int64_t end = last_hi + 1 < part->pos_end ? last_hi + 1 : part->pos_end;
  for (int64_t c0 = begin; c0 < end; c0 += PAKV_ATTN_CHUNK) {
    const int64_t c1 = end - c0 < PAKV_ATTN_CHUNK ? end : c0 + PAKV_ATTN_CHUNK;
    for (int64_t g = part->kv_begin; g < part->kv_end; g++) {
      if (load_rows(p, s, b, g, c0, c1, key_rows, value_rows)) return 1;
      const int64_t first_row = (g - part->kv_begin) * per_head;
      chunk_scores(s->queries + first_row * s->d, per_head, key_rows, c1 - c0, s->d, s->scores);
      for (int64_t q = 0; q < per_head; q++) {
        pakv_visible(p, b, part->token_begin + q / s->group, &lo, &hi);
        const int64_t r0 = (lo > c0 ? lo : c0) - c0, r1 = (hi + 1 < c1 ? hi + 1 : c1) - c0;
        if (r0 < r1) fold_chunk(p, s, first_row + q, s->scores + q * PAKV_ATTN_CHUNK, r0, r1, value_rows);
      }
    }
  }
  return 0;
}

int pakv_attention_run_part(const pakv_attention_plan* p, const pakv_attention_part* part, float* scratch,
                            float* partial) {
  part_state s;
  lay_out(p, part, scratch, &s);
  load_queries(p, part, &s);
  if (walk_chunks(p, part, &s)) return 1;
  for (int64_t row = 0; row < s.rows; row++) {
    float* acc = s.acc + row * s.dv;
    if (partial) {
      float* state = partial + row * (s.dv + 2);
      state[0] = s.max[row];
      state[1] = s.sum[row];
      memcpy(state + 2, acc, (size_t)s.dv * sizeof(float));
    } else {
      int64_t token, head, kv_head;
      row_of(p, part, s.tokens, s.group, row, &token, &head, &kv_head);
      finish_row(p, token, head, kv_head, s.max[row], s.sum[row], acc);
    }
  }
  return 0;
}

void pakv_attention_merge(const pakv_attention_plan* p, const pakv_attention_part* part, float* partials,
                          int64_t count, int64_t stride) {
  const int64_t dv = p->value_head_dim, group = p->num_heads / p->num_kv_heads;
  const int64_t tokens = part->token_end - part->token_begin;
  const int64_t rows = (part->kv_end - part->kv_begin) * tokens * group;
  for (int64_t row = 0; row < rows; row++) {
    float* first = partials + row * (dv + 2);
    float max = -PAKV_INF, sum = 0.0f;
    for (int64_t i = 0; i < count; i++) {
      const float* state = first + i * stride;
      if (state[1] != state[1]) sum = PAKV_NAN;
      if (state[1] > 0.0f && state[0] > max) max = state[0];
    }
    float* acc = first + 2; /* the merged accumulator, in the first part's state */
    if (sum == 0.0f) { /* not poisoned: every share's weight, at the common max */
      for (int64_t i = 0; i < count; i++) {
        const float* state = first + i * stride;
        if (!(state[1] > 0.0f)) {
          if (i == 0) memset(acc, 0, (size_t)dv * sizeof(float));
          continue;
        }
        const float factor = exp_nonpositive(state[0] - max);
        sum += state[1] * factor;
        if (i == 0) {
          scale_row(acc, factor, dv);
        } else {
          for (int64_t c = 0; c < dv; c++) acc[c] += factor * state[2 + c];
        }
      }
    }
    int64_t token, head, kv_head;
    row_of(p, part, tokens, group, row, &token, &head, &kv_head);
    finish_row(p, token, head, kv_head, max, sum, acc);
  }
}
