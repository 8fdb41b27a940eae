/* A CUDA call's copies in one launch (pakv_device_internal.h): the copy kernel (pakv_cuda_copy.cu; its
 * PTX embedded, loaded with cuModuleLoadData per context) where the driver can load it, else
 * cuMemcpyBatchAsync where the driver has it, else one cuMemcpyDtoDAsync_v2 per copy. The kernel comes
 * first because it was the fastest on an H200 (tests/device/gpu_check.py, 2026-12-04): the batched
 * copy cost what one copy per run costs. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "pakv_cuda_copy_ptx.h"
#include "pakv_device.h"
#include "pakv_device_internal.h"

typedef struct {
  const pakv_driver* d;
  pakv_copy_list* list;
  void* stream;
  const char* op;
  pakv_err* err;
} cuda_call;

int pakv_cuda_failed(const pakv_driver* d, pakv_err* err, const char* op, const char* call, pakv_CUresult rc) {
  const char* name = NULL;
  if (d->cu_error_name && d->cu_error_name(rc, &name) != PAKV_CUDA_SUCCESS) name = NULL;
  return pakv_fail(err, "%s (CUDAExecutionProvider): %s failed with CUresult %d (%s)", op, call, rc,
                   name ? name : "no name from cuGetErrorName");
}

void pakv_copy_list_append(pakv_copy_list* l, uintptr_t dst, uintptr_t src, size_t bytes) {
  if (l->no_memory) return;
  if (l->count == l->capacity) {
    size_t capacity = l->capacity ? 2 * l->capacity : 64;
    pakv_CUdeviceptr* dsts = (pakv_CUdeviceptr*)realloc(l->dst, capacity * sizeof(*dsts));
    if (dsts) l->dst = dsts;
    pakv_CUdeviceptr* srcs = dsts ? (pakv_CUdeviceptr*)realloc(l->src, capacity * sizeof(*srcs)) : NULL;
    if (srcs) l->src = srcs;
    size_t* sizes = srcs ? (size_t*)realloc(l->bytes, capacity * sizeof(*sizes)) : NULL;
    if (!sizes) {
      l->no_memory = 1;
      return;
    }
    l->bytes = sizes;
    l->capacity = capacity;
  }
  l->dst[l->count] = (pakv_CUdeviceptr)dst;
  l->src[l->count] = (pakv_CUdeviceptr)src;
  l->bytes[l->count++] = bytes;
}

void pakv_copy_list_free(pakv_copy_list* l) {
  free(l->dst);
  free(l->src);
  free(l->bytes);
  memset(l, 0, sizeof(*l));
}

/* ------------------------------------------------------------------------------------------- */
/* CUDA: a call's copies in one launch                                                         */
/* ------------------------------------------------------------------------------------------- */
/* How a call's collected copies went (pakv_cuda_copy_paths counts them; PAKV_ONNX_CUDA_COPY forces one). */
enum { PATH_RUNS = 0, PATH_BATCH, PATH_KERNEL, NUM_PATHS };
static const char* const PATH_NAMES[NUM_PATHS] = {"runs", "batch", "kernel"};
static atomic_llong g_path_counts[NUM_PATHS];

/* Exported for the GPU check and the tests: calls per path since the library loaded ([runs, batch, kernel]). */
PAKV_EXPORT void pakv_cuda_copy_paths(long long counts[3]) {
  for (int i = 0; i < NUM_PATHS; i++) counts[i] = atomic_load(&g_path_counts[i]);
}

/* PAKV_ONNX_CUDA_COPY: "batch", "kernel" or "runs" forces that path (the GPU check compares them); unset
 * or "auto": the kernel where the driver can load it, else the batched copy, else one copy per run. */
static int forced_path(void) {
  const char* v = getenv(PAKV_CUDA_COPY_ENV);
  for (int i = 0; v && i < NUM_PATHS; i++)
    if (strcmp(v, PATH_NAMES[i]) == 0) return i;
  return -1;
}

/* Kernel pieces: runs split so one thread block copies at most piece_bytes() at a time: 64 KiB, or
 * more for a large call, so that a call has at most about PAKV_COPY_TARGET_PIECES pieces beyond one
 * per run (a 1 GB gather of 256 KiB blocks: 4,096 pieces, a 98 KB list, not 16,384 and 393 KB). */
#define PAKV_COPY_PIECE_BYTES ((size_t)64 * 1024)
#define PAKV_COPY_TARGET_PIECES ((size_t)2048)
#define PAKV_COPY_THREADS 256u
#define PAKV_COPY_MAX_BLOCKS ((size_t)1 << 16)
/* pakv_cuda_copy.cu's pakv_copy_inline, mirrored: a list of at most this many pieces is the launch's
 * parameter (no device memory, no upload: the stream-ordered allocation alone cost ~100 us a call on
 * an H200, its pool handing the memory back at every synchronization). */
#define PAKV_COPY_INLINE_RUNS 160
typedef struct {
  unsigned long long count;
  unsigned long long runs[PAKV_COPY_INLINE_RUNS][3]; /* dst, src, bytes */
} copy_inline;
_Static_assert(sizeof(copy_inline) == 3848, "pakv_copy_inline's size in pakv_cuda_copy.cu");
_Static_assert(sizeof(pakv_CUmemPoolProps) == 88, "CUmemPoolProps' size in cuda.h");
/* Contexts whose module was loaded (a module belongs to one context). */
#define PAKV_COPY_MAX_CONTEXTS 16

typedef struct {
  pakv_CUcontext ctx;
  pakv_CUfunction function; /* pakv_copy_runs: the list in device memory */
  pakv_CUfunction inline_function; /* pakv_copy_runs_inline: the list in the parameter */
  pakv_CUmemoryPool pool;          /* the library's pool for long lists; NULL: the device's current pool */
} loaded_kernel;
static loaded_kernel g_kernels[PAKV_COPY_MAX_CONTEXTS];
static pthread_mutex_t g_kernel_lock = PTHREAD_MUTEX_INITIALIZER;

/* A pool on the current context's device that keeps what it has taken (release threshold: all), or
 * NULL where the driver lacks the calls or refuses (the device's current pool then serves). */
static pakv_CUmemoryPool own_pool(const pakv_driver* d) {
  pakv_CUdevice device = 0;
  if (!d->cu_ctx_device || !d->cu_pool_create || !d->cu_pool_set || !d->cu_alloc_from_pool ||
      d->cu_ctx_device(&device) != PAKV_CUDA_SUCCESS)
    return NULL;
  pakv_CUmemPoolProps props;
  memset(&props, 0, sizeof(props));
  props.allocType = PAKV_CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = PAKV_CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = device;
  pakv_CUmemoryPool pool = NULL;
  uint64_t keep = UINT64_MAX; /* bounded by the largest list in flight at once: 24 bytes a piece */
  if (d->cu_pool_create(&pool, &props) != PAKV_CUDA_SUCCESS || !pool ||
      d->cu_pool_set(pool, PAKV_CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep) != PAKV_CUDA_SUCCESS)
    return NULL; /* a pool made but not configured is left alone: it holds nothing */
  return pool;
}

/* The copy kernels of the current context, loaded from the embedded PTX on first use there; NULL when
 * the driver lacks a call it needs or the load fails (the caller falls back to the copies). */
static const loaded_kernel* copy_kernel(const pakv_driver* d) {
  pakv_CUcontext ctx = NULL;
  if (!d->cu_module_load || !d->cu_module_function || !d->cu_launch || !d->cu_alloc_async || !d->cu_free_async ||
      !d->cu_upload || !d->cu_ctx_get || d->cu_ctx_get(&ctx) != PAKV_CUDA_SUCCESS || !ctx)
    return NULL;
  const loaded_kernel* found = NULL;
  pthread_mutex_lock(&g_kernel_lock);
  int i = 0;
  for (; i < PAKV_COPY_MAX_CONTEXTS && g_kernels[i].ctx; i++)
    if (g_kernels[i].ctx == ctx) found = &g_kernels[i];
  if (!found && i < PAKV_COPY_MAX_CONTEXTS) {
    pakv_CUmodule module = NULL;
    pakv_CUfunction function = NULL, inline_function = NULL;
    if (d->cu_module_load(&module, PAKV_CUDA_COPY_PTX) == PAKV_CUDA_SUCCESS &&
        d->cu_module_function(&function, module, "pakv_copy_runs") == PAKV_CUDA_SUCCESS && function &&
        d->cu_module_function(&inline_function, module, "pakv_copy_runs_inline") == PAKV_CUDA_SUCCESS &&
        inline_function) {
      g_kernels[i].function = function;
      g_kernels[i].inline_function = inline_function;
      g_kernels[i].pool = own_pool(d);
      g_kernels[i].ctx = ctx; /* last: a reader matching ctx sees both functions (under the lock anyway) */
      found = &g_kernels[i];
    }
  }
  pthread_mutex_unlock(&g_kernel_lock);
  return found;
}

/* The call's piece size: PAKV_COPY_PIECE_BYTES, or the total over PAKV_COPY_TARGET_PIECES rounded
 * up to 16 bytes (a multiple of 16 keeps aligned runs' pieces aligned for the 16-byte copy). The
 * runs' sizes sum without overflow: each is a slice of one of two caches the validator sized. */
static size_t piece_bytes(const pakv_copy_list* l) {
  size_t total = 0;
  for (size_t i = 0; i < l->count; i++) total += l->bytes[i];
  size_t share = (total / PAKV_COPY_TARGET_PIECES + 15) & ~(size_t)15;
  return share > PAKV_COPY_PIECE_BYTES ? share : PAKV_COPY_PIECE_BYTES;
}

/* Pieces of at most `piece` bytes covering the list's runs, in order. */
static size_t count_pieces(const pakv_copy_list* l, size_t piece) {
  size_t pieces = 0;
  for (size_t i = 0; i < l->count; i++) pieces += l->bytes[i] / piece + (l->bytes[i] % piece != 0);
  return pieces;
}

static void fill_pieces(const pakv_copy_list* l, size_t piece, unsigned long long (*out)[3]) {
  size_t n = 0;
  for (size_t i = 0; i < l->count; i++)
    for (size_t at = 0; at < l->bytes[i]; at += piece, n++) {
      out[n][0] = l->dst[i] + at;
      out[n][1] = l->src[i] + at;
      out[n][2] = l->bytes[i] - at < piece ? l->bytes[i] - at : piece;
    }
}

static unsigned int grid_for(size_t pieces) {
  return (unsigned int)(pieces < PAKV_COPY_MAX_BLOCKS ? pieces : PAKV_COPY_MAX_BLOCKS);
}

/* A short list in the launch's parameter: nothing allocated, nothing uploaded. */
static int inline_copies(cuda_call* c, pakv_CUfunction function, size_t piece, size_t pieces) {
  copy_inline list;
  list.count = pieces;
  fill_pieces(c->list, piece, list.runs);
  void* params[] = {&list};
  pakv_CUresult rc = c->d->cu_launch(function, grid_for(pieces), 1, 1, PAKV_COPY_THREADS, 1, 1, 0, c->stream,
                                     params, NULL);
  return rc == PAKV_CUDA_SUCCESS ? 0 : pakv_cuda_failed(c->d, c->err, c->op, "cuLaunchKernel (pakv_copy_runs_inline)", rc);
}

/* The list as kernel pieces {dst, src, bytes} in one launch: in its parameter when short, else uploaded
 * into stream-ordered memory (the library's pool, else the device's current one) and freed in stream
 * order. 1: the kernel path is unavailable (nothing queued); 0 done; -1 error. The host array may be
 * freed at once: an upload from pageable memory is staged before the call returns. */
static int kernel_copies(cuda_call* c, const loaded_kernel* kernel) {
  size_t piece = piece_bytes(c->list), pieces = count_pieces(c->list, piece);
  if (pieces <= PAKV_COPY_INLINE_RUNS) return inline_copies(c, kernel->inline_function, piece, pieces);
  unsigned long long(*host)[3] = malloc(pieces * sizeof(*host));
  if (!host) return pakv_fail(c->err, "%s (CUDAExecutionProvider): out of memory for %zu copy pieces", c->op, pieces);
  fill_pieces(c->list, piece, host);
  pakv_CUdeviceptr runs = 0;
  size_t bytes = pieces * sizeof(*host);
  if (!kernel->pool || c->d->cu_alloc_from_pool(&runs, bytes, kernel->pool, c->stream) != PAKV_CUDA_SUCCESS)
    runs = 0;
  if (!runs && (c->d->cu_alloc_async(&runs, bytes, c->stream) != PAKV_CUDA_SUCCESS || !runs)) {
    free(host);
    return 1; /* no stream-ordered memory here (a device without memory pools): the copies instead */
  }
  pakv_CUresult rc = c->d->cu_upload(runs, host, bytes, c->stream);
  free(host);
  if (rc != PAKV_CUDA_SUCCESS) {
    c->d->cu_free_async(runs, c->stream);
    return pakv_cuda_failed(c->d, c->err, c->op, "cuMemcpyHtoDAsync_v2", rc);
  }
  unsigned long long count = pieces;
  void* params[] = {&runs, &count};
  rc = c->d->cu_launch(kernel->function, grid_for(pieces), 1, 1, PAKV_COPY_THREADS, 1, 1, 0, c->stream, params, NULL);
  pakv_CUresult freed = c->d->cu_free_async(runs, c->stream);
  if (rc != PAKV_CUDA_SUCCESS) return pakv_cuda_failed(c->d, c->err, c->op, "cuLaunchKernel (pakv_copy_runs)", rc);
  return freed == PAKV_CUDA_SUCCESS ? 0 : pakv_cuda_failed(c->d, c->err, c->op, "cuMemFreeAsync", freed);
}

static int batch_copies(cuda_call* c) {
  pakv_copy_list* l = c->list;
  pakv_CUmemcpyAttributes attributes;
  memset(&attributes, 0, sizeof(attributes));
  attributes.srcAccessOrder = PAKV_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
  size_t first = 0, failed = 0;
  pakv_CUresult rc;
  if (c->d->cu_batch_v2) {
    rc = c->d->cu_batch_v2(l->dst, l->src, l->bytes, l->count, &attributes, &first, 1, c->stream);
    return rc == PAKV_CUDA_SUCCESS ? 0 : pakv_cuda_failed(c->d, c->err, c->op, "cuMemcpyBatchAsync_v2", rc);
  }
  rc = c->d->cu_batch_v1(l->dst, l->src, l->bytes, l->count, &attributes, &first, 1, &failed, c->stream);
  return rc == PAKV_CUDA_SUCCESS ? 0 : pakv_cuda_failed(c->d, c->err, c->op, "cuMemcpyBatchAsync", rc);
}

static int issue(cuda_call* c) {
  pakv_copy_list* l = c->list;
  int rc = 0;
  if (l->no_memory) {
    rc = pakv_fail(c->err, "%s (CUDAExecutionProvider): out of memory for the list of copies", c->op);
  } else if (l->count) {
    int forced = forced_path(), batch = (c->d->cu_batch_v2 || c->d->cu_batch_v1) && c->stream != NULL;
    int path = forced >= 0 ? forced : l->count == 1 ? PATH_RUNS : PATH_KERNEL;
    if (path == PATH_KERNEL) {
      const loaded_kernel* kernel = copy_kernel(c->d);
      rc = kernel ? kernel_copies(c, kernel) : 1;
      if (rc == 1 && forced == PATH_KERNEL)
        rc = pakv_fail(c->err, "%s (CUDAExecutionProvider): %s=kernel, but the copy kernel is unavailable "
                       "(cuModuleLoadData, cuMemAllocAsync or a current context missing or failing)", c->op,
                       PAKV_CUDA_COPY_ENV);
      if (rc == 1) path = forced < 0 && batch ? PATH_BATCH : PATH_RUNS, rc = 0; /* an older driver */
    }
    if (path == PATH_BATCH)
      rc = batch ? batch_copies(c)
                 : pakv_fail(c->err, "%s (CUDAExecutionProvider): %s=batch, but the driver has no cuMemcpyBatchAsync "
                             "(CUDA >= 12.8) or the stream is the legacy default stream", c->op, PAKV_CUDA_COPY_ENV);
    for (size_t i = 0; path == PATH_RUNS && i < l->count && rc == 0; i++) {
      pakv_CUresult result = c->d->cu_memcpy(l->dst[i], l->src[i], l->bytes[i], c->stream);
      if (result != PAKV_CUDA_SUCCESS) rc = pakv_cuda_failed(c->d, c->err, c->op, "cuMemcpyDtoDAsync_v2", result);
    }
    if (rc == 0) atomic_fetch_add(&g_path_counts[path], 1);
  }
  pakv_copy_list_free(l);
  return rc;
}


int pakv_cuda_issue_copies(const pakv_driver* d, pakv_copy_list* l, void* stream, const char* op, pakv_err* err) {
  cuda_call c = {d, l, stream, op, err};
  return issue(&c);
}
