/* pakv::GatherPaKvCache: an ONNX Runtime custom-op library with a native CPU kernel.
 *
 * Entry point: RegisterCustomOps(OrtSessionOptions*, const OrtApiBase*), loaded by ORT with
 * SessionOptions.register_custom_ops_library(path) (Python) / RegisterCustomOpsLibrary (C API).
 * No ORT header, no libonnxruntime, no Python: see ort_abi.h for the ABI subset used.
 *
 * The contract (names, layouts, dtypes) is defined in pakv_onnx/spec.py; this file repeats only
 * what it needs to stay memory-safe, and every refusal is an ORT error status naming the input.
 *
 *   Norm : cache [nb, bs, H, D]        -> out [T, H, D]    one memcpy per (sequence, block) run
 *   PA_NZ: cache [nb, H*D/E, bs, E]    -> out [T, H*D]     E * itemsize = 32 bytes (one fractal row)
 *
 * One OrtCustomOp is registered per cache dtype of the contract (same name, concrete key/value and
 * output types), so a cache dtype outside the contract has no kernel and the session is refused at
 * creation; the three index inputs are type-agnostic and checked (int32/int64) at run time.
 *
 * Backends: slot 0 is the native kernel (the default, and the only one without Python). A Python
 * host may register the library for another backend (pakv_select_backend_for_next_registration);
 * that session's kernels then hand the raw tensors to a Python callback (pakv_set_python_callback).
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ort_abi.h"

#if defined(__GNUC__)
#define PAKV_EXPORT __attribute__((visibility("default")))
#else
#define PAKV_EXPORT
#endif

#define PAKV_DOMAIN "pakv"
#define PAKV_OP_TYPE "GatherPaKvCache"
#define PAKV_NUM_INPUTS 5
#define PAKV_NUM_OUTPUTS 2
#define PAKV_MAX_RANK 16
#define PAKV_ERR_LEN 1024
#define PAKV_MAX_BACKENDS 16
#define PAKV_BACKEND_NAME_LEN 32
#define PAKV_NZ_FRACTAL_BYTES 32
#define PAKV_MAX_THREADS 8

static const char* const INPUT_NAMES[PAKV_NUM_INPUTS] = {"key_cache", "value_cache", "block_tables", "seq_lens",
                                                         "seq_offset"};

/* Cache dtypes of the contract: ONNX TensorProto type -> element size (mirrors spec.CACHE_DTYPES;
 * tests/test_runtime_plugin_build.py checks the two tables agree). */
typedef struct {
  int onnx_type;
  int itemsize;
  const char* name;
} pakv_dtype;

static const pakv_dtype CACHE_DTYPES[] = {
    {16, 2, "bfloat16"}, {10, 2, "float16"}, {1, 4, "float32"}, {3, 1, "int8"},
    {2, 1, "uint8"},     {5, 2, "int16"},    {4, 2, "uint16"},  {6, 4, "int32"},
    {12, 4, "uint32"},   {17, 1, "float8_e4m3fn"}, {19, 1, "float8_e5m2"},
};
#define PAKV_NUM_DTYPES ((int)(sizeof(CACHE_DTYPES) / sizeof(CACHE_DTYPES[0])))

static int cache_itemsize(int onnx_type) {
  for (int i = 0; i < PAKV_NUM_DTYPES; i++)
    if (CACHE_DTYPES[i].onnx_type == onnx_type) return CACHE_DTYPES[i].itemsize;
  return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* Tensors and errors                                                                          */
/* ------------------------------------------------------------------------------------------- */
typedef struct {
  void* data;  /* NULL with present == 0 for an absent optional input */
  int32_t present;
  int32_t elem_type;
  int32_t ndim;
  int32_t reserved;
  int64_t dims[PAKV_MAX_RANK];
} pakv_tensor;

typedef struct {
  char msg[PAKV_ERR_LEN];
} pakv_err;

static int fail(pakv_err* err, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(pakv_err* err, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
  va_end(ap);
  return -1;
}

static inline int64_t idx_at(const void* p, int is64, int64_t i) {
  return is64 ? ((const int64_t*)p)[i] : (int64_t)((const int32_t*)p)[i];
}

/* ------------------------------------------------------------------------------------------- */
/* The copy job                                                                                */
/* ------------------------------------------------------------------------------------------- */
typedef struct {
  int nz;            /* 0 Norm, 1 PA_NZ */
  int64_t nb, bs;    /* cache geometry shared by key and value */
  const char* kc;
  const char* vc;
  int64_t k_row, v_row; /* bytes of one output row (token) */
  char* ko;
  char* vo;
  int64_t num_seqs, cols;
  const void* tables;
  int tables64;
  const int64_t* lengths;
  const int64_t* out_starts;
  const int64_t* col_starts;
  int64_t T;
} pakv_job;

static inline void copy_block_rows(const pakv_job* j, int64_t block, int64_t slot, int64_t n, int64_t out_row) {
  if (!j->nz) {
    if (j->k_row) memcpy(j->ko + out_row * j->k_row, j->kc + (block * j->bs + slot) * j->k_row, (size_t)(n * j->k_row));
    if (j->v_row) memcpy(j->vo + out_row * j->v_row, j->vc + (block * j->bs + slot) * j->v_row, (size_t)(n * j->v_row));
    return;
  }
  /* FRACTAL_NZ: fractal f of token (block, slot) is 32 bytes at ((block * F + f) * bs + slot) * 32. */
  for (int pass = 0; pass < 2; pass++) {
    const char* src = pass ? j->vc : j->kc;
    char* dst = pass ? j->vo : j->ko;
    int64_t row = pass ? j->v_row : j->k_row;
    int64_t fractals = row / PAKV_NZ_FRACTAL_BYTES;
    for (int64_t f = 0; f < fractals; f++) {
      const char* s = src + ((block * fractals + f) * j->bs + slot) * PAKV_NZ_FRACTAL_BYTES;
      char* d = dst + out_row * row + f * PAKV_NZ_FRACTAL_BYTES;
      for (int64_t r = 0; r < n; r++) memcpy(d + r * row, s + r * PAKV_NZ_FRACTAL_BYTES, PAKV_NZ_FRACTAL_BYTES);
    }
  }
}

/* Copy output rows [lo, hi): every (sequence, block) run intersecting the range. */
static void copy_rows(const pakv_job* j, int64_t lo, int64_t hi) {
  for (int64_t q = 0; q < j->num_seqs; q++) {
    int64_t len = j->lengths[q], start = j->out_starts[q];
    if (len == 0 || start >= hi || start + len <= lo) continue;
    int64_t t = (lo > start ? lo : start) - start;
    int64_t t_end = (hi < start + len ? hi : start + len) - start;
    while (t < t_end) {
      int64_t slot = t % j->bs;
      int64_t n = j->bs - slot;
      if (n > t_end - t) n = t_end - t;
      int64_t block = idx_at(j->tables, j->tables64, q * j->cols + j->col_starts[q] + t / j->bs);
      copy_block_rows(j, block, slot, n, start + t);
      t += n;
    }
  }
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

typedef struct {
  const pakv_job* job;
  int64_t lo, hi;
} pakv_range;

static void* copy_range_thread(void* arg) {
  pakv_range* r = (pakv_range*)arg;
  copy_rows(r->job, r->lo, r->hi);
  return NULL;
}

static void run_job(const pakv_job* j) {
  pthread_once(&g_config_once, read_config);
  int64_t bytes = j->T * (j->k_row + j->v_row);
  int threads = g_num_threads;
  if (threads > j->T) threads = (int)j->T;
  if (threads < 2 || bytes < g_parallel_min_bytes) {
    copy_rows(j, 0, j->T);
    return;
  }
  pthread_t tid[PAKV_MAX_THREADS];
  pakv_range ranges[PAKV_MAX_THREADS];
  int started[PAKV_MAX_THREADS] = {0};
  for (int i = 0; i < threads; i++) {
    ranges[i].job = j;
    ranges[i].lo = j->T * i / threads;
    ranges[i].hi = j->T * (i + 1) / threads;
  }
  for (int i = 1; i < threads; i++) started[i] = pthread_create(&tid[i], NULL, copy_range_thread, &ranges[i]) == 0;
  copy_rows(j, ranges[0].lo, ranges[0].hi);
  for (int i = 1; i < threads; i++) {
    if (started[i])
      pthread_join(tid[i], NULL);
    else
      copy_rows(j, ranges[i].lo, ranges[i].hi); /* could not start a thread: do its share here */
  }
}

/* Block-table checks shared by both entry points: every entry a sequence reads exists and names
 * a block in [0, nb); every sequence's rows lie inside the output. */
static int check_job(const pakv_job* j, pakv_err* err) {
  for (int64_t q = 0; q < j->num_seqs; q++) {
    int64_t len = j->lengths[q], start = j->out_starts[q], col = j->col_starts[q];
    if (len < 0 || start < 0 || start > j->T || len > j->T - start)
      return fail(err, "seq_lens: sequence %lld covers output rows [%lld, +%lld) outside [0, %lld)", (long long)q,
                  (long long)start, (long long)len, (long long)j->T);
    if (col < 0) return fail(err, "seq_offset[%lld] must be non-negative", (long long)q);
    int64_t need = len / j->bs + (len % j->bs != 0);
    if (need > j->cols - col)
      return fail(err,
                  "block_tables row %lld is too short: sequence %lld has %lld tokens = %lld blocks of %lld starting "
                  "at column %lld (seq_offset), but block_tables has %lld columns",
                  (long long)q, (long long)q, (long long)len, (long long)need, (long long)j->bs, (long long)col,
                  (long long)j->cols);
    for (int64_t c = col; c < col + need; c++) {
      int64_t b = idx_at(j->tables, j->tables64, q * j->cols + c);
      if (b < 0 || b >= j->nb)
        return fail(err,
                    "block_tables[%lld, %lld] = %lld is outside [0, %lld) (num_blocks of key_cache); it is used by "
                    "sequence %lld",
                    (long long)q, (long long)c, (long long)b, (long long)j->nb, (long long)q);
    }
  }
  return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* Raw inputs -> job (the ORT path)                                                            */
/* ------------------------------------------------------------------------------------------- */
typedef struct {
  pakv_job job;
  int64_t k_out_dims[3], v_out_dims[3];
  int out_ndim;
  int64_t* scratch; /* lengths, out_starts, col_starts: 3 * Q int64 */
} pakv_prepared;

static int is_index_type(int t) { return t == PAKV_ONNX_INT32 || t == PAKV_ONNX_INT64; }

static int require_index(const pakv_tensor* t, const char* name, int rank, pakv_err* err) {
  if (!is_index_type(t->elem_type))
    return fail(err, "%s must be int32 or int64, got ONNX element type %d", name, t->elem_type);
  if (t->ndim != rank)
    return fail(err, "%s must have rank %d, got rank %d", name, rank, t->ndim);
  return 0;
}

/* A rank-4 cache's (num_blocks, block_size, bytes per token, output token dims): (H, D) for Norm,
 * (H*D,) in tok_dims[0] for PA_NZ. Dims come from a tensor that exists, so products fit. */
static void cache_geometry(const pakv_tensor* t, int nz, int itemsize, int64_t* nb, int64_t* bs,
                           int64_t* row_bytes, int64_t* tok_dims) {
  *nb = t->dims[0];
  if (!nz) {
    *bs = t->dims[1];
    tok_dims[0] = t->dims[2];
    tok_dims[1] = t->dims[3];
    *row_bytes = t->dims[2] * t->dims[3] * itemsize;
  } else {
    *bs = t->dims[2];
    tok_dims[0] = t->dims[1] * t->dims[3];
    *row_bytes = t->dims[1] * t->dims[3] * itemsize;
  }
}

static int prepare(const pakv_tensor in[PAKV_NUM_INPUTS], int nz, int cumsum, pakv_prepared* p, pakv_err* err) {
  const pakv_tensor *kc = &in[0], *vc = &in[1], *bt = &in[2], *sl = &in[3], *so = &in[4];
  memset(p, 0, sizeof(*p));
  int itemsize = cache_itemsize(kc->elem_type);
  if (!itemsize) return fail(err, "key_cache ONNX element type %d is not in the contract", kc->elem_type);
  if (vc->elem_type != kc->elem_type)
    return fail(err, "value_cache element type %d must equal key_cache element type %d", vc->elem_type,
                kc->elem_type);
  const char* layout = nz ? "PA_NZ: [num_blocks, heads*head_dim // E, block_size, E]"
                          : "Norm: [num_blocks, block_size, heads, head_dim]";
  if (kc->ndim != 4) return fail(err, "key_cache must have rank 4 (%s), got rank %d", layout, kc->ndim);
  if (vc->ndim != 4) return fail(err, "value_cache must have rank 4 (%s), got rank %d", layout, vc->ndim);
  if (nz) {
    int64_t e = PAKV_NZ_FRACTAL_BYTES / itemsize;
    if (kc->dims[3] != e)
      return fail(err, "key_cache: PA_NZ last dim must be 32 bytes / element size = %lld, got %lld", (long long)e,
                  (long long)kc->dims[3]);
    if (vc->dims[3] != e)
      return fail(err, "value_cache: PA_NZ last dim must be 32 bytes / element size = %lld, got %lld", (long long)e,
                  (long long)vc->dims[3]);
  }
  int64_t nb, bs, vnb, vbs, k_row, v_row, ktok[2] = {0, 0}, vtok[2] = {0, 0};
  cache_geometry(kc, nz, itemsize, &nb, &bs, &k_row, ktok);
  cache_geometry(vc, nz, itemsize, &vnb, &vbs, &v_row, vtok);
  if (vnb != nb || vbs != bs)
    return fail(err, "value_cache num_blocks/block_size (%lld, %lld) must equal key_cache's (%lld, %lld)",
                (long long)vnb, (long long)vbs, (long long)nb, (long long)bs);
  if (bs < 1) return fail(err, "key_cache block_size must be >= 1, got %lld", (long long)bs);

  if (require_index(bt, "block_tables", 2, err)) return -1;
  int64_t Q = bt->dims[0], cols = bt->dims[1];
  if (require_index(sl, "seq_lens", 1, err)) return -1;
  int64_t expected = cumsum ? Q + 1 : Q;
  if (sl->dims[0] != expected)
    return fail(err, "seq_lens must have %s = %lld entries for block_tables with Q = %lld rows, got %lld",
                cumsum ? "Q+1 (cumsum)" : "Q (lengths)", (long long)expected, (long long)Q, (long long)sl->dims[0]);
  if (so->present) {
    if (require_index(so, "seq_offset", 1, err)) return -1;
    if (so->dims[0] != Q)
      return fail(err, "seq_offset must have Q = %lld entries, got %lld", (long long)Q, (long long)so->dims[0]);
  }

  p->scratch = (int64_t*)malloc(sizeof(int64_t) * 3 * (size_t)(Q > 0 ? Q : 1));
  if (!p->scratch) return fail(err, "out of memory for %lld sequences", (long long)Q);
  int64_t *lengths = p->scratch, *starts = p->scratch + Q, *cols0 = p->scratch + 2 * Q;
  int sl64 = sl->elem_type == PAKV_ONNX_INT64;
  int64_t total = 0;
  if (cumsum) {
    int64_t first = idx_at(sl->data, sl64, 0);
    if (first != 0) return fail(err, "seq_lens (cumsum) must start at 0, got seq_lens[0] = %lld", (long long)first);
    for (int64_t q = 0; q < Q; q++) {
      int64_t a = idx_at(sl->data, sl64, q), b = idx_at(sl->data, sl64, q + 1);
      if (b < a)
        return fail(err, "seq_lens (cumsum) must be non-decreasing, got seq_lens[%lld] = %lld < seq_lens[%lld] = %lld",
                    (long long)(q + 1), (long long)b, (long long)q, (long long)a);
      lengths[q] = b - a; /* a >= 0 (by induction from 0), b >= a: no overflow */
      starts[q] = a;
    }
    total = idx_at(sl->data, sl64, Q);
  } else {
    for (int64_t q = 0; q < Q; q++) {
      int64_t n = idx_at(sl->data, sl64, q);
      if (n < 0)
        return fail(err, "seq_lens (lengths) must be non-negative, got seq_lens[%lld] = %lld", (long long)q,
                    (long long)n);
      if (n > INT64_MAX - total)
        return fail(err, "seq_lens (lengths): the total token count overflows int64 at seq_lens[%lld]", (long long)q);
      lengths[q] = n;
      starts[q] = total;
      total += n;
    }
  }
  int so64 = so->present && so->elem_type == PAKV_ONNX_INT64;
  for (int64_t q = 0; q < Q; q++) {
    int64_t off = so->present ? idx_at(so->data, so64, q) : 0;
    if (off < 0)
      return fail(err, "seq_offset must be non-negative, got seq_offset[%lld] = %lld", (long long)q, (long long)off);
    if (off % bs != 0)
      return fail(err, "seq_offset must be a multiple of block_size = %lld, got seq_offset[%lld] = %lld",
                  (long long)bs, (long long)q, (long long)off);
    cols0[q] = off / bs;
  }

  pakv_job* j = &p->job;
  j->nz = nz;
  j->nb = nb;
  j->bs = bs;
  j->kc = (const char*)kc->data;
  j->vc = (const char*)vc->data;
  j->k_row = k_row;
  j->v_row = v_row;
  j->num_seqs = Q;
  j->cols = cols;
  j->tables = bt->data;
  j->tables64 = bt->elem_type == PAKV_ONNX_INT64;
  j->lengths = lengths;
  j->out_starts = starts;
  j->col_starts = cols0;
  j->T = total;
  if (check_job(j, err)) return -1; /* block tables first, as the contract does */
  if ((k_row > 0 && total > INT64_MAX / k_row) || (v_row > 0 && total > INT64_MAX / v_row) ||
      (k_row + v_row > 0 && total > INT64_MAX / (k_row + v_row)))
    return fail(err, "key/value output of %lld tokens overflows int64 byte offsets (seq_lens)", (long long)total);
  if (!nz) {
    p->out_ndim = 3;
    p->k_out_dims[0] = p->v_out_dims[0] = total;
    p->k_out_dims[1] = ktok[0];
    p->k_out_dims[2] = ktok[1];
    p->v_out_dims[1] = vtok[0];
    p->v_out_dims[2] = vtok[1];
  } else {
    p->out_ndim = 2;
    p->k_out_dims[0] = p->v_out_dims[0] = total;
    p->k_out_dims[1] = ktok[0];
    p->v_out_dims[1] = vtok[0];
  }
  return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* Backends and the Python callback                                                            */
/* ------------------------------------------------------------------------------------------- */
typedef struct pakv_request {
  const char* backend;    /* registry name, e.g. "golden" */
  const char* cache_mode; /* "Norm" / "PA_NZ" */
  int64_t is_seq_lens_cumsum;
  pakv_tensor inputs[PAKV_NUM_INPUTS];
  OrtKernelContext* ctx;
  const OrtApi* api;
  char error[PAKV_ERR_LEN];
} pakv_request;

typedef int (*pakv_python_fn)(pakv_request* req);

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_backend_names[PAKV_MAX_BACKENDS][PAKV_BACKEND_NAME_LEN] = {"native"};
static int g_backend_count = 1;
static int g_next_backend = 0; /* slot the next RegisterCustomOps call binds its ops to */
static _Atomic(pakv_python_fn) g_python_fn = NULL;
static atomic_int g_python_enabled = 0;
static atomic_long g_python_inflight = 0;

PAKV_EXPORT int pakv_select_backend_for_next_registration(const char* name) {
  if (!name || strlen(name) >= PAKV_BACKEND_NAME_LEN) return -1;
  pthread_mutex_lock(&g_lock);
  int slot = -1;
  for (int i = 0; i < g_backend_count; i++)
    if (strcmp(g_backend_names[i], name) == 0) slot = i;
  if (slot < 0 && g_backend_count < PAKV_MAX_BACKENDS) {
    slot = g_backend_count++;
    strcpy(g_backend_names[slot], name);
  }
  if (slot >= 0) g_next_backend = slot;
  pthread_mutex_unlock(&g_lock);
  return slot;
}

PAKV_EXPORT void pakv_set_python_callback(pakv_python_fn fn) {
  atomic_store(&g_python_fn, fn);
  atomic_store(&g_python_enabled, fn != NULL);
}

/* Stop calling into Python (interpreter exit) and wait up to timeout_ms for calls in flight. */
PAKV_EXPORT long pakv_python_shutdown(int timeout_ms) {
  atomic_store(&g_python_enabled, 0);
  for (int waited = 0; waited < timeout_ms; waited++) {
    if (atomic_load(&g_python_inflight) == 0) break;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  return atomic_load(&g_python_inflight);
}

PAKV_EXPORT int pakv_api_version(void) { return PAKV_ORT_API_VERSION; }
PAKV_EXPORT int pakv_cache_dtype_count(void) { return PAKV_NUM_DTYPES; }
PAKV_EXPORT int pakv_cache_dtype_at(int i, int* onnx_type, int* itemsize) {
  if (i < 0 || i >= PAKV_NUM_DTYPES) return -1;
  *onnx_type = CACHE_DTYPES[i].onnx_type;
  *itemsize = CACHE_DTYPES[i].itemsize;
  return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* ORT glue                                                                                    */
/* ------------------------------------------------------------------------------------------- */
typedef struct {
  PakvOrtCustomOp base; /* first: ORT sees an OrtCustomOp* */
  int dtype;            /* index into CACHE_DTYPES */
  int backend;          /* slot in g_backend_names */
} pakv_op;

typedef struct {
  const OrtApi* api;
  int dtype, backend, nz;
  int64_t cumsum;
} pakv_kernel;

static pakv_op g_ops[PAKV_MAX_BACKENDS][PAKV_NUM_DTYPES];
static int g_ops_ready[PAKV_MAX_BACKENDS];

static OrtStatus* make_status(const OrtApi* api, int code, const char* msg) {
  return PAKV_API(api, CreateStatus)(code, msg);
}

/* Turn an ORT status into our error (with context) and release it. */
static int take_status(const OrtApi* api, OrtStatus* st, pakv_err* err, const char* what) {
  if (!st) return 0;
  snprintf(err->msg, sizeof(err->msg), "%s: %s", what, PAKV_API(api, GetErrorMessage)(st));
  PAKV_API(api, ReleaseStatus)(st);
  return -1;
}

static const char* op_name(const PakvOrtCustomOp* op) { (void)op; return PAKV_OP_TYPE; }
static const char* op_ep(const PakvOrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static int op_input_type(const PakvOrtCustomOp* op, size_t i) {
  return i < 2 ? CACHE_DTYPES[((const pakv_op*)op)->dtype].onnx_type : PAKV_ONNX_UNDEFINED;
}
static size_t op_input_count(const PakvOrtCustomOp* op) { (void)op; return PAKV_NUM_INPUTS; }
static int op_output_type(const PakvOrtCustomOp* op, size_t i) {
  (void)i;
  return CACHE_DTYPES[((const pakv_op*)op)->dtype].onnx_type;
}
static size_t op_output_count(const PakvOrtCustomOp* op) { (void)op; return PAKV_NUM_OUTPUTS; }
static int op_input_char(const PakvOrtCustomOp* op, size_t i) { (void)op; return i == 4 ? PAKV_ORT_OPTIONAL : PAKV_ORT_REQUIRED; }
static int op_output_char(const PakvOrtCustomOp* op, size_t i) { (void)op; (void)i; return PAKV_ORT_REQUIRED; }
static int op_mem_type(const PakvOrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; /* OrtMemTypeDefault */ }
static int op_min_arity(const PakvOrtCustomOp* op) { (void)op; return 1; }
static int op_homogeneity(const PakvOrtCustomOp* op) { (void)op; return 0; }

static OrtStatus* kernel_create(const PakvOrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  const pakv_op* o = (const pakv_op*)op;
  char mode[64] = "Norm";
  size_t size = sizeof(mode);
  OrtStatus* st = PAKV_API(api, KernelInfoGetAttribute_string)(info, "cache_mode", mode, &size);
  if (st) { /* absent (default) or longer than any valid value */
    PAKV_API(api, ReleaseStatus)(st);
    size_t need = 0;
    st = PAKV_API(api, KernelInfoGetAttribute_string)(info, "cache_mode", NULL, &need);
    if (st) {
      PAKV_API(api, ReleaseStatus)(st);
      strcpy(mode, "Norm");
    } else {
      return make_status(api, PAKV_ORT_INVALID_ARGUMENT, "cache_mode must be 'Norm' or 'PA_NZ', got a longer string");
    }
  }
  int nz;
  if (strcmp(mode, "Norm") == 0)
    nz = 0;
  else if (strcmp(mode, "PA_NZ") == 0)
    nz = 1;
  else {
    char msg[160];
    snprintf(msg, sizeof(msg), "cache_mode must be 'Norm' or 'PA_NZ', got '%s'", mode);
    return make_status(api, PAKV_ORT_INVALID_ARGUMENT, msg);
  }
  int64_t cumsum = 1;
  st = PAKV_API(api, KernelInfoGetAttribute_int64)(info, "is_seq_lens_cumsum", &cumsum);
  if (st) {
    PAKV_API(api, ReleaseStatus)(st);
    cumsum = 1;
  }
  if (cumsum != 0 && cumsum != 1) {
    char msg[160];
    snprintf(msg, sizeof(msg), "is_seq_lens_cumsum must be 0/1 or a bool, got %lld", (long long)cumsum);
    return make_status(api, PAKV_ORT_INVALID_ARGUMENT, msg);
  }
  pakv_kernel* k = (pakv_kernel*)calloc(1, sizeof(pakv_kernel));
  if (!k) return make_status(api, PAKV_ORT_FAIL, "GatherPaKvCache: out of memory creating the kernel");
  k->api = api;
  k->dtype = o->dtype;
  k->backend = o->backend;
  k->nz = nz;
  k->cumsum = cumsum;
  *out = k;
  return NULL;
}

static void kernel_destroy(void* kernel) { free(kernel); }

static int read_input(const OrtApi* api, OrtKernelContext* ctx, size_t count, size_t i, pakv_tensor* t,
                      pakv_err* err) {
  memset(t, 0, sizeof(*t));
  if (i >= count) return 0;
  const OrtValue* v = NULL;
  char what[64];
  snprintf(what, sizeof(what), "reading input %s", INPUT_NAMES[i]);
  if (take_status(api, PAKV_API(api, KernelContext_GetInput)(ctx, i, &v), err, what)) return -1;
  if (!v) return 0;
  OrtTensorTypeAndShapeInfo* info = NULL;
  if (take_status(api, PAKV_API(api, GetTensorTypeAndShape)(v, &info), err, what)) return -1;
  int type = 0;
  size_t nd = 0;
  int rc = take_status(api, PAKV_API(api, GetTensorElementType)(info, &type), err, what);
  if (!rc) rc = take_status(api, PAKV_API(api, GetDimensionsCount)(info, &nd), err, what);
  if (!rc && nd > PAKV_MAX_RANK) rc = fail(err, "%s has rank %zu, more than %d", INPUT_NAMES[i], nd, PAKV_MAX_RANK);
  if (!rc) rc = take_status(api, PAKV_API(api, GetDimensions)(info, t->dims, nd), err, what);
  PAKV_API(api, ReleaseTensorTypeAndShapeInfo)(info);
  if (rc) return -1;
  void* data = NULL;
  if (take_status(api, PAKV_API(api, GetTensorMutableData)((OrtValue*)v, &data), err, what)) return -1;
  t->present = 1;
  t->data = data;
  t->elem_type = type;
  t->ndim = (int32_t)nd;
  for (size_t d = 0; d < nd; d++)
    if (t->dims[d] < 0) return fail(err, "%s has a negative dimension", INPUT_NAMES[i]);
  return 0;
}

static void* get_output(const OrtApi* api, OrtKernelContext* ctx, size_t index, const int64_t* dims, size_t nd,
                        pakv_err* err) {
  OrtValue* out = NULL;
  void* data = NULL;
  const char* what = index == 0 ? "allocating output key" : "allocating output value";
  if (take_status(api, PAKV_API(api, KernelContext_GetOutput)(ctx, index, dims, nd, &out), err, what)) return NULL;
  if (take_status(api, PAKV_API(api, GetTensorMutableData)(out, &data), err, what)) return NULL;
  if (!data) {
    /* An empty output may have no buffer; callers never write through it. */
    static char empty;
    data = &empty;
  }
  return data;
}

PAKV_EXPORT void* pakv_request_output(pakv_request* req, int index, const int64_t* dims, int ndim) {
  pakv_err err;
  if (index < 0 || index >= PAKV_NUM_OUTPUTS || ndim < 0 || ndim > PAKV_MAX_RANK) {
    snprintf(req->error, sizeof(req->error), "bad output request (index %d, rank %d)", index, ndim);
    return NULL;
  }
  void* p = get_output(req->api, req->ctx, (size_t)index, dims, (size_t)ndim, &err);
  if (!p) memcpy(req->error, err.msg, sizeof(req->error));
  return p;
}

PAKV_EXPORT void pakv_request_set_error(pakv_request* req, const char* msg) {
  snprintf(req->error, sizeof(req->error), "%s", msg ? msg : "unknown error");
}

static OrtStatus* run_python(const pakv_kernel* k, OrtKernelContext* ctx, pakv_request* req) {
  const OrtApi* api = k->api;
  atomic_fetch_add(&g_python_inflight, 1);
  pakv_python_fn fn = atomic_load(&g_python_fn);
  if (!atomic_load(&g_python_enabled) || !fn) {
    atomic_fetch_sub(&g_python_inflight, 1);
    char msg[256];
    snprintf(msg, sizeof(msg),
             "GatherPaKvCache backend '%s' needs the Python bridge (pakv_onnx.runtime_plugin), which is not active in "
             "this process (never imported, or the interpreter is shutting down); use backend 'native'",
             g_backend_names[k->backend]);
    return make_status(api, PAKV_ORT_FAIL, msg);
  }
  req->backend = g_backend_names[k->backend];
  req->cache_mode = k->nz ? "PA_NZ" : "Norm";
  req->is_seq_lens_cumsum = k->cumsum;
  req->ctx = ctx;
  req->api = api;
  req->error[0] = 0;
  int rc = fn(req);
  atomic_fetch_sub(&g_python_inflight, 1);
  if (rc != 0) return make_status(api, PAKV_ORT_INVALID_ARGUMENT, req->error[0] ? req->error : "Python backend failed");
  return NULL;
}

static OrtStatus* kernel_compute(void* kernel, OrtKernelContext* ctx) {
  const pakv_kernel* k = (const pakv_kernel*)kernel;
  const OrtApi* api = k->api;
  pakv_request* req = (pakv_request*)malloc(sizeof(pakv_request));
  if (!req) return make_status(api, PAKV_ORT_FAIL, "GatherPaKvCache: out of memory");
  pakv_err err;
  size_t count = 0;
  OrtStatus* result = NULL;
  if (take_status(api, PAKV_API_AS(api, KernelContext_GetInputCount, KernelContext_GetCount)(ctx, &count), &err,
                  "counting inputs"))
    goto error;
  for (size_t i = 0; i < PAKV_NUM_INPUTS; i++)
    if (read_input(api, ctx, count, i, &req->inputs[i], &err)) goto error;
  for (size_t i = 0; i < 4; i++)
    if (!req->inputs[i].present) {
      fail(&err, "%s is required", INPUT_NAMES[i]);
      goto error;
    }
  if (k->backend != 0) {
    result = run_python(k, ctx, req);
    free(req);
    return result;
  }
  pakv_prepared p;
  if (prepare(req->inputs, k->nz, (int)k->cumsum, &p, &err)) {
    free(p.scratch);
    goto error;
  }
  p.job.ko = (char*)get_output(api, ctx, 0, p.k_out_dims, (size_t)p.out_ndim, &err);
  if (p.job.ko) p.job.vo = (char*)get_output(api, ctx, 1, p.v_out_dims, (size_t)p.out_ndim, &err);
  if (!p.job.ko || !p.job.vo) {
    free(p.scratch);
    goto error;
  }
  run_job(&p.job);
  free(p.scratch);
  free(req);
  return NULL;
error:
  free(req);
  return make_status(api, PAKV_ORT_INVALID_ARGUMENT, err.msg);
}

static void init_ops(int backend) {
  for (int d = 0; d < PAKV_NUM_DTYPES; d++) {
    pakv_op* o = &g_ops[backend][d];
    memset(o, 0, sizeof(*o));
    o->base.version = PAKV_ORT_API_VERSION;
    o->base.GetName = op_name;
    o->base.GetExecutionProviderType = op_ep;
    o->base.GetInputType = op_input_type;
    o->base.GetInputTypeCount = op_input_count;
    o->base.GetOutputType = op_output_type;
    o->base.GetOutputTypeCount = op_output_count;
    o->base.KernelDestroy = kernel_destroy;
    o->base.GetInputCharacteristic = op_input_char;
    o->base.GetOutputCharacteristic = op_output_char;
    o->base.GetInputMemoryType = op_mem_type;
    o->base.GetVariadicInputMinArity = op_min_arity;
    o->base.GetVariadicInputHomogeneity = op_homogeneity;
    o->base.GetVariadicOutputMinArity = op_min_arity;
    o->base.GetVariadicOutputHomogeneity = op_homogeneity;
    o->base.CreateKernelV2 = kernel_create;
    o->base.KernelComputeV2 = kernel_compute;
    o->dtype = d;
    o->backend = backend;
  }
}

PAKV_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(PAKV_ORT_API_VERSION);
  if (!api) {
    /* Older runtime: find any API table to report the error with (CreateStatus is slot 0 in all). */
    for (uint32_t v = PAKV_ORT_API_VERSION - 1; v >= 1 && !api; v--) api = api_base->GetApi(v);
    if (!api) return NULL; /* cannot even report; ORT this old has no usable API */
    char msg[256];
    snprintf(msg, sizeof(msg),
             "pakv GatherPaKvCache plugin needs ONNX Runtime >= 1.16 (C API version %d); this runtime is %s",
             PAKV_ORT_API_VERSION, api_base->GetVersionString ? api_base->GetVersionString() : "older");
    return make_status(api, PAKV_ORT_FAIL, msg);
  }
  pthread_mutex_lock(&g_lock);
  int backend = g_next_backend;
  g_next_backend = 0; /* one registration per selection; hosts that never select get native */
  if (!g_ops_ready[backend]) {
    init_ops(backend);
    g_ops_ready[backend] = 1;
  }
  pthread_mutex_unlock(&g_lock);

  /* One domain per registration (ORT requires it to outlive the sessions using it, so it is kept
   * for the life of the process; it holds only pointers to the static ops). */
  OrtCustomOpDomain* domain = NULL;
  OrtStatus* st = PAKV_API(api, CreateCustomOpDomain)(PAKV_DOMAIN, &domain);
  if (st) return st;
  for (int d = 0; d < PAKV_NUM_DTYPES; d++) {
    st = PAKV_API(api, CustomOpDomain_Add)(domain, &g_ops[backend][d]);
    if (st) return st;
  }
  return PAKV_API(api, AddCustomOpDomain)(options, domain);
}

/* ------------------------------------------------------------------------------------------- */
/* Direct entry point for pakv_onnx.kernels.native (a validated plan, int64 index arrays)      */
/* ------------------------------------------------------------------------------------------- */
PAKV_EXPORT int pakv_gather_plan(int nz, int64_t nb, int64_t bs, const void* kc, const void* vc, int64_t k_row,
                                 int64_t v_row, void* ko, void* vo, int64_t num_seqs, int64_t cols,
                                 const int64_t* tables, const int64_t* lengths, const int64_t* out_starts,
                                 const int64_t* col_starts, int64_t T, char* err_out, size_t err_len) {
  pakv_err err;
  err.msg[0] = 0;
  int rc = 0;
  if (bs < 1 || nb < 0 || T < 0 || num_seqs < 0 || cols < 0 || k_row < 0 || v_row < 0 ||
      (nz && (k_row % PAKV_NZ_FRACTAL_BYTES || v_row % PAKV_NZ_FRACTAL_BYTES)))
    rc = fail(&err, "invalid plan geometry");
  pakv_job j = {nz, nb, bs, (const char*)kc, (const char*)vc, k_row, v_row, (char*)ko, (char*)vo, num_seqs, cols,
                tables, 1, lengths, out_starts, col_starts, T};
  if (!rc) rc = check_job(&j, &err);
  if (rc) {
    if (err_out && err_len) snprintf(err_out, err_len, "%s", err.msg);
    return -1;
  }
  run_job(&j);
  return 0;
}
