/* The attention core's run: a checked plan (pakv_attention_check.c) cut into parts
 * (pakv_attention_part.c runs one), on ORT's intra-op pool or on the calling thread. No ONNX Runtime,
 * no Python, no libm. See pakv_core.h for the plan.
 *
 * Parts are (sequence, kv head, tile of query tokens): the Hq / Hk query heads that share a kv head
 * (GQA) are one part's queries, so each K/V row a part reads serves all of them. Parts run on ORT's
 * intra-op pool when the caller gives one (pakv_parallel) and the call is big enough, else on the
 * calling thread. Each thread keeps one scratch buffer (grown on demand, freed when the thread
 * ends): no allocation per call beyond the parts' index when parallel. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pakv_attention_core.h"

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
  size_t floats; /* scratch per part */
  int64_t tile_tokens;
  const int64_t* first_part; /* [B+1]: index of each sequence's first part */
  atomic_int bad, no_memory;
} parallel_run;

static int64_t tiles_of(int64_t n, int64_t tile_tokens) { return n / tile_tokens + (n % tile_tokens != 0); }

/* Part `local` of sequence b's parts (kv head major, then token tile). */
static pakv_attention_part part_of(const pakv_attention_plan* p, int64_t b, int64_t local, int64_t tile_tokens) {
  const int64_t n = p->query_counts[b], tiles = tiles_of(n, tile_tokens);
  pakv_attention_part part;
  part.seq = b;
  part.kv_begin = local / tiles;
  part.kv_end = part.kv_begin + 1;
  part.token_begin = (local % tiles) * tile_tokens;
  part.token_end = n - part.token_begin < tile_tokens ? n : part.token_begin + tile_tokens;
  part.pos_begin = 0;
  part.pos_end = p->context_lens[b];
  return part;
}

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
  pakv_attention_part one = part_of(p, lo, part - run->first_part[lo], run->tile_tokens);
  float* scratch = thread_scratch(run->floats);
  if (!scratch) {
    atomic_store(&run->no_memory, 1);
    return;
  }
  if (pakv_attention_run_part(p, &one, scratch, NULL)) atomic_store(&run->bad, 1);
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
  int64_t floats = pakv_attention_part_floats(p, run.tile_tokens, 1);
  if (floats < 0)
    return pakv_fail(err, "attention: a scratch for head_dim %lld / %lld overflows the address space",
                     (long long)p->head_dim, (long long)p->value_head_dim);
  run.floats = (size_t)floats;
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
    float* scratch = thread_scratch(run.floats);
    if (!scratch) return pakv_fail(err, "attention: out of memory for a scratch of %zu floats", run.floats);
    for (int64_t b = 0; b < p->num_seqs; b++)
      for (int64_t i = 0, count = p->num_kv_heads * tiles_of(p->query_counts[b], run.tile_tokens); i < count; i++) {
        pakv_attention_part one = part_of(p, b, i, run.tile_tokens);
        if (pakv_attention_run_part(p, &one, scratch, NULL)) atomic_store(&run.bad, 1);
      }
  }
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
