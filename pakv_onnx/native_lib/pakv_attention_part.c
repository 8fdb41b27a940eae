/* One part of a paged attention (pakv_attention_core.h): the query rows of some new tokens of one
 * sequence and some kv heads, over a range of their context. This unit lays out the part's state in
 * a thread's scratch, loads its queries, has a walk unit advance it over the positions (the vector
 * width the CPU runs best: pakv_attention_walk.h), and finishes each row. No ORT, no Python, no libm.
 *
 * The scores' scale and a key scale are folded into the query ((q x s) . k), a value scale into the
 * finished row (unless the walk dequantizes that side itself: pakv_rounds_dequantized). A row's state
 * is the online softmax's (running max, running sum, fp32 accumulator); a part over a share of a
 * long context leaves it for pakv_attention_merge. The sink joins at the end as one more logit
 * without value: NaN or +inf poisons the row, -inf is no sink, and a finite sink with every score
 * -inf gives the row 0 (its own weight is the whole denominator). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "pakv_attention_core.h"
#include "pakv_float.h"
#include "pakv_vec.h"

typedef int (*pakv_walk_fn)(const pakv_attention_plan*, const pakv_attention_part*, pakv_part_state*);

#define PAKV_INF __builtin_inff()
#define PAKV_NAN __builtin_nanf("")

static void scale_row(float* y, float a, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] *= a;
}

int64_t pakv_attention_part_floats(const pakv_attention_plan* p, int64_t tokens, int64_t kv_heads) {
  const int64_t group = p->num_heads / p->num_kv_heads, chunk = PAKV_ATTN_CHUNK, w = PAKV_ATTN_MAX_W;
  int64_t rows, per_row, total, term, dp;
  if (pakv_add(p->head_dim, w - 1, &dp)) return -1;
  dp -= dp % w;
  /* queries [rows][d], acc [rows][dv], max and sum [rows]; scores [tokens x group][C]; key rows
   * [C + 1][dp]; keys_t [dp][C]; values [C][dv]; value row pointers [C] (2 floats each) and room to
   * align. */
  if (pakv_mul(tokens, kv_heads, &rows) || pakv_mul(rows, group, &rows) || pakv_add(p->head_dim, p->value_head_dim, &per_row) ||
      pakv_add(per_row, 2, &per_row) || pakv_mul(rows, per_row, &total) || pakv_mul(tokens, group, &term) ||
      pakv_mul(term, chunk, &term) || pakv_add(total, term, &total) || pakv_mul(dp, 2 * chunk + 1, &term) ||
      pakv_add(total, term, &total) || pakv_mul(p->value_head_dim, chunk, &term) || pakv_add(total, term, &total) ||
      pakv_add(total, 2 * chunk + 2 * w, &total) || (uint64_t)total > SIZE_MAX / sizeof(float))
    return -1;
  return total;
}

static float* aligned(float* at) { return (float*)(((uintptr_t)at + 63) & ~(uintptr_t)63); }

static void lay_out(const pakv_attention_plan* p, const pakv_attention_part* part, float* scratch, pakv_part_state* s) {
  s->tokens = part->token_end - part->token_begin;
  s->group = p->num_heads / p->num_kv_heads;
  s->rows = (part->kv_end - part->kv_begin) * s->tokens * s->group;
  s->d = p->head_dim;
  s->dv = p->value_head_dim;
  s->dp = (s->d + PAKV_ATTN_MAX_W - 1) / PAKV_ATTN_MAX_W * PAKV_ATTN_MAX_W;
  s->value_rows = (const float**)aligned(scratch);
  s->keys_t = aligned((float*)(s->value_rows + PAKV_ATTN_CHUNK));
  s->key_rows = s->keys_t + s->dp * PAKV_ATTN_CHUNK;
  s->scores = s->key_rows + (PAKV_ATTN_CHUNK + 1) * s->dp;
  s->values = s->scores + s->tokens * s->group * PAKV_ATTN_CHUNK;
  s->queries = s->values + PAKV_ATTN_CHUNK * s->dv;
  s->acc = s->queries + s->rows * s->d;
  s->max = s->acc + s->rows * s->dv;
  s->sum = s->max + s->rows;
  /* keys_t's columns past a short chunk and the zero key row (padding rows read) stay finite. */
  memset(s->keys_t, 0, sizeof(float) * (size_t)(s->dp * (2 * PAKV_ATTN_CHUNK + 1)));
}

/* The part's query rows (kv head, token, head of the group), widened, times the scores' scale and
 * the key scale (per tensor, or per channel of the row's kv head; none when the walk dequantizes K
 * itself); states empty. */
static void load_queries(const pakv_attention_plan* p, const pakv_attention_part* part, pakv_part_state* s) {
  const int32_t folded = pakv_rounds_dequantized(p, p->key_quant) ? PAKV_QUANT_NONE : p->key_quant;
  float* row = s->queries;
  for (int64_t g = part->kv_begin; g < part->kv_end; g++) {
    const float* channel = folded == PAKV_QUANT_PER_CHANNEL ? p->key_scale + g * s->d : NULL;
    const float factor = p->scale * (folded == PAKV_QUANT_PER_TENSOR ? p->key_scale[0] : 1.0f);
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

/* A finished row: the state merged with the head's sink (a logit without value), divided by its
 * sum, times the value scale (none when the walk dequantizes V itself), written as out_type; NaN when
 * poisoned or when nothing had weight. */
static void finish_row(const pakv_attention_plan* p, int64_t token, int64_t head, int64_t kv_head, float max, float sum,
                       float* acc) {
  const int64_t dv = p->value_head_dim;
  const int32_t folded = pakv_rounds_dequantized(p, p->value_quant) ? PAKV_QUANT_NONE : p->value_quant;
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
    const float factor = folded == PAKV_QUANT_PER_TENSOR ? inverse * p->value_scale[0] : inverse;
    if (folded == PAKV_QUANT_PER_CHANNEL) {
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

/* The walk of the widest vectors this build and CPU have (PAKV_ONNX_ATTENTION_WIDTH=8 forces the
 * 8-float one: tests run both). */
static pakv_walk_fn g_walk = pakv_attention_walk8;
static pthread_once_t g_walk_once = PTHREAD_ONCE_INIT;

static void choose_walk(void) {
  const char* forced = getenv("PAKV_ONNX_ATTENTION_WIDTH");
  if (pakv_attention_walk16_usable() && !(forced && strcmp(forced, "8") == 0)) g_walk = pakv_attention_walk16;
}

int pakv_attention_run_part(const pakv_attention_plan* p, const pakv_attention_part* part, float* scratch,
                            float* partial) {
  pakv_part_state s;
  pthread_once(&g_walk_once, choose_walk);
  lay_out(p, part, scratch, &s);
  load_queries(p, part, &s);
  if (g_walk(p, part, &s)) return 1;
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
