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

/* Key positions per online-softmax step of a part (their rows stay in L1 while the part's queries
 * read them). */
#define PAKV_ATTN_CHUNK 32

/* One part of a run: new tokens [token_begin, token_end) of sequence seq, the query heads of kv
 * heads [kv_begin, kv_end), over context positions [pos_begin, pos_end) (the whole of what those
 * tokens see, or a share of it when a long context is split over threads). */
typedef struct {
  int64_t seq, token_begin, token_end, kv_begin, kv_end, pos_begin, pos_end;
} pakv_attention_part;

/* A part's size in scratch floats for at most `tokens` tokens and `kv_heads` kv heads, or -1 when
 * that overflows the address space. */
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
