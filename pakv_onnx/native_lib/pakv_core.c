/* The copy core: plan checks, memcpy runs, the thread split, and the exported entry point the
 * native Python backend calls (pakv_gather). No ONNX Runtime, no Python. See pakv_core.h. */
#include "pakv_core.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PAKV_MAX_THREADS 8

/* One read of a block-table entry. volatile: the compiler must not re-read the caller's memory
 * between the bounds check and the use (another thread may be writing it). */
static inline int64_t table_entry(const pakv_plan* p, int64_t q, int64_t c) {
  const char* at = (const char*)p->block_tables + q * p->table_row_stride + c * p->table_col_stride;
  if (p->tables64) return *(const volatile int64_t*)at;
  return (int64_t) * (const volatile int32_t*)at;
}

/* ------------------------------------------------------------------------------------------- */
/* Checks                                                                                      */
/* ------------------------------------------------------------------------------------------- */
static int check_cache(const pakv_plan* p, const char* name, const void* base, int64_t stride, int64_t row,
                       pakv_err* err) {
  int64_t block_bytes, span;
  if (row < 0) return pakv_fail(err, "plan: %s bytes per token must be >= 0, got %lld", name, (long long)row);
  if (p->layout == PAKV_LAYOUT_NZ && row % PAKV_NZ_FRACTAL_BYTES)
    return pakv_fail(err, "plan: %s PA_NZ bytes per token must be a multiple of 32, got %lld", name, (long long)row);
  if (pakv_mul(row, p->block_size, &block_bytes))
    return pakv_fail(err, "plan: %s block_size %lld x %lld bytes per token overflows int64", name,
                     (long long)p->block_size, (long long)row);
  /* Any stride >= 0 (blocks may overlap, as in an expanded pool): the copy reads inside
   * (num_blocks - 1) * stride + one block. */
  if (stride < 0) return pakv_fail(err, "plan: %s block stride %lld bytes is negative", name, (long long)stride);
  if (p->num_blocks > 0 && (pakv_mul(stride, p->num_blocks - 1, &span) || pakv_add(span, block_bytes, &span)))
    return pakv_fail(err, "plan: %s %lld blocks of stride %lld bytes overflow int64", name, (long long)p->num_blocks,
                     (long long)stride);
  if (row > 0 && p->num_tokens > 0 && !base)
    return pakv_fail(err, "plan: %s a NULL cache pointer for a non-empty gather", name);
  return 0;
}

/* Every (sequence, used block) the copy will read: inside the outputs and the table, and every
 * block id read now in [0, num_blocks). The contract's own checks (pakv_contract_*.c) said all
 * this before the plan was made, with their messages; these only keep a plan from elsewhere
 * memory-safe, so they word it as the plan's fault. */
static int check_sequences(const pakv_plan* p, pakv_err* err) {
  const int64_t bs = p->block_size, T = p->num_tokens, nb = p->num_blocks, cols = p->table_cols;
  for (int64_t q = 0; q < p->num_seqs; q++) {
    int64_t len = p->seq_lengths[q], start = p->out_starts[q], col = p->col_starts[q];
    if (len < 0 || start < 0 || start > T || len > T - start)
      return pakv_fail(err, "plan: sequence %lld covers output rows [%lld, +%lld) outside [0, %lld)", (long long)q,
                       (long long)start, (long long)len, (long long)T);
    int64_t need = len / bs + (len % bs != 0);
    if (col < 0 || need > cols - col)
      return pakv_fail(err, "plan: sequence %lld reads table columns [%lld, +%lld) outside [0, %lld)", (long long)q,
                       (long long)col, (long long)need, (long long)cols);
    for (int64_t c = col; c < col + need; c++) {
      int64_t b = table_entry(p, q, c);
      if (b < 0 || b >= nb)
        return pakv_fail(err,
                         "block_tables changed after validation (or the plan was not the validator's): entry "
                         "(%lld, %lld) = %lld is outside [0, %lld) when the copy read it",
                         (long long)q, (long long)c, (long long)b, (long long)nb);
    }
  }
  return 0;
}

int pakv_check_plan(const pakv_plan* p, pakv_err* err) {
  int64_t row_sum, out_bytes, table_extent = 0, col_extent = 0;
  if (!p) return pakv_fail(err, "NULL plan");
  if (p->abi_version != PAKV_ABI_VERSION || p->struct_size != sizeof(pakv_plan))
    return pakv_fail(err, "plan ABI mismatch: caller has version %u / %u bytes, library has %d / %zu bytes",
                     p->abi_version, p->struct_size, PAKV_ABI_VERSION, sizeof(pakv_plan));
  if (p->layout != PAKV_LAYOUT_NORM && p->layout != PAKV_LAYOUT_NZ)
    return pakv_fail(err, "plan layout must be 0 (Norm) or 1 (PA_NZ), got %d", p->layout);
  if (p->block_size < 1) return pakv_fail(err, "plan: block_size must be >= 1, got %lld", (long long)p->block_size);
  if (p->num_blocks < 0 || p->num_tokens < 0 || p->num_seqs < 0 || p->table_cols < 0)
    return pakv_fail(err, "plan sizes must be >= 0 (num_blocks %lld, num_tokens %lld, num_seqs %lld, cols %lld)",
                     (long long)p->num_blocks, (long long)p->num_tokens, (long long)p->num_seqs,
                     (long long)p->table_cols);
  if (check_cache(p, "key_cache", p->key_cache, p->key_block_stride, p->key_row_bytes, err)) return -1;
  if (check_cache(p, "value_cache", p->value_cache, p->value_block_stride, p->value_row_bytes, err))
    return -1;
  /* The table is read at q*row_stride + c*col_stride for q < Q, c < cols: that must fit. */
  if (p->table_row_stride < 0 || p->table_col_stride < 0)
    return pakv_fail(err, "plan: block_tables strides must be >= 0, got %lld / %lld bytes",
                     (long long)p->table_row_stride, (long long)p->table_col_stride);
  if (p->num_seqs > 0 && p->table_cols > 0 &&
      (pakv_mul(p->num_seqs - 1, p->table_row_stride, &table_extent) ||
       pakv_mul(p->table_cols - 1, p->table_col_stride, &col_extent) ||
       pakv_add(table_extent, col_extent, &table_extent)))
    return pakv_fail(err, "plan: block_tables of %lld x %lld entries overflows int64 offsets", (long long)p->num_seqs,
                     (long long)p->table_cols);
  if (p->num_seqs > 0 &&
      (!p->seq_lengths || !p->out_starts || !p->col_starts || (p->table_cols > 0 && !p->block_tables)))
    return pakv_fail(err, "NULL index array in a plan with %lld sequences", (long long)p->num_seqs);
  if (check_sequences(p, err)) return -1;
  if (pakv_add(p->key_row_bytes, p->value_row_bytes, &row_sum) || pakv_mul(p->num_tokens, row_sum, &out_bytes))
    return pakv_fail(err, "plan: outputs of %lld tokens overflow int64 byte offsets", (long long)p->num_tokens);
  return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* The copy                                                                                    */
/* ------------------------------------------------------------------------------------------- */
typedef struct {
  const pakv_plan* plan;
  int64_t lo, hi;       /* output rows [lo, hi) */
  atomic_int* bad;      /* set when a block id read during the copy is out of range */
} pakv_range;

static inline void copy_norm(const char* cache, int64_t stride, int64_t row, char* out, int64_t block, int64_t slot,
                             int64_t n, int64_t out_row) {
  if (row) memcpy(out + out_row * row, cache + block * stride + slot * row, (size_t)(n * row));
}

/* FRACTAL_NZ: fractal f of token (block, slot) is 32 bytes at block*stride + (f*bs + slot)*32. */
static inline void copy_nz(const char* cache, int64_t stride, int64_t row, int64_t bs, char* out, int64_t block,
                           int64_t slot, int64_t n, int64_t out_row) {
  int64_t fractals = row / PAKV_NZ_FRACTAL_BYTES;
  for (int64_t f = 0; f < fractals; f++) {
    const char* s = cache + block * stride + (f * bs + slot) * PAKV_NZ_FRACTAL_BYTES;
    char* d = out + out_row * row + f * PAKV_NZ_FRACTAL_BYTES;
    for (int64_t r = 0; r < n; r++) memcpy(d + r * row, s + r * PAKV_NZ_FRACTAL_BYTES, PAKV_NZ_FRACTAL_BYTES);
  }
}

int pakv_for_each_run(const pakv_plan* p, int64_t lo, int64_t hi, pakv_run_fn fn, void* ctx, int64_t* bad) {
  const int64_t bs = p->block_size;
  for (int64_t q = 0; q < p->num_seqs; q++) {
    int64_t len = p->seq_lengths[q], start = p->out_starts[q];
    if (len == 0 || start >= hi || start + len <= lo) continue;
    int64_t t = (lo > start ? lo : start) - start;
    int64_t t_end = (hi < start + len ? hi : start + len) - start;
    while (t < t_end) {
      int64_t slot = t % bs;
      int64_t n = bs - slot;
      if (n > t_end - t) n = t_end - t;
      int64_t block = table_entry(p, q, p->col_starts[q] + t / bs);
      if (block < 0 || block >= p->num_blocks) {
        (*bad)++; /* changed since pakv_check_plan: skip, the caller reports it after the copy */
      } else {
        int rc = fn(ctx, block, slot, n, start + t);
        if (rc) return rc;
      }
      t += n;
    }
  }
  return 0;
}

int pakv_fail_changed_tables(const pakv_plan* p, pakv_err* err) {
  return pakv_fail(err,
                   "block_tables changed while the gather ran: an entry read during the copy is outside [0, %lld) "
                   "(it was valid when checked); the outputs are incomplete",
                   (long long)p->num_blocks);
}

static int copy_run(void* ctx, int64_t block, int64_t slot, int64_t n, int64_t out_row) {
  const pakv_plan* p = (const pakv_plan*)ctx;
  if (p->layout == PAKV_LAYOUT_NORM) {
    copy_norm(p->key_cache, p->key_block_stride, p->key_row_bytes, p->key_out, block, slot, n, out_row);
    copy_norm(p->value_cache, p->value_block_stride, p->value_row_bytes, p->value_out, block, slot, n, out_row);
  } else {
    copy_nz(p->key_cache, p->key_block_stride, p->key_row_bytes, p->block_size, p->key_out, block, slot, n, out_row);
    copy_nz(p->value_cache, p->value_block_stride, p->value_row_bytes, p->block_size, p->value_out, block, slot, n,
            out_row);
  }
  return 0;
}

static void copy_rows(const pakv_range* r) {
  int64_t bad = 0;
  pakv_for_each_run(r->plan, r->lo, r->hi, copy_run, (void*)r->plan, &bad);
  if (bad) atomic_store(r->bad, 1);
}

/* Threading: only large copies are split (small ones would pay more for the thread than the copy). */
static int64_t g_parallel_min_bytes = 4 << 20;
static int g_num_threads = 2;
static pthread_once_t g_config_once = PTHREAD_ONCE_INIT;

static void read_config(void) {
  const char* s = getenv("PAKV_ONNX_PARALLEL_MIN_BYTES");
  if (s && *s) g_parallel_min_bytes = strtoll(s, NULL, 10);
  s = getenv("PAKV_ONNX_NUM_THREADS");
  if (s && *s) {
    long n = strtol(s, NULL, 10);
    g_num_threads = n < 1 ? 1 : (n > PAKV_MAX_THREADS ? PAKV_MAX_THREADS : (int)n);
  }
}

static void* copy_range_thread(void* arg) {
  copy_rows((const pakv_range*)arg);
  return NULL;
}

/* First row of part i of n over T rows, without forming T * i (which overflows for huge T). */
static int64_t split_point(int64_t T, int n, int i) {
  int64_t base = T / n, extra = T % n;
  return base * i + (i < extra ? i : extra);
}

/* Parts of a copy split over a caller's pool: about PAKV_PART_BYTES each (so a busy pool can
 * balance them), at least 2, at most PAKV_MAX_PARTS. */
#define PAKV_PART_BYTES ((int64_t)2 << 20)
#define PAKV_MAX_PARTS 64

typedef struct {
  const pakv_plan* plan;
  int64_t parts;
  atomic_int* bad;
} pakv_split;

static void copy_part(void* data, size_t i) {
  const pakv_split* s = (const pakv_split*)data;
  pakv_range r = {s->plan, split_point(s->plan->num_tokens, (int)s->parts, (int)i),
                  split_point(s->plan->num_tokens, (int)s->parts, (int)i + 1), s->bad};
  copy_rows(&r);
}

static void copy_on_threads(const pakv_plan* p, int threads, atomic_int* bad) {
  pthread_t tid[PAKV_MAX_THREADS];
  pakv_range ranges[PAKV_MAX_THREADS];
  int started[PAKV_MAX_THREADS] = {0};
  for (int i = 0; i < threads; i++) {
    ranges[i].plan = p;
    ranges[i].lo = split_point(p->num_tokens, threads, i);
    ranges[i].hi = split_point(p->num_tokens, threads, i + 1);
    ranges[i].bad = bad;
  }
  for (int i = 1; i < threads; i++) started[i] = pthread_create(&tid[i], NULL, copy_range_thread, &ranges[i]) == 0;
  copy_rows(&ranges[0]);
  for (int i = 1; i < threads; i++) {
    if (started[i])
      pthread_join(tid[i], NULL);
    else
      copy_rows(&ranges[i]); /* could not start a thread: do its share here */
  }
}

int pakv_run_plan_on(const pakv_plan* p, const pakv_parallel* par, pakv_err* err) {
  if (p->num_tokens > 0 && ((p->key_row_bytes > 0 && !p->key_out) || (p->value_row_bytes > 0 && !p->value_out)))
    return pakv_fail(err, "a NULL output pointer for a non-empty gather");
  pthread_once(&g_config_once, read_config);
  atomic_int bad = 0;
  /* bytes fits: pakv_check_plan checked num_tokens * (key_row_bytes + value_row_bytes). */
  int64_t bytes = p->num_tokens * (p->key_row_bytes + p->value_row_bytes);
  int64_t parts = bytes / PAKV_PART_BYTES;
  if (parts > PAKV_MAX_PARTS) parts = PAKV_MAX_PARTS;
  if (parts < 2) parts = 2;
  if (parts > p->num_tokens) parts = p->num_tokens;
  int threads = g_num_threads;
  if (threads > p->num_tokens) threads = (int)p->num_tokens;
  pakv_range all = {p, 0, p->num_tokens, &bad};
  if (bytes < g_parallel_min_bytes || (par ? parts < 2 : threads < 2)) {
    copy_rows(&all);
  } else if (par) {
    pakv_split split = {p, parts, &bad};
    if (par->run(par->host, copy_part, (size_t)parts, &split)) copy_rows(&all); /* the pool ran none: copy here */
  } else {
    copy_on_threads(p, threads, &bad);
  }
  if (atomic_load(&bad)) return pakv_fail_changed_tables(p, err);
  return 0;
}

int pakv_run_plan(const pakv_plan* p, pakv_err* err) { return pakv_run_plan_on(p, NULL, err); }

/* ------------------------------------------------------------------------------------------- */
/* The scatter (ScatterPaKvCache)                                                              */
/* ------------------------------------------------------------------------------------------- */
/* One side (key or value) of a scatter plan: the cache it writes and the rows it reads. */
static int check_scatter_side(const pakv_scatter_plan* p, const char* name, const void* cache, int64_t stride,
                              int64_t row, const void* src, int64_t token_stride, pakv_err* err) {
  int64_t block_bytes, span, src_span;
  if (row < 0 || (p->layout == PAKV_LAYOUT_NZ && row % PAKV_NZ_FRACTAL_BYTES))
    return pakv_fail(err, "plan: %s bytes per token %lld do not fit the layout", name, (long long)row);
  if (pakv_mul(row, p->block_size, &block_bytes) || stride < 0 ||
      (p->num_blocks > 0 && (pakv_mul(stride, p->num_blocks - 1, &span) || pakv_add(span, block_bytes, &span))))
    return pakv_fail(err, "plan: %s: %lld blocks of stride %lld bytes overflow int64 (or a negative stride)", name,
                     (long long)p->num_blocks, (long long)stride);
  if (token_stride < 0 ||
      (p->num_tokens > 0 && (pakv_mul(token_stride, p->num_tokens - 1, &src_span) || pakv_add(src_span, row, &src_span))))
    return pakv_fail(err, "plan: %s rows of stride %lld bytes overflow int64 (or a negative stride)", name,
                     (long long)token_stride);
  if (row > 0 && p->num_tokens > 0 && (!cache || !src))
    return pakv_fail(err, "plan: %s: a NULL pointer for a non-empty scatter", name);
  return 0;
}

int pakv_check_scatter_plan(const pakv_scatter_plan* p, pakv_err* err) {
  int64_t capacity, extent;
  if (!p) return pakv_fail(err, "NULL plan");
  if (p->abi_version != PAKV_ABI_VERSION || p->struct_size != sizeof(pakv_scatter_plan))
    return pakv_fail(err, "plan ABI mismatch: caller has version %u / %u bytes, library has %d / %zu bytes",
                     p->abi_version, p->struct_size, PAKV_ABI_VERSION, sizeof(pakv_scatter_plan));
  if (p->layout != PAKV_LAYOUT_NORM && p->layout != PAKV_LAYOUT_NZ)
    return pakv_fail(err, "plan layout must be 0 (Norm) or 1 (PA_NZ), got %d", p->layout);
  if (p->block_size < 1 || p->num_blocks < 0 || p->num_tokens < 0 || pakv_mul(p->num_blocks, p->block_size, &capacity))
    return pakv_fail(err, "plan: sizes out of range (num_blocks %lld, block_size %lld, num_tokens %lld)",
                     (long long)p->num_blocks, (long long)p->block_size, (long long)p->num_tokens);
  if (check_scatter_side(p, "key", p->key_cache, p->key_block_stride, p->key_row_bytes, p->key, p->key_token_stride,
                         err) ||
      check_scatter_side(p, "value", p->value_cache, p->value_block_stride, p->value_row_bytes, p->value,
                         p->value_token_stride, err))
    return -1;
  if (p->slot_stride < 0 || (p->num_tokens > 0 && (!p->slot_mapping || pakv_mul(p->slot_stride, p->num_tokens - 1, &extent))))
    return pakv_fail(err, "plan: slot_mapping of %lld entries of stride %lld bytes", (long long)p->num_tokens,
                     (long long)p->slot_stride);
  return 0;
}

static inline void write_row(char* cache, int64_t stride, int64_t row, int64_t bs, int nz, int64_t block,
                             int64_t slot, const char* src) {
  if (!row) return;
  if (!nz) {
    memcpy(cache + block * stride + slot * row, src, (size_t)row);
    return;
  }
  for (int64_t f = 0; f < row / PAKV_NZ_FRACTAL_BYTES; f++)
    memcpy(cache + block * stride + (f * bs + slot) * PAKV_NZ_FRACTAL_BYTES, src + f * PAKV_NZ_FRACTAL_BYTES,
           PAKV_NZ_FRACTAL_BYTES);
}

int pakv_run_scatter(const pakv_scatter_plan* p, pakv_err* err) {
  const int64_t bs = p->block_size, capacity = p->num_blocks * bs; /* fits: pakv_check_scatter_plan */
  const int nz = p->layout == PAKV_LAYOUT_NZ;
  int bad = 0;
  if (pakv_check_scatter_writable(p, "key_cache", "value_cache", err)) return -1;
  for (int64_t t = 0; t < p->num_tokens; t++) {
    int64_t s = pakv_slot_entry(p, t);
    if (s < 0) continue; /* padding */
    if (s >= capacity) {
      bad = 1; /* changed since it was validated: skip, report after */
      continue;
    }
    write_row(p->key_cache, p->key_block_stride, p->key_row_bytes, bs, nz, s / bs, s % bs,
              (const char*)p->key + t * p->key_token_stride);
    write_row(p->value_cache, p->value_block_stride, p->value_row_bytes, bs, nz, s / bs, s % bs,
              (const char*)p->value + t * p->value_token_stride);
  }
  if (bad)
    return pakv_fail(err,
                     "slot_mapping changed after validation: a slot read during the scatter is outside [0, %lld); "
                     "the caches are partly written",
                     (long long)capacity);
  return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* Exported entry points (the native Python backend; see pakv_onnx/native_lib/__init__.py)     */
/* ------------------------------------------------------------------------------------------- */
PAKV_EXPORT int pakv_abi_version(void) { return PAKV_ABI_VERSION; }
PAKV_EXPORT size_t pakv_plan_size(void) { return sizeof(pakv_plan); }

/* rc, with err's message copied to err_out (up to err_len bytes) when rc says it failed. */
static int reported(int rc, const pakv_err* err, char* err_out, size_t err_len) {
  if (rc && err_out && err_len) snprintf(err_out, err_len, "%s", err->msg);
  return rc;
}

PAKV_EXPORT int pakv_gather(const pakv_plan* plan, char* err_out, size_t err_len) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  int rc = pakv_check_plan(plan, &err);
  return reported(rc ? rc : pakv_run_plan(plan, &err), &err, err_out, err_len);
}

PAKV_EXPORT size_t pakv_scatter_plan_size(void) { return sizeof(pakv_scatter_plan); }

PAKV_EXPORT int pakv_scatter(const pakv_scatter_plan* plan, char* err_out, size_t err_len) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  int rc = pakv_check_scatter_plan(plan, &err);
  return reported(rc ? rc : pakv_run_scatter(plan, &err), &err, err_out, err_len);
}

/* Whether a checked scatter plan's caches can be written where it writes (the Python front asks before a
 * Python backend writes host memory; the C scatter asks itself). */
PAKV_EXPORT int pakv_scatter_writable(const pakv_scatter_plan* plan, char* err_out, size_t err_len) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  int rc = pakv_check_scatter_plan(plan, &err);
  return reported(rc ? rc : pakv_check_scatter_writable(plan, "key_cache", "value_cache", &err), &err, err_out,
                  err_len);
}
