/* The attention core of PagedAttention: causal attention of each sequence's new tokens over its
 * whole context, read from the paged caches in place through the block table (no gather, no
 * copy of a context). No ONNX Runtime, no Python, no libm. See pakv_core.h for the plan.
 *
 * Work is cut into parts of (sequence, kv head, tile of query tokens): the Hq / Hk query heads
 * that share a kv head (GQA) are one part's queries, so each K/V row a part reads serves all of
 * them. A part walks the context in chunks of PAKV_ATTN_CHUNK positions with an online softmax
 * (running max, running sum, fp32 accumulator per query): exact softmax, memory independent of
 * the context length. Inner loops run over contiguous fp32 rows (16-bit rows are widened once per
 * chunk), in 8-float vectors (GCC/clang vector extensions: one AVX register, or two SSE / NEON
 * ones) so accumulators stay in registers; two queries (GQA heads) share each key row read.
 *
 * Parts run on ORT's intra-op pool when the caller gives one (pakv_parallel) and the call is big
 * enough, else on the calling thread. Each thread keeps one scratch buffer (grown on demand, freed
 * when the thread ends): no allocation per call beyond the parts' index when parallel. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pakv_core.h"
#include "pakv_float.h"
#include "pakv_vec.h"

/* Key positions per online-softmax step (their rows stay in L1 while every query of the part reads them). */
#define PAKV_ATTN_CHUNK 32
/* Queries (tokens x the heads of one kv head) per part. */
#define PAKV_ATTN_TILE_QUERIES 16

/* ------------------------------------------------------------------------------------------- */
/* Per-thread scratch                                                                          */
/* ------------------------------------------------------------------------------------------- */
typedef struct {
  size_t floats;
  float data[];
} scratch_block;

static pthread_key_t g_scratch_key;
static pthread_once_t g_scratch_once = PTHREAD_ONCE_INIT;
static int g_scratch_key_ok;

static void free_scratch(void* block) { free(block); }
static void make_scratch_key(void) { g_scratch_key_ok = pthread_key_create(&g_scratch_key, free_scratch) == 0; }

/* This thread's scratch of at least `floats` floats, or NULL (out of memory). */
static float* thread_scratch(size_t floats) {
  pthread_once(&g_scratch_once, make_scratch_key);
  if (!g_scratch_key_ok) return NULL;
  scratch_block* block = (scratch_block*)pthread_getspecific(g_scratch_key);
  if (block && block->floats >= floats) return block->data;
  if (floats > (SIZE_MAX - sizeof(scratch_block)) / sizeof(float)) return NULL;
  scratch_block* grown = (scratch_block*)malloc(sizeof(scratch_block) + floats * sizeof(float));
  if (!grown) return NULL;
  grown->floats = floats;
  if (pthread_setspecific(g_scratch_key, grown)) {
    free(grown);
    return NULL;
  }
  free(block);
  return grown->data;
}

/* ------------------------------------------------------------------------------------------- */
/* Checks                                                                                      */
/* ------------------------------------------------------------------------------------------- */
static inline int64_t table_entry(const pakv_attention_plan* p, int64_t b, int64_t c) {
  const char* at = (const char*)p->block_tables + b * p->table_row_stride + c * p->table_col_stride;
  if (p->tables64) return *(const volatile int64_t*)at; /* one read: the caller may be writing it */
  return (int64_t) * (const volatile int32_t*)at;
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

static int is_float_type(int32_t t) { return t == ONNX_FLOAT || t == ONNX_FLOAT16 || t == ONNX_BFLOAT16; }

int pakv_check_attention_plan(const pakv_attention_plan* p, pakv_err* err) {
  if (!p) return pakv_fail(err, "NULL attention plan");
  if (p->abi_version != PAKV_ABI_VERSION || p->struct_size != sizeof(pakv_attention_plan))
    return pakv_fail(err, "attention plan ABI mismatch: caller has version %u / %u bytes, library has %d / %zu bytes",
                     p->abi_version, p->struct_size, PAKV_ABI_VERSION, sizeof(pakv_attention_plan));
  if (!is_float_type(p->query_type) || !is_float_type(p->out_type))
    return pakv_fail(err,
                     "attention plan: query type %d / output type %d: each must be float32 (1), float16 (10) or "
                     "bfloat16 (16)",
                     p->query_type, p->out_type);
  /* What this core computes today; the plan's other features (quantized caches, mixed types,
   * softcap, window, sinks, non-causal) are refused here until the core implements them. */
  if (p->key_type != p->query_type || p->value_type != p->query_type || p->out_type != p->query_type ||
      p->key_quant != PAKV_QUANT_NONE || p->value_quant != PAKV_QUANT_NONE || p->softcap != 0.0f ||
      p->window != -1 || p->head_sink || p->causal != 1)
    return pakv_fail(err, "attention plan: a feature this attention core does not implement yet (types %d/%d/%d/%d, "
                     "quant %d/%d, softcap, window %lld, sinks, causal %d)",
                     p->query_type, p->key_type, p->value_type, p->out_type, p->key_quant, p->value_quant,
                     (long long)p->window, p->causal);
  if (p->block_size < 1 || p->num_blocks < 0 || p->num_heads < 0 || p->num_kv_heads < 1 || p->head_dim < 0 ||
      p->value_head_dim < 0 || p->num_tokens < 0 || p->num_seqs < 0 || p->table_cols < 0 ||
      p->num_heads % p->num_kv_heads)
    return pakv_fail(err,
                     "attention plan: sizes out of range (block_size %lld, num_blocks %lld, heads %lld / %lld, "
                     "dims %lld / %lld, tokens %lld, sequences %lld, columns %lld)",
                     (long long)p->block_size, (long long)p->num_blocks, (long long)p->num_heads,
                     (long long)p->num_kv_heads, (long long)p->head_dim, (long long)p->value_head_dim,
                     (long long)p->num_tokens, (long long)p->num_seqs, (long long)p->table_cols);
  if (cache_extent(p, p->key_block_stride, p->key_row_stride, p->key_head_stride, p->head_dim, p->key_type) < 0 ||
      cache_extent(p, p->value_block_stride, p->value_row_stride, p->value_head_stride, p->value_head_dim,
                   p->value_type) < 0)
    return pakv_fail(err, "attention plan: a cache's %lld blocks overflow int64 byte offsets (or a negative stride)",
                     (long long)p->num_blocks);
  int64_t row, span, out_bytes;
  if (p->query_token_stride < 0 || p->query_head_stride < 0 || pakv_mul(p->num_heads - (p->num_heads > 0), p->query_head_stride, &row) ||
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
  if (p->num_seqs > 0 && (!p->query_starts || !p->query_counts || !p->context_lens))
    return pakv_fail(err, "attention plan: a NULL per-sequence array for %lld sequences", (long long)p->num_seqs);
  int any = 0;
  for (int64_t b = 0; b < p->num_seqs; b++) {
    int64_t start = p->query_starts[b], n = p->query_counts[b], length = p->context_lens[b];
    if (n < 0 || start < 0 || start > p->num_tokens || n > p->num_tokens - start || length < n)
      return pakv_fail(err, "attention plan: sequence %lld has query rows [%lld, +%lld) of %lld and a context of %lld",
                       (long long)b, (long long)start, (long long)n, (long long)p->num_tokens, (long long)length);
    if (n == 0) continue;
    any = 1;
    int64_t need = length / p->block_size + (length % p->block_size != 0);
    if (need > p->table_cols || !p->block_tables)
      return pakv_fail(err, "attention plan: sequence %lld reads %lld block-table columns of %lld", (long long)b,
                       (long long)need, (long long)p->table_cols);
    for (int64_t c = 0; c < need; c++) {
      int64_t block = table_entry(p, b, c);
      if (block < 0 || block >= p->num_blocks)
        return pakv_fail(err,
                         "attention plan: block_tables changed after validation (or the plan is not the "
                         "validator's): entry (%lld, %lld) = %lld is outside [0, %lld)",
                         (long long)b, (long long)c, (long long)block, (long long)p->num_blocks);
    }
  }
  if (any && p->num_heads > 0 && (!p->query || !p->key_cache || !p->value_cache))
    return pakv_fail(err, "attention plan: a NULL input pointer for a non-empty attention");
  return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* One part: (sequence b, kv head, query tokens [j0, j1) of the sequence)                      */
/* ------------------------------------------------------------------------------------------- */
typedef struct {
  int64_t group, queries, chunk_floats; /* heads per kv head; queries of a full tile; floats below */
  size_t floats;                        /* scratch per part */
} part_shape;

static int shape_of(const pakv_attention_plan* p, int64_t tile_tokens, part_shape* s) {
  int64_t d = p->head_dim, dv = p->value_head_dim, per_query, per_row, total;
  s->group = p->num_heads / p->num_kv_heads;
  s->queries = tile_tokens * s->group;
  /* qf [Q x D], acc [Q x Dv], max and sum [Q], scores [Q x C]; weights [C], widened rows [C x (D + Dv)]. */
  if (pakv_add(d, dv, &per_row) || pakv_add(per_row, 2 + PAKV_ATTN_CHUNK, &per_query) ||
      pakv_mul(per_query, s->queries, &total) || pakv_add(per_row, 1, &per_row) ||
      pakv_mul(per_row, PAKV_ATTN_CHUNK, &per_row) ||
      pakv_add(total, per_row, &total) || (uint64_t)total > SIZE_MAX / sizeof(float))
    return -1;
  s->chunk_floats = per_row;
  s->floats = (size_t)total;
  return 0;
}

/* On x86-64 with glibc the part is compiled twice, for AVX2 + FMA (x86-64-v3) and for the baseline,
 * and the loader picks one per machine (an ifunc): the plain C loops above vectorize 8 floats wide
 * where the CPU has it, and the library still runs on any x86-64. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__gnu_linux__) && !defined(PAKV_NO_TARGET_CLONES)
#define PAKV_ATTN_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PAKV_ATTN_CLONES
#endif

#define PAKV_INF __builtin_inff()

/* A chunk's positions whose score is -inf are absent: weight exactly 0 and their value rows never read
 * (0 x NaN would poison the row). Keeps the others' weights and rows, in order; returns how many. */
static int64_t drop_absent(float* weights, const float* scores, const float* const* rows, const float** kept,
                           int64_t count) {
  int64_t n = 0;
  for (int64_t r = 0; r < count; r++)
    if (scores[r] != -PAKV_INF) {
      weights[n] = weights[r];
      kept[n++] = rows[r];
    }
  return n;
}

/* Returns 0, or 1 when a block id read here is outside [0, num_blocks) (the table changed). */
PAKV_ATTN_CLONES static int attend_part(const pakv_attention_plan* p, const part_shape* shape, float* scratch, int64_t b, int64_t kv_head,
                       int64_t j0, int64_t j1) {
  const int64_t d = p->head_dim, dv = p->value_head_dim, bs = p->block_size, group = shape->group;
  const int64_t n = p->query_counts[b], length = p->context_lens[b];
  const int64_t past = length - n, queries = (j1 - j0) * group, first_head = kv_head * group;
  const int64_t key_row = p->key_row_stride, value_row = p->value_row_stride;
  const int fp32 = p->key_type == ONNX_FLOAT && p->value_type == ONNX_FLOAT;
  float* qf = scratch;
  float* acc = qf + queries * d;
  float* run_max = acc + queries * dv;
  float* run_sum = run_max + queries;
  float* scores = run_sum + queries; /* [queries][CHUNK] */
  float* weights = scores + queries * PAKV_ATTN_CHUNK;
  float* kf = weights + PAKV_ATTN_CHUNK;
  float* vf = kf + PAKV_ATTN_CHUNK * d;
  const float* key_rows[PAKV_ATTN_CHUNK];
  const float* value_rows[PAKV_ATTN_CHUNK];
  const float* live_rows[PAKV_ATTN_CHUNK];

  for (int64_t q = 0; q < queries; q++) {
    int64_t token = p->query_starts[b] + j0 + q / group, head = first_head + q % group;
    widen(qf + q * d, (const char*)p->query + token * p->query_token_stride + head * p->query_head_stride, d,
          p->query_type);
    run_max[q] = 0.0f; /* set by the first chunk (run_sum 0 marks "no chunk yet") */
    run_sum[q] = 0.0f;
  }
  memset(acc, 0, (size_t)(queries * dv) * sizeof(float));

  const int64_t end = past + j1; /* positions [0, end) serve the tile's last token */
  for (int64_t c0 = 0; c0 < end; c0 += PAKV_ATTN_CHUNK) {
    const int64_t c1 = end - c0 < PAKV_ATTN_CHUNK ? end : c0 + PAKV_ATTN_CHUNK;
    /* The chunk's K/V rows of this kv head: pointers into the caches (fp32) or widened copies. */
    for (int64_t pos = c0; pos < c1;) {
      int64_t slot = pos % bs, run = bs - slot < c1 - pos ? bs - slot : c1 - pos;
      int64_t block = table_entry(p, b, pos / bs);
      if (block < 0 || block >= p->num_blocks) return 1;
      const char* k = (const char*)p->key_cache + block * p->key_block_stride + slot * key_row + kv_head * p->key_head_stride;
      const char* v =
          (const char*)p->value_cache + block * p->value_block_stride + slot * value_row + kv_head * p->value_head_stride;
      for (int64_t r = 0; r < run; r++, pos++, k += key_row, v += value_row) {
        int64_t i = pos - c0;
        if (fp32) {
          key_rows[i] = (const float*)k;
          value_rows[i] = (const float*)v;
        } else {
          widen(kf + i * d, k, d, p->key_type);
          widen(vf + i * dv, v, dv, p->value_type);
          key_rows[i] = kf + i * d;
          value_rows[i] = vf + i * dv;
        }
      }
    }
    /* Every query's scores of the chunk's rows (a tile's later tokens see a little more than its
     * earlier ones: masked below), two queries per key row read. */
    for (int64_t r = 0; r < c1 - c0; r++) {
      int64_t q = 0;
      for (; q + 1 < queries; q += 2)
        dot2(qf + q * d, qf + (q + 1) * d, key_rows[r], d, &scores[q * PAKV_ATTN_CHUNK + r],
             &scores[(q + 1) * PAKV_ATTN_CHUNK + r]);
      if (q < queries) scores[q * PAKV_ATTN_CHUNK + r] = dot(qf + q * d, key_rows[r], d);
    }
    for (int64_t q = 0; q < queries; q++) {
      const int64_t limit = past + j0 + q / group + 1; /* positions [0, limit) are visible */
      if (limit <= c0 || run_sum[q] != run_sum[q]) continue; /* nothing visible here, or poisoned */
      const int64_t rows = (limit < c1 ? limit : c1) - c0;
      float* row_scores = scores + q * PAKV_ATTN_CHUNK;
      float chunk_max = -PAKV_INF;
      int poisoned = 0, absent = 0;
      for (int64_t r = 0; r < rows; r++) {
        float s = row_scores[r] * p->scale;
        row_scores[r] = s;
        chunk_max = s > chunk_max ? s : chunk_max;
        poisoned |= !(s < PAKV_INF); /* NaN or +inf */
        absent |= s == -PAKV_INF;
      }
      if (poisoned) { /* a NaN or +inf score: the row is NaN (the non-finite rules, docs/reliability.md) */
        run_sum[q] = bits_to_float(0x7FC00000u);
        continue;
      }
      if (chunk_max == -PAKV_INF) continue; /* every visible score -inf: weight 0, nothing read */
      float* out = acc + q * dv;
      float top = run_sum[q] > 0.0f && run_max[q] > chunk_max ? run_max[q] : chunk_max;
      if (run_sum[q] > 0.0f && top > run_max[q]) { /* a new max: rescale what was summed so far */
        v8f gap = splat8(run_max[q] - top);
        float correction = exp8_nonpositive(&gap)[0];
        run_sum[q] *= correction;
        scale_row(out, correction, dv);
      }
      run_max[q] = top;
      for (int64_t r = rows; r < PAKV_ATTN_CHUNK && (r & 7); r++) row_scores[r] = top; /* exp_rows reads 8 at a time */
      exp_rows(weights, row_scores, top, rows);
      const float* const* live = value_rows;
      int64_t count = rows;
      if (absent) count = drop_absent(weights, row_scores, value_rows, live_rows, rows), live = live_rows;
      float sum = 0.0f;
      for (int64_t r = 0; r < count; r++) sum += weights[r];
      weighted_rows(out, weights, live, count, dv);
      run_sum[q] += sum;
    }
  }
  for (int64_t q = 0; q < queries; q++) {
    int64_t token = p->query_starts[b] + j0 + q / group, head = first_head + q % group;
    float* row = acc + q * dv;
    scale_row(row, 1.0f / run_sum[q], dv); /* run_sum >= 1 (the max's own weight), or NaN */
    narrow((char*)p->out + (token * p->num_heads + head) * dv * item_size(p->out_type), row, dv, p->out_type);
  }
  return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* The run                                                                                     */
/* ------------------------------------------------------------------------------------------- */
/* Calls smaller than this many multiply-adds (sum over queries of context x (D + Dv)) never enter
 * a parallel region: waking ORT's threads costs more than they would save. */
static int64_t g_attention_parallel_min = (int64_t)1 << 18;
static pthread_once_t g_config_once = PTHREAD_ONCE_INIT;

static void read_config(void) {
  const char* s = getenv("PAKV_ONNX_ATTENTION_PARALLEL_MIN");
  if (s && *s) g_attention_parallel_min = strtoll(s, NULL, 10);
}

typedef struct {
  const pakv_attention_plan* plan;
  part_shape shape;
  int64_t tile_tokens;
  const int64_t* first_part; /* [B+1]: index of each sequence's first part */
  atomic_int bad, no_memory;
} parallel_run;

static int64_t tiles_of(int64_t n, int64_t tile_tokens) { return n / tile_tokens + (n % tile_tokens != 0); }

static void run_part(void* data, size_t index) {
  parallel_run* run = (parallel_run*)data;
  const pakv_attention_plan* p = run->plan;
  /* The sequence: the last b with first_part[b] <= part (then part < first_part[b+1]; sequences
   * without parts share their successor's first_part and are passed over). */
  int64_t part = (int64_t)index, lo = 0, hi = p->num_seqs;
  while (hi - lo > 1) {
    int64_t mid = lo + (hi - lo) / 2;
    if (run->first_part[mid] <= part) lo = mid; else hi = mid;
  }
  int64_t tiles = tiles_of(p->query_counts[lo], run->tile_tokens), local = part - run->first_part[lo];
  int64_t kv_head = local / tiles, tile = local % tiles;
  int64_t j0 = tile * run->tile_tokens, j1 = j0 + run->tile_tokens;
  if (j1 > p->query_counts[lo]) j1 = p->query_counts[lo];
  float* scratch = thread_scratch(run->shape.floats);
  if (!scratch) {
    atomic_store(&run->no_memory, 1);
    return;
  }
  if (attend_part(p, &run->shape, scratch, lo, kv_head, j0, j1)) atomic_store(&run->bad, 1);
}

int pakv_run_attention_on(const pakv_attention_plan* p, const pakv_parallel* par, pakv_err* err) {
  if (p->num_tokens == 0 || p->num_heads == 0 || p->value_head_dim == 0) return 0; /* an empty output */
  if (!p->out) return pakv_fail(err, "attention: a NULL output pointer for a non-empty attention");
  pthread_once(&g_config_once, read_config);
  const int64_t group = p->num_heads / p->num_kv_heads;
  parallel_run run;
  memset(&run, 0, sizeof(run));
  run.plan = p;
  run.tile_tokens = group >= PAKV_ATTN_TILE_QUERIES ? 1 : PAKV_ATTN_TILE_QUERIES / group;
  if (shape_of(p, run.tile_tokens, &run.shape))
    return pakv_fail(err, "attention: a scratch for head_dim %lld / %lld overflows the address space",
                     (long long)p->head_dim, (long long)p->value_head_dim);
  int64_t parts = 0, work = 0, term;
  for (int64_t b = 0; b < p->num_seqs; b++) {
    parts += p->num_kv_heads * tiles_of(p->query_counts[b], run.tile_tokens); /* <= N x Hk x Hq: fits */
    if (work < g_attention_parallel_min &&
        (pakv_mul(p->query_counts[b], p->context_lens[b], &term) || pakv_mul(term, p->num_heads, &term) ||
         pakv_mul(term, p->head_dim + p->value_head_dim + 1, &term) || pakv_add(work, term, &work)))
      work = INT64_MAX;
  }
  int64_t* first_part = NULL;
  if (par && parts >= 2 && work >= g_attention_parallel_min && (size_t)p->num_seqs < SIZE_MAX / sizeof(int64_t) - 1)
    first_part = (int64_t*)malloc(((size_t)p->num_seqs + 1) * sizeof(int64_t));
  if (first_part) {
    first_part[0] = 0;
    for (int64_t b = 0; b < p->num_seqs; b++)
      first_part[b + 1] = first_part[b] + p->num_kv_heads * tiles_of(p->query_counts[b], run.tile_tokens);
    run.first_part = first_part;
    if (par->run(par->host, run_part, (size_t)parts, &run)) {
      for (int64_t i = 0; i < parts; i++) run_part(&run, (size_t)i); /* the pool ran none: here */
    }
    free(first_part);
  } else {
    float* scratch = thread_scratch(run.shape.floats);
    if (!scratch) return pakv_fail(err, "attention: out of memory for a scratch of %zu floats", run.shape.floats);
    for (int64_t b = 0; b < p->num_seqs; b++)
      for (int64_t h = 0; h < p->num_kv_heads; h++)
        for (int64_t j0 = 0; j0 < p->query_counts[b]; j0 += run.tile_tokens) {
          int64_t j1 = p->query_counts[b] - j0 < run.tile_tokens ? p->query_counts[b] : j0 + run.tile_tokens;
          if (attend_part(p, &run.shape, scratch, b, h, j0, j1)) atomic_store(&run.bad, 1);
        }
  }
  if (atomic_load(&run.no_memory))
    return pakv_fail(err, "attention: out of memory for a thread's scratch of %zu floats", run.shape.floats);
  if (atomic_load(&run.bad))
    return pakv_fail(err,
                     "block_tables changed while the attention ran: an entry read during the run is outside [0, "
                     "%lld) (it was valid when checked); the output is incomplete",
                     (long long)p->num_blocks);
  return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* Exported entry points (the native Python backend; see pakv_onnx/native_lib/__init__.py)     */
/* ------------------------------------------------------------------------------------------- */
PAKV_EXPORT size_t pakv_attention_plan_size(void) { return sizeof(pakv_attention_plan); }

PAKV_EXPORT int pakv_attention(const pakv_attention_plan* plan, char* err_out, size_t err_len) {
  pakv_err err;
  err.msg[0] = 0;
  int rc = pakv_check_attention_plan(plan, &err);
  if (!rc) rc = pakv_run_attention_on(plan, NULL, &err);
  if (rc && err_out && err_len) {
    size_t n = strlen(err.msg);
    if (n >= err_len) n = err_len - 1;
    memcpy(err_out, err.msg, n);
    err_out[n] = 0;
  }
  return rc;
}
