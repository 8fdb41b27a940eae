/* A CUDA call's copies in one launch (pakv_device_internal.h): cuMemcpyBatchAsync where the driver has
 * it, else one launch of the copy kernel (pakv_cuda_copy.cu; its PTX embedded, loaded with
 * cuModuleLoadData per context), else one cuMemcpyDtoDAsync_v2 per copy. */
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
 * or "auto": the batched copy where the driver has it, else the kernel, else one copy per run. */
static int forced_path(void) {
  const char* v = getenv(PAKV_CUDA_COPY_ENV);
  for (int i = 0; v && i < NUM_PATHS; i++)
    if (strcmp(v, PATH_NAMES[i]) == 0) return i;
  return -1;
}

/* Kernel pieces: runs split so one thread block copies at most this many bytes at a time. */
#define PAKV_COPY_PIECE_BYTES ((size_t)64 * 1024)
#define PAKV_COPY_THREADS 256u
#define PAKV_COPY_MAX_BLOCKS ((size_t)1 << 16)
/* Contexts whose module was loaded (a module belongs to one context). */
#define PAKV_COPY_MAX_CONTEXTS 16

typedef struct {
  pakv_CUcontext ctx;
  pakv_CUfunction function;
} loaded_kernel;
static loaded_kernel g_kernels[PAKV_COPY_MAX_CONTEXTS];
static pthread_mutex_t g_kernel_lock = PTHREAD_MUTEX_INITIALIZER;

/* The copy kernel of the current context, loaded from the embedded PTX on first use there; NULL when
 * the driver lacks a call it needs or the load fails (the caller falls back to the copies). */
static pakv_CUfunction copy_kernel(const pakv_driver* d) {
  pakv_CUcontext ctx = NULL;
  if (!d->cu_module_load || !d->cu_module_function || !d->cu_launch || !d->cu_alloc_async || !d->cu_free_async ||
      !d->cu_upload || !d->cu_ctx_get || d->cu_ctx_get(&ctx) != PAKV_CUDA_SUCCESS || !ctx)
    return NULL;
  pakv_CUfunction function = NULL;
  pthread_mutex_lock(&g_kernel_lock);
  int i = 0;
  for (; i < PAKV_COPY_MAX_CONTEXTS && g_kernels[i].ctx; i++)
    if (g_kernels[i].ctx == ctx) function = g_kernels[i].function;
  if (!function && i < PAKV_COPY_MAX_CONTEXTS) {
    pakv_CUmodule module = NULL;
    if (d->cu_module_load(&module, PAKV_CUDA_COPY_PTX) == PAKV_CUDA_SUCCESS &&
        d->cu_module_function(&function, module, "pakv_copy_runs") == PAKV_CUDA_SUCCESS && function) {
      g_kernels[i].ctx = ctx;
      g_kernels[i].function = function;
    } else {
      function = NULL;
    }
  }
  pthread_mutex_unlock(&g_kernel_lock);
  return function;
}

/* The list as kernel pieces {dst, src, bytes}, uploaded into stream-ordered memory, one launch, freed
 * in stream order. 1: the kernel path is unavailable (nothing queued); 0 done; -1 error. The host
 * array may be freed at once: an upload from pageable memory is staged before the call returns. */
static int kernel_copies(cuda_call* c, pakv_CUfunction function) {
  const pakv_copy_list* l = c->list;
  size_t pieces = 0;
  for (size_t i = 0; i < l->count; i++) pieces += (l->bytes[i] + PAKV_COPY_PIECE_BYTES - 1) / PAKV_COPY_PIECE_BYTES;
  uint64_t* host = (uint64_t*)malloc(pieces * 3 * sizeof(uint64_t));
  if (!host) return pakv_fail(c->err, "%s (CUDAExecutionProvider): out of memory for %zu copy pieces", c->op, pieces);
  size_t n = 0;
  for (size_t i = 0; i < l->count; i++)
    for (size_t at = 0; at < l->bytes[i]; at += PAKV_COPY_PIECE_BYTES, n++) {
      host[3 * n] = l->dst[i] + at;
      host[3 * n + 1] = l->src[i] + at;
      host[3 * n + 2] = l->bytes[i] - at < PAKV_COPY_PIECE_BYTES ? l->bytes[i] - at : PAKV_COPY_PIECE_BYTES;
    }
  pakv_CUdeviceptr runs = 0;
  size_t bytes = pieces * 3 * sizeof(uint64_t);
  if (c->d->cu_alloc_async(&runs, bytes, c->stream) != PAKV_CUDA_SUCCESS || !runs) {
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
  unsigned int blocks = (unsigned int)(pieces < PAKV_COPY_MAX_BLOCKS ? pieces : PAKV_COPY_MAX_BLOCKS);
  rc = c->d->cu_launch(function, blocks, 1, 1, PAKV_COPY_THREADS, 1, 1, 0, c->stream, params, NULL);
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
    int path = forced >= 0 ? forced : l->count == 1 ? PATH_RUNS : batch ? PATH_BATCH : PATH_KERNEL;
    if (path == PATH_BATCH)
      rc = batch ? batch_copies(c)
                 : pakv_fail(c->err, "%s (CUDAExecutionProvider): %s=batch, but the driver has no cuMemcpyBatchAsync "
                             "(CUDA >= 12.8) or the stream is the legacy default stream", c->op, PAKV_CUDA_COPY_ENV);
    if (path == PATH_KERNEL) {
      pakv_CUfunction kernel = copy_kernel(c->d);
      rc = kernel ? kernel_copies(c, kernel) : 1;
      if (rc == 1 && forced == PATH_KERNEL)
        rc = pakv_fail(c->err, "%s (CUDAExecutionProvider): %s=kernel, but the copy kernel is unavailable "
                       "(cuModuleLoadData, cuMemAllocAsync or a current context missing or failing)", c->op,
                       PAKV_CUDA_COPY_ENV);
      if (rc == 1) path = PATH_RUNS, rc = 0; /* an older driver: the copies */
    }
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
