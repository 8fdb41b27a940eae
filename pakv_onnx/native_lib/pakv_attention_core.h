/* What the attention core's units share (pakv_attention_check.c, pakv_attention_part.c,
 * pakv_attention.c); not part of the library's interface (that is pakv_core.h). */
#ifndef PAKV_ATTENTION_CORE_H
#define PAKV_ATTENTION_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "pakv_core.h"

/* Block table entry (b, c), read once (the caller may be writing the table while the core runs). */
static inline int64_t pakv_table_entry(const pakv_attention_plan* p, int64_t b, int64_t c) {
  const char* at = (const char*)p->block_tables + b * p->table_row_stride + c * p->table_col_stride;
  if (p->tables64) return *(const volatile int64_t*)at;
  return (int64_t) * (const volatile int32_t*)at;
}

/* The positions new token j of sequence b sees: [*lo, *hi] (never empty: lo <= p <= hi for its own
 * position p = L - n + j). Causal: hi = p, else L - 1; a window w >= 0: lo = max(0, p - w). */
static inline void pakv_visible(const pakv_attention_plan* p, int64_t b, int64_t j, int64_t* lo, int64_t* hi) {
  const int64_t length = p->context_lens[b], position = length - p->query_counts[b] + j;
  *hi = p->causal ? position : length - 1;
  *lo = p->window >= 0 && position > p->window ? position - p->window : 0;
}

/* 1 when the walk dequantizes a side of quantization `quant` itself, each element rounded to the
 * plan's dequantized_type (ORT's CUDA arithmetic): its scale is then folded neither into the queries
 * (K) nor into the finished rows (V). */
static inline int pakv_rounds_dequantized(const pakv_attention_plan* p, int32_t quant) {
  return p->dequantized_type != 0 && quant != PAKV_QUANT_NONE;
}

/* Key positions per online-softmax step of a part (a chunk: its K rows, transposed, and V rows stay
 * in L1/L2 while the part's queries read them). A multiple of every walk's column block. */
#define PAKV_ATTN_CHUNK 64
/* Widest vector of any walk unit, in floats: K rows are widened with zero padding to a multiple. */
#define PAKV_ATTN_MAX_W 16

/* One part of a run: new tokens [token_begin, token_end) of sequence seq, the query heads of kv
 * heads [kv_begin, kv_end), over context positions [pos_begin, pos_end) (the whole of what those
 * tokens see, or a share of it when a long context is split over threads). */
typedef struct {
  int64_t seq, token_begin, token_end, kv_begin, kv_end, pos_begin, pos_end;
} pakv_attention_part;

/* A part's working state, laid out in a thread's scratch by pakv_attention_part.c and advanced
 * chunk by chunk by a walk unit (pakv_attention_walk.h, compiled once per vector width). Query rows
 * are ordered (kv head, token, head of the group): the rows that share a kv head are contiguous. */
typedef struct {
  int64_t rows, tokens, group, d, dv; /* rows = kv heads x tokens x group */
  int64_t dp;                         /* d rounded up to PAKV_ATTN_MAX_W: widened K rows' stride */
  float* queries;                     /* [rows][d]: q x scale x key scale */
  float* acc;                         /* [rows][dv] */
  float* max;                         /* [rows] */
  float* sum;                         /* [rows]: 0 until a finite score, NaN once poisoned */
  float* scores;                      /* [tokens x group][CHUNK]: one kv head's rows, then their weights */
  float* key_rows;                    /* [CHUNK + 1][dp]: widened K rows; the last one stays zero */
  float* keys_t;                      /* [dp][CHUNK]: the chunk's K, transposed */
  float* values;                      /* [CHUNK][dv]: widened V rows */
  const float** value_rows;           /* [CHUNK] */
} pakv_part_state;

/* Advance a part's state over its positions (pakv_attention_part's rows): 0, or 1 when a block id
 * read there is outside [0, num_blocks). One per vector width: 8 floats (pakv_attention_walk.c,
 * AVX2 + FMA or the baseline, by ifunc), 16 (pakv_attention_walk16.c, x86-64 with AVX-512 only). */
int pakv_attention_walk8(const pakv_attention_plan* p, const pakv_attention_part* part, pakv_part_state* s);
int pakv_attention_walk16(const pakv_attention_plan* p, const pakv_attention_part* part, pakv_part_state* s);
/* 1 when this build has the 16-float walk and the CPU runs it. */
int pakv_attention_walk16_usable(void);

/* A part's size in scratch floats for at most `tokens` tokens and `kv_heads` kv heads (and pointer
 * room for its row table), or -1 when that overflows the address space. */
int64_t pakv_attention_part_floats(const pakv_attention_plan* p, int64_t tokens, int64_t kv_heads);

/* Run one part of a checked plan with `scratch` (pakv_attention_part_floats of it). Each query row
 * (token, head) ends as its softmax state: with `partial` NULL it is finished (the sink, 1 / sum, the
 * value scale) and written to the plan's output; else stored at partial + row * (value_head_dim + 2)
 * as {max, sum, acc[value_head_dim]} (rows ordered kv head, token, head of the group) for
 * pakv_attention_merge. Returns 0, or 1 when a block id read here is outside [0, num_blocks) (the
 * table changed since the check). */
int pakv_attention_run_part(const pakv_attention_plan* p, const pakv_attention_part* part, float* scratch,
                            float* partial);

/* Merge `count` partial states (the same rows of parts over disjoint position ranges, `stride`
 * floats apart) of the part shape `part` (its position range ignored), add the sink, and write the
 * finished rows to the plan's output. The merged accumulators are left in the first state. */
void pakv_attention_merge(const pakv_attention_plan* p, const pakv_attention_part* part, float* partials,
                          int64_t count, int64_t stride);

#endif /* PAKV_ATTENTION_CORE_H */
