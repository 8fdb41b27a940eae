/* Device copies of a plan through the CUDA driver or AscendCL (see pakv_device.h). */
#include "pakv_device.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device_abi.h"
#include "pakv_device_internal.h"

/* ------------------------------------------------------------------------------------------- */
/* Drivers, opened on first use                                                                */
/* ------------------------------------------------------------------------------------------- */

typedef struct {
  const char* env;
  const char* library;
  const char* ep; /* who needs it, for the messages */
} pakv_driver_info;

static const pakv_driver_info DRIVERS[PAKV_NUM_DRIVERS] = {
    {PAKV_CUDA_DRIVER_ENV, PAKV_CUDA_DRIVER_LIBRARY, "CUDAExecutionProvider"},
    {PAKV_CANN_DRIVER_ENV, PAKV_CANN_DRIVER_LIBRARY, "CANNExecutionProvider"},
};

static pakv_driver g_drivers[PAKV_NUM_DRIVERS];
static atomic_int g_loaded[PAKV_NUM_DRIVERS];
static pthread_mutex_t g_load_lock = PTHREAD_MUTEX_INITIALIZER;

/* dlsym into *slot; a required symbol that is missing fails with its name. */
static int symbol(void* handle, const char* library, const char* name, void** slot, int required, pakv_err* err) {
  *slot = dlsym(handle, name);
  if (!*slot && required) return pakv_fail(err, "%s has no symbol %s (is it the driver library?)", library, name);
  return 0;
}

#define SYMBOL(name, field, required) symbol(h, path, name, (void**)&d.field, required, err)

static int open_driver(int which, pakv_driver* out, pakv_err* err) {
  const pakv_driver_info* info = &DRIVERS[which];
  const char* path = getenv(info->env);
  if (!path || !*path) path = info->library;
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* why = dlerror();
    return pakv_fail(err, "the %s entry of the pakv ops could not open its driver: dlopen(\"%s\") failed: %s (set %s "
                     "to the library's path if it is installed elsewhere)",
                     info->ep, path, why ? why : "unknown error", info->env);
  }
  pakv_driver d;
  memset(&d, 0, sizeof(d));
  d.handle = h;
  int rc = 0;
  if (which == PAKV_DRIVER_CUDA) {
    pakv_cuInit_fn init = NULL;
    rc = symbol(h, path, "cuInit", (void**)&init, 1, err) || SYMBOL("cuMemcpyDtoDAsync_v2", cu_memcpy, 1) ||
         SYMBOL("cuMemcpy2DAsync_v2", cu_memcpy_2d, 1) || SYMBOL("cuGetErrorName", cu_error_name, 0) ||
         SYMBOL("cuCtxGetCurrent", cu_ctx_get, 0) || SYMBOL("cuStreamGetCtx", cu_stream_ctx, 0) ||
         SYMBOL("cuCtxSetCurrent", cu_ctx_set, 0) || SYMBOL("cuMemcpyBatchAsync_v2", cu_batch_v2, 0) ||
         SYMBOL("cuMemcpyBatchAsync", cu_batch_v1, 0) || SYMBOL("cuModuleLoadData", cu_module_load, 0) ||
         SYMBOL("cuModuleGetFunction", cu_module_function, 0) || SYMBOL("cuLaunchKernel", cu_launch, 0) ||
         SYMBOL("cuMemAllocAsync", cu_alloc_async, 0) || SYMBOL("cuMemFreeAsync", cu_free_async, 0) ||
         SYMBOL("cuMemcpyHtoDAsync_v2", cu_upload, 0) || SYMBOL("cuCtxGetDevice", cu_ctx_device, 0) ||
         SYMBOL("cuMemPoolCreate", cu_pool_create, 0) || SYMBOL("cuMemPoolSetAttribute", cu_pool_set, 0) ||
         SYMBOL("cuMemAllocFromPoolAsync", cu_alloc_from_pool, 0);
    pakv_CUresult result = rc ? 0 : init(0); /* idempotent; ORT's CUDA runtime has normally done it already */
    if (!rc && result != PAKV_CUDA_SUCCESS) rc = pakv_fail(err, "cuInit(0) failed with CUresult %d", result);
  } else {
    rc = SYMBOL("aclrtMemcpyAsync", acl_memcpy, 1) || SYMBOL("aclrtMemcpy2dAsync", acl_memcpy_2d, 1) ||
         SYMBOL("aclGetRecentErrMsg", acl_message, 0);
  }
  if (rc) {
    dlclose(h);
    return -1;
  }
  *out = d;
  return 0;
}

/* The driver, opened on first use. A failed open is not remembered (the next call tries again). */
static const pakv_driver* driver(int which, pakv_err* err) {
  if (atomic_load_explicit(&g_loaded[which], memory_order_acquire)) return &g_drivers[which];
  pthread_mutex_lock(&g_load_lock);
  int rc = 0;
  if (!atomic_load_explicit(&g_loaded[which], memory_order_relaxed)) {
    rc = open_driver(which, &g_drivers[which], err);
    if (!rc) atomic_store_explicit(&g_loaded[which], 1, memory_order_release);
  }
  pthread_mutex_unlock(&g_load_lock);
  return rc ? NULL : &g_drivers[which];
}

/* ------------------------------------------------------------------------------------------- */
/* The copies                                                                                  */
/* ------------------------------------------------------------------------------------------- */
typedef struct {
  uintptr_t dst, src;
  size_t bytes;
} pending_copy;

typedef struct {
  int which;
  const pakv_driver* d;
  const pakv_plan* p;
  void* stream;
  pakv_err* err;
  const char* op; /* the op whose copies these are, for the messages */
  pending_copy pending[2]; /* Norm: the key's and the value's copy still being extended */
  pakv_copy_list list;          /* CUDA: every 1-D copy of the call, issued by pakv_cuda_issue_copies */
} device_copy;

static int cuda_failed(const device_copy* c, const char* call, pakv_CUresult rc) {
  return pakv_cuda_failed(c->d, c->err, c->op, call, rc);
}

/* `unaligned`: the failed call was an aclrtMemcpyAsync whose addresses are not 64-byte aligned. */
static int acl_failed(const device_copy* c, const char* call, pakv_aclError rc, int unaligned) {
  const char* recent = c->d->acl_message ? c->d->acl_message() : NULL;
  /* The one device-only rule of the CANN path: older CANN releases document that aclrtMemcpyAsync
   * needs 64-byte aligned source and destination addresses (newer ones do not). It is not checked
   * beforehand, only named here when a copy that broke it failed. */
  return pakv_fail(c->err, "%s (CANNExecutionProvider): %s failed with aclError %d%s%s%s", c->op, call, rc,
                   recent && *recent ? ": " : "", recent && *recent ? recent : "",
                   unaligned ? " (older CANN releases require 64-byte aligned source and destination addresses for "
                               "aclrtMemcpyAsync; this copy's were not: use rows of a multiple of 64 bytes)"
                             : "");
}

static int copy_1d(device_copy* c, uintptr_t dst, uintptr_t src, size_t bytes) {
  if (!bytes) return 0;
  if (c->which == PAKV_DRIVER_CUDA) {
    pakv_CUresult rc = c->d->cu_memcpy((pakv_CUdeviceptr)dst, (pakv_CUdeviceptr)src, bytes, c->stream);
    return rc == PAKV_CUDA_SUCCESS ? 0 : cuda_failed(c, "cuMemcpyDtoDAsync_v2", rc);
  }
  pakv_aclError rc = c->d->acl_memcpy((void*)dst, bytes, (const void*)src, bytes, PAKV_ACL_MEMCPY_DEVICE_TO_DEVICE,
                                      c->stream);
  return rc == PAKV_ACL_SUCCESS ? 0 : acl_failed(c, "aclrtMemcpyAsync", rc, ((dst | src) % 64) != 0);
}

/* `height` rows of `width` bytes, rows `spitch` / `dpitch` bytes apart. */
static int copy_2d(device_copy* c, uintptr_t dst, size_t dpitch, uintptr_t src, size_t spitch, size_t width,
                   size_t height) {
  if (c->which == PAKV_DRIVER_CUDA) {
    pakv_CUDA_MEMCPY2D m;
    memset(&m, 0, sizeof(m));
    m.srcMemoryType = PAKV_CU_MEMORYTYPE_DEVICE;
    m.srcDevice = (pakv_CUdeviceptr)src;
    m.srcPitch = spitch;
    m.dstMemoryType = PAKV_CU_MEMORYTYPE_DEVICE;
    m.dstDevice = (pakv_CUdeviceptr)dst;
    m.dstPitch = dpitch;
    m.WidthInBytes = width;
    m.Height = height;
    pakv_CUresult rc = c->d->cu_memcpy_2d(&m, c->stream);
    return rc == PAKV_CUDA_SUCCESS ? 0 : cuda_failed(c, "cuMemcpy2DAsync_v2", rc);
  }
  for (size_t done = 0; done < height;) { /* aclrtMemcpy2dAsync takes at most 5 Mi rows a call */
    size_t rows = height - done < PAKV_ACL_MEMCPY2D_MAX_HEIGHT ? height - done : PAKV_ACL_MEMCPY2D_MAX_HEIGHT;
    pakv_aclError rc = c->d->acl_memcpy_2d((void*)(dst + done * dpitch), dpitch, (const void*)(src + done * spitch),
                                           spitch, width, rows, PAKV_ACL_MEMCPY_DEVICE_TO_DEVICE, c->stream);
    if (rc != PAKV_ACL_SUCCESS) return acl_failed(c, "aclrtMemcpy2dAsync", rc, 0);
    done += rows;
  }
  return 0;
}

/* The pending copy of cache `which`: CUDA collects it (issued at the end), AscendCL issues it now. */
static int flush(device_copy* c, int which) {
  pending_copy* p = &c->pending[which];
  int rc = 0;
  if (p->bytes && c->which == PAKV_DRIVER_CUDA) pakv_copy_list_append(&c->list, p->dst, p->src, p->bytes);
  else rc = copy_1d(c, p->dst, p->src, p->bytes);
  p->bytes = 0;
  return rc;
}

/* Norm: the run's rows are contiguous in the block and in the output; a run that starts where the
 * pending copy ends, in both, extends it. */
static int norm_run(device_copy* c, int which, const char* cache, int64_t stride, int64_t row, char* out,
                    int64_t block, int64_t slot, int64_t n, int64_t out_row) {
  if (!row) return 0;
  uintptr_t src = (uintptr_t)(cache + block * stride + slot * row), dst = (uintptr_t)(out + out_row * row);
  size_t bytes = (size_t)(n * row);
  pending_copy* p = &c->pending[which];
  if (p->bytes && p->src + p->bytes == src && p->dst + p->bytes == dst) {
    p->bytes += bytes;
    return 0;
  }
  if (flush(c, which)) return -1;
  p->dst = dst;
  p->src = src;
  p->bytes = bytes;
  return 0;
}

/* PA_NZ: fractal f of token (block, slot) is 32 bytes at block*stride + (f*bs + slot)*32; in the
 * output, token r's fractal f is at r*row + f*32. */
static int nz_run(device_copy* c, const char* cache, int64_t stride, int64_t row, char* out, int64_t block,
                  int64_t slot, int64_t n, int64_t out_row) {
  const size_t F = PAKV_NZ_FRACTAL_BYTES;
  int64_t fractals = row / PAKV_NZ_FRACTAL_BYTES, bs = c->p->block_size;
  uintptr_t src = (uintptr_t)(cache + block * stride + slot * PAKV_NZ_FRACTAL_BYTES);
  uintptr_t dst = (uintptr_t)(out + out_row * row);
  if (fractals <= n) { /* per fractal: its n rows, 32 bytes apart in the block, `row` apart in the output */
    for (int64_t f = 0; f < fractals; f++)
      if (copy_2d(c, dst + (size_t)f * F, (size_t)row, src + (size_t)(f * bs) * F, F, F, (size_t)n)) return -1;
  } else { /* per token: its fractals, bs*32 bytes apart in the block, contiguous in the output */
    for (int64_t r = 0; r < n; r++)
      if (copy_2d(c, dst + (size_t)(r * row), F, src + (size_t)r * F, (size_t)bs * F, F, (size_t)fractals)) return -1;
  }
  return 0;
}

static int device_run(void* ctx, int64_t block, int64_t slot, int64_t n, int64_t out_row) {
  device_copy* c = (device_copy*)ctx;
  const pakv_plan* p = c->p;
  if (p->layout == PAKV_LAYOUT_NORM)
    return norm_run(c, 0, p->key_cache, p->key_block_stride, p->key_row_bytes, p->key_out, block, slot, n, out_row) ||
           norm_run(c, 1, p->value_cache, p->value_block_stride, p->value_row_bytes, p->value_out, block, slot, n,
                    out_row);
  return nz_run(c, p->key_cache, p->key_block_stride, p->key_row_bytes, p->key_out, block, slot, n, out_row) ||
         nz_run(c, p->value_cache, p->value_block_stride, p->value_row_bytes, p->value_out, block, slot, n, out_row);
}

/* A thread that never used the CUDA runtime has no current context; the driver calls then need
 * the stream's. */
static void bind_stream_context(const pakv_driver* d, void* stream) {
  pakv_CUcontext current = NULL, ctx = NULL;
  if (!d->cu_ctx_get || !d->cu_stream_ctx || !d->cu_ctx_set || !stream) return;
  if (d->cu_ctx_get(&current) == PAKV_CUDA_SUCCESS && current) return;
  if (d->cu_stream_ctx(stream, &ctx) == PAKV_CUDA_SUCCESS && ctx) d->cu_ctx_set(ctx);
}

/* A copier for `which` on `stream` (its driver opened; NULL with err set when it cannot be). */
static int start_copies(int which, const char* op, void* stream, pakv_err* err, device_copy* c) {
  if (which < 0 || which >= PAKV_NUM_DRIVERS) return pakv_fail(err, "unknown device driver %d", which);
  const pakv_driver* d = driver(which, err);
  if (!d) return -1;
  if (which == PAKV_DRIVER_CUDA) bind_stream_context(d, stream);
  memset(c, 0, sizeof(*c));
  c->which = which;
  c->d = d;
  c->stream = stream;
  c->err = err;
  c->op = op;
  return 0;
}

/* The pending copies flushed, then (CUDA) the collected list issued; the list freed either way. */
static int finish_copies(device_copy* c) {
  int rc = flush(c, 0) || flush(c, 1);
  if (!rc && c->which == PAKV_DRIVER_CUDA) return pakv_cuda_issue_copies(c->d, &c->list, c->stream, c->op, c->err);
  pakv_copy_list_free(&c->list);
  return rc;
}

int pakv_device_copy(int which, void* dst, const void* src, size_t bytes, void* stream, pakv_err* err) {
  device_copy c = {0};
  if (!bytes) return 0;
  if (start_copies(which, "ScatterPaKvCache", stream, err, &c)) return -1;
  return copy_1d(&c, (uintptr_t)dst, (uintptr_t)src, bytes);
}

/* One token row into its slot: Norm a row (merged with the pending copy when it continues it in
 * both), PA_NZ its fractals with one 2-D copy (32 bytes apart in the source, bs*32 in the block). */
static int scatter_row(device_copy* c, int which, int nz, char* cache, int64_t stride, int64_t row, int64_t bs,
                       int64_t block, int64_t slot, const char* src) {
  if (!row) return 0;
  const size_t F = PAKV_NZ_FRACTAL_BYTES;
  if (nz)
    return copy_2d(c, (uintptr_t)(cache + block * stride + slot * PAKV_NZ_FRACTAL_BYTES), (size_t)bs * F,
                   (uintptr_t)src, F, F, (size_t)(row / PAKV_NZ_FRACTAL_BYTES));
  uintptr_t dst = (uintptr_t)(cache + block * stride + slot * row);
  pending_copy* p = &c->pending[which];
  if (p->bytes && p->src + p->bytes == (uintptr_t)src && p->dst + p->bytes == dst) {
    p->bytes += (size_t)row;
    return 0;
  }
  if (flush(c, which)) return -1;
  p->dst = dst;
  p->src = (uintptr_t)src;
  p->bytes = (size_t)row;
  return 0;
}

int pakv_device_run_scatter(int which, const pakv_scatter_plan* p, void* stream, pakv_err* err) {
  if (p->num_tokens == 0 || (p->key_row_bytes == 0 && p->value_row_bytes == 0)) return 0;
  device_copy c = {0};
  if (start_copies(which, "ScatterPaKvCache", stream, err, &c)) return -1;
  const int64_t bs = p->block_size, capacity = p->num_blocks * bs; /* fits: pakv_check_scatter_plan */
  const int nz = p->layout == PAKV_LAYOUT_NZ;
  int bad = 0;
  for (int64_t t = 0; t < p->num_tokens; t++) {
    const char* at = (const char*)p->slot_mapping + t * p->slot_stride;
    int64_t s = p->slots64 ? *(const volatile int64_t*)at : (int64_t) * (const volatile int32_t*)at;
    if (s < 0) continue; /* padding */
    if (s >= capacity) {
      bad = 1;
      continue;
    }
    if (scatter_row(&c, 0, nz, p->key_cache, p->key_block_stride, p->key_row_bytes, bs, s / bs, s % bs,
                    (const char*)p->key + t * p->key_token_stride) ||
        scatter_row(&c, 1, nz, p->value_cache, p->value_block_stride, p->value_row_bytes, bs, s / bs, s % bs,
                    (const char*)p->value + t * p->value_token_stride)) {
      pakv_copy_list_free(&c.list);
      return -1;
    }
  }
  if (finish_copies(&c)) return -1;
  if (bad)
    return pakv_fail(err, "slot_mapping changed after validation: a slot read during the scatter is outside [0, %lld)",
                     (long long)capacity);
  return 0;
}

int pakv_device_run_plan(int which, const pakv_plan* p, void* stream, pakv_err* err) {
  if (p->num_tokens == 0 || (p->key_row_bytes == 0 && p->value_row_bytes == 0)) return 0; /* nothing to copy */
  if ((p->key_row_bytes > 0 && !p->key_out) || (p->value_row_bytes > 0 && !p->value_out))
    return pakv_fail(err, "a NULL output pointer for a non-empty gather");
  device_copy c = {0};
  if (start_copies(which, "GatherPaKvCache", stream, err, &c)) return -1;
  c.p = p;
  int64_t bad = 0;
  if (pakv_for_each_run(p, 0, p->num_tokens, device_run, &c, &bad)) {
    pakv_copy_list_free(&c.list);
    return -1;
  }
  if (finish_copies(&c)) return -1;
  return bad ? pakv_fail_changed_tables(p, err) : 0;
}
