/* The attention core's run: a checked plan (pakv_attention_check.c) cut into parts
 * (pakv_attention_part.c runs one), on ORT's intra-op pool or on the calling thread. No ONNX Runtime,
 * no Python, no libm. See pakv_core.h for the plan.
 *
 * Parts are (sequence, tile of new tokens, group of kv heads, share of the context): the Hq / Hk
 * query heads that share a kv head (GQA) are one part's queries, so each K/V row a part reads serves
 * all of them; a decode token's part covers every kv head (each block read once, contiguously) and
 * a long context is split in shares merged afterwards. Parts run on ORT's intra-op pool when the
 * caller gives one (pakv_parallel) and the call is big enough, else on the calling thread: the same
 * parts either way, so the same bytes. Each thread keeps one scratch buffer (grown on demand, freed when the thread
 * ends): no allocation per call beyond the parts' index when parallel. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pakv_attention_core.h"

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
/* The run                                                                                     */
/* ------------------------------------------------------------------------------------------- */
/* Calls smaller than this many multiply-adds (sum over queries of context x (D + Dv)) never enter
 * a parallel region: waking ORT's threads costs more than they would save. */
static int64_t g_attention_parallel_min = (int64_t)1 << 18;
/* A run whose parts, merges and partial rows fit in this many bytes keeps them on the stack. */
#define PAKV_ATTENTION_STACK_BYTES 4096
static pthread_once_t g_config_once = PTHREAD_ONCE_INIT;

static void read_config(void) {
  const char* s = getenv("PAKV_ONNX_ATTENTION_PARALLEL_MIN");
  if (s && *s) g_attention_parallel_min = strtoll(s, NULL, 10);
}

/* Rows (tokens x the heads of a group) a tile of new tokens gives each kv head, and the most rows a
 * part holds (its kv heads x the tile's rows: a decode token takes every kv head, so each block is
 * read once, contiguously, for all heads that share it). */
#define PAKV_ATTN_TILE_ROWS 64
#define PAKV_ATTN_PART_ROWS 256
/* A sequence of one tile (decode) is split over its context in shares of at least this many
 * positions (whole chunks), at most PAKV_ATTN_MAX_SPLITS, merged afterwards: threads share even one
 * long sequence. The split depends on the plan alone, so every thread count gives the same bytes. */
#define PAKV_ATTN_SPLIT_MIN 256
#define PAKV_ATTN_MAX_SPLITS 16

/* How one sequence is cut: tiles of tile_tokens tokens, kv heads in groups of kv_span, and (one
 * tile only) its positions [begin, end) in `splits` shares of split_len. */
typedef struct {
  int64_t tile_tokens, tiles, kv_span, kv_groups, splits, split_len, begin, end;
} seq_cut;

static seq_cut cut_of(const pakv_attention_plan* p, int64_t b) {
  const int64_t n = p->query_counts[b], group = p->num_heads / p->num_kv_heads;
  seq_cut cut;
  int64_t lo, hi;
  cut.tile_tokens = group >= PAKV_ATTN_TILE_ROWS ? 1 : PAKV_ATTN_TILE_ROWS / group;
  if (cut.tile_tokens > n) cut.tile_tokens = n;
  cut.tiles = n / cut.tile_tokens + (n % cut.tile_tokens != 0);
  cut.kv_span = PAKV_ATTN_PART_ROWS / (cut.tile_tokens * group);
  cut.kv_span = cut.kv_span < 1 ? 1 : cut.kv_span > p->num_kv_heads ? p->num_kv_heads : cut.kv_span;
  cut.kv_groups = p->num_kv_heads / cut.kv_span + (p->num_kv_heads % cut.kv_span != 0);
  pakv_visible(p, b, 0, &cut.begin, &hi);
  pakv_visible(p, b, n - 1, &lo, &cut.end);
  cut.end += 1;
  const int64_t span = cut.end - cut.begin, chunk = PAKV_ATTN_CHUNK;
  cut.splits = cut.tiles == 1 ? span / PAKV_ATTN_SPLIT_MIN : 1;
  cut.splits = cut.splits < 1 ? 1 : cut.splits > PAKV_ATTN_MAX_SPLITS ? PAKV_ATTN_MAX_SPLITS : cut.splits;
  cut.split_len = (span / cut.splits + (span % cut.splits != 0) + chunk - 1) / chunk * chunk;
  cut.splits = span / cut.split_len + (span % cut.split_len != 0); /* rounding up may leave fewer */
  return cut;
}

typedef struct {
  pakv_attention_part part;
  float* partial; /* NULL: the part finishes its rows; else where its share's states go */
} planned_part;

typedef struct {
  pakv_attention_part shape; /* the rows the shares have in common */
  float* partials;
  int64_t count, stride;
} planned_merge;

typedef struct {
  const pakv_attention_plan* plan;
  size_t floats; /* scratch per part */
  planned_part* parts;
  int64_t count, merges, partial_floats;
  planned_merge* merge;
  atomic_int bad, no_memory;
} attention_run;

/* The plan's parts (with `fill`, written into run->parts / run->merge, partials from `partials`;
 * without, counted): sequence by sequence, a sequence's tiles last first (a causal prefill's
 * heaviest), so a pool that hands out parts in order finishes evenly. Returns -1 when a part's
 * scratch overflows the address space. */
static int plan_parts(attention_run* run, int fill, float* partials) {
  const pakv_attention_plan* p = run->plan;
  const int64_t group = p->num_heads / p->num_kv_heads, dv = p->value_head_dim;
  int64_t count = 0, merges = 0, floats = 0, used = 0;
  for (int64_t b = 0; b < p->num_seqs; b++) {
    if (p->query_counts[b] == 0) continue;
    const seq_cut cut = cut_of(p, b);
    const int64_t need = pakv_attention_part_floats(p, cut.tile_tokens, cut.kv_span);
    if (need < 0) return -1;
    floats = need > floats ? need : floats;
    for (int64_t tile = cut.tiles - 1; tile >= 0; tile--)
      for (int64_t kv = 0; kv < cut.kv_groups; kv++) {
        pakv_attention_part part = {b, tile * cut.tile_tokens, 0, kv * cut.kv_span, 0, 0, 0};
        part.token_end = p->query_counts[b] - part.token_begin < cut.tile_tokens ? p->query_counts[b]
                                                                                 : part.token_begin + cut.tile_tokens;
        part.kv_end = p->num_kv_heads - part.kv_begin < cut.kv_span ? p->num_kv_heads : part.kv_begin + cut.kv_span;
        const int64_t stride = (part.kv_end - part.kv_begin) * (part.token_end - part.token_begin) * group * (dv + 2);
        if (fill && cut.splits > 1)
          run->merge[merges] = (planned_merge){part, partials + used, cut.splits, stride};
        merges += cut.splits > 1;
        for (int64_t share = 0; share < cut.splits; share++, count++) {
          part.pos_begin = cut.begin + share * cut.split_len;
          part.pos_end = cut.end - part.pos_begin < cut.split_len ? cut.end : part.pos_begin + cut.split_len;
          if (fill) run->parts[count] = (planned_part){part, cut.splits > 1 ? partials + used : NULL};
          used += cut.splits > 1 ? stride : 0;
        }
      }
  }
  run->count = count;
  run->merges = merges;
  run->partial_floats = used;
  run->floats = (size_t)floats;
  return 0;
}

static void run_part(void* data, size_t index) {
  attention_run* run = (attention_run*)data;
  float* scratch = thread_scratch(run->floats);
  if (!scratch) {
    atomic_store(&run->no_memory, 1);
    return;
  }
  const planned_part* one = &run->parts[index];
  if (pakv_attention_run_part(run->plan, &one->part, scratch, one->partial)) atomic_store(&run->bad, 1);
}

/* Multiply-adds of the call (sum over sequences of new tokens x context x heads x (D + Dv + 1)),
 * saturating at INT64_MAX. */
static int64_t work_of(const pakv_attention_plan* p) {
  int64_t work = 0, term;
  for (int64_t b = 0; b < p->num_seqs && work < INT64_MAX; b++)
    if (pakv_mul(p->query_counts[b], p->context_lens[b], &term) || pakv_mul(term, p->num_heads, &term) ||
        pakv_mul(term, p->head_dim + p->value_head_dim + 1, &term) || pakv_add(work, term, &work))
      work = INT64_MAX;
  return work;
}

int pakv_run_attention_on(const pakv_attention_plan* p, const pakv_parallel* par, pakv_err* err) {
  if (p->num_tokens == 0 || p->num_heads == 0 || p->value_head_dim == 0) return 0; /* an empty output */
  if (!p->out) return pakv_fail(err, "attention: a NULL output pointer for a non-empty attention");
  pthread_once(&g_config_once, read_config);
  attention_run run;
  memset(&run, 0, sizeof(run));
  run.plan = p;
  if (plan_parts(&run, 0, NULL))
    return pakv_fail(err, "attention: a scratch for head_dim %lld / %lld overflows the address space",
                     (long long)p->head_dim, (long long)p->value_head_dim);
  if (run.count == 0) return 0;
  const size_t bytes = (size_t)run.count * sizeof(planned_part) + (size_t)run.merges * sizeof(planned_merge) +
                       (size_t)run.partial_floats * sizeof(float); /* all fit: bounded by the plan's extents */
  _Alignas(64) char stack[PAKV_ATTENTION_STACK_BYTES]; /* a decode step's few parts: no allocation */
  char* memory = bytes <= sizeof(stack) ? stack : (char*)malloc(bytes);
  if (!memory) return pakv_fail(err, "attention: out of memory for the run's %zu bytes of parts", bytes);
  run.parts = (planned_part*)memory;
  run.merge = (planned_merge*)(run.parts + run.count);
  plan_parts(&run, 1, (float*)(run.merge + run.merges));
  if (par && run.count >= 2 && work_of(p) >= g_attention_parallel_min) {
    if (par->run(par->host, run_part, (size_t)run.count, &run))
      for (int64_t i = 0; i < run.count; i++) run_part(&run, (size_t)i); /* the pool ran none: here */
  } else {
    for (int64_t i = 0; i < run.count; i++) run_part(&run, (size_t)i);
  }
  if (!atomic_load(&run.bad) && !atomic_load(&run.no_memory))
    for (int64_t m = 0; m < run.merges; m++)
      pakv_attention_merge(p, &run.merge[m].shape, run.merge[m].partials, run.merge[m].count, run.merge[m].stride);
  if (memory != stack) free(memory);
  if (atomic_load(&run.no_memory))
    return pakv_fail(err, "attention: out of memory for a thread's scratch of %zu floats", run.floats);
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

/* The library's own parallel-for for callers without a pool (the Python native backend, tests):
 * `threads` threads (the calling one among them) take parts in turn from a shared counter. */
#define PAKV_ATTN_MAX_THREADS 16

typedef struct {
  void (*fn)(void*, size_t);
  void* data;
  size_t parts;
  atomic_size_t next;
} own_job;

static void* own_worker(void* arg) {
  own_job* job = (own_job*)arg;
  for (size_t i; (i = atomic_fetch_add(&job->next, 1)) < job->parts;) job->fn(job->data, i);
  return NULL;
}

static int own_threads_run(void* host, void (*fn)(void*, size_t), size_t parts, void* data) {
  const int threads = *(const int*)host;
  pthread_t tid[PAKV_ATTN_MAX_THREADS];
  int started[PAKV_ATTN_MAX_THREADS] = {0};
  own_job job = {fn, data, parts, 0};
  for (int i = 1; i < threads; i++) started[i] = pthread_create(&tid[i], NULL, own_worker, &job) == 0;
  own_worker(&job); /* threads that did not start leave their parts to the others */
  for (int i = 1; i < threads; i++)
    if (started[i]) pthread_join(tid[i], NULL);
  return 0;
}

static int report(int rc, const pakv_err* err, char* err_out, size_t err_len) {
  if (rc && err_out && err_len) {
    size_t n = strlen(err->msg);
    if (n >= err_len) n = err_len - 1;
    memcpy(err_out, err->msg, n);
    err_out[n] = 0;
  }
  return rc ? err->kind : 0;
}

/* Check and run a plan on the calling thread: 0, or the error's kind (PAKV_ERR_VALUE,
 * PAKV_ERR_TYPE) with its message in err_out. */
PAKV_EXPORT int pakv_attention(const pakv_attention_plan* plan, char* err_out, size_t err_len) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  int rc = pakv_check_attention_plan(plan, &err);
  if (!rc) rc = pakv_run_attention_on(plan, NULL, &err);
  return report(rc, &err, err_out, err_len);
}

/* pakv_attention on `threads` of the library's threads (1..16; the parts and so the answer are
 * those of any other run of the plan). */
PAKV_EXPORT int pakv_attention_threads(const pakv_attention_plan* plan, int threads, char* err_out, size_t err_len) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  if (threads < 1 || threads > PAKV_ATTN_MAX_THREADS)
    return report(pakv_fail(&err, "attention: threads must be in [1, %d], got %d", PAKV_ATTN_MAX_THREADS, threads),
                  &err, err_out, err_len);
  pakv_parallel own = {own_threads_run, &threads};
  int rc = pakv_check_attention_plan(plan, &err);
  if (!rc) rc = pakv_run_attention_on(plan, threads > 1 ? &own : NULL, &err);
  return report(rc, &err, err_out, err_len);
}
