/* A fake accelerator driver for the device entries' tests: the few CUDA driver and AscendCL
 * symbols libpakv_ort.so looks up (declared in pakv_onnx/native_lib/device_abi.h, included here
 * so nothing is a second copy), implemented with host memcpy ("device memory" is host memory the
 * tests hand ORT's fake as device tensors). Each copy checks what the real driver would refuse
 * (memory types, copy kind, a 2-D width wider than a pitch, a short destMax) and is counted per
 * function, with the streams it got; the tests read the counts and can make the n-th copy fail.
 *
 * The CUDA side is a CUDA 13 driver by default: besides the per-run copies it has the batched copy
 * (cuMemcpyBatchAsync_v2 and the 12.8 cuMemcpyBatchAsync) and what the copy kernel needs
 * (cuModuleLoadData ... cuLaunchKernel, stream-ordered memory). The kernel is "launched" by doing on
 * the host what pakv_cuda_copy.cu does on the device, after checking the module is the library's PTX
 * and its run list lives in memory from cuMemAllocAsync, uploaded and not yet freed. Built with
 * -DFAKE_NO_BATCH_V2, -DFAKE_NO_BATCH_V1, -DFAKE_NO_KERNEL it is an older driver without them.
 *
 * build: gcc -shared -fPIC -I pakv_onnx/native_lib -o libfake_device_driver.so fake_device_driver.c
 * use:   PAKV_ONNX_CUDA_DRIVER=/path/libfake_device_driver.so (and PAKV_ONNX_CANN_DRIVER) */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device_abi.h"

#define EXPORT __attribute__((visibility("default")))

enum { F_CU_1D, F_CU_2D, F_ACL_1D, F_ACL_2D, F_CU_INIT, F_CU_SET_CTX, F_MISUSE, F_WRONG_STREAM, F_CU_BATCH_V2,
       F_CU_BATCH_V1, F_BATCH_ENTRIES, F_CU_LAUNCH, F_KERNEL_PIECES, F_MODULE_LOAD, F_UPLOAD, F_LIVE, F_POOL_ALLOC,
       F_POOLS_KEEPING, F_COUNT };
static const char* const NAMES[F_COUNT] = {"cuMemcpyDtoDAsync_v2", "cuMemcpy2DAsync_v2", "aclrtMemcpyAsync",
                                           "aclrtMemcpy2dAsync", "cuInit", "cuCtxSetCurrent", "misuse",
                                           "wrong_stream", "cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync",
                                           "batch_entries", "cuLaunchKernel", "kernel_pieces", "cuModuleLoadData",
                                           "cuMemcpyHtoDAsync_v2", "live_allocations", "cuMemAllocFromPoolAsync",
                                           "pools_keeping"};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static long g_counts[F_COUNT];
static long g_copies;          /* copy calls since the last reset */
static long g_fail_at = -1;    /* this copy call fails (0-based), -1 never */
static int g_fail_code;
static void* g_expected_stream;
static int g_has_context = 1;  /* cuCtxGetCurrent answers a context */
static char g_recent[128];

EXPORT void fake_driver_reset(void* expected_stream, int has_context) {
  pthread_mutex_lock(&g_lock);
  long live = g_counts[F_LIVE], keeping = g_counts[F_POOLS_KEEPING];
  memset(g_counts, 0, sizeof(g_counts));
  g_counts[F_LIVE] = live; /* stream-ordered allocations outlive a reset, and so do pools */
  g_counts[F_POOLS_KEEPING] = keeping;
  g_copies = 0;
  g_fail_at = -1;
  g_expected_stream = expected_stream;
  g_has_context = has_context;
  g_recent[0] = 0;
  pthread_mutex_unlock(&g_lock);
}

EXPORT void fake_driver_fail_at(long call, int code) {
  pthread_mutex_lock(&g_lock);
  g_fail_at = call;
  g_fail_code = code;
  pthread_mutex_unlock(&g_lock);
}

EXPORT long fake_driver_count(const char* name) {
  long n = -1;
  pthread_mutex_lock(&g_lock);
  for (int i = 0; i < F_COUNT; i++)
    if (strcmp(NAMES[i], name) == 0) n = g_counts[i];
  pthread_mutex_unlock(&g_lock);
  return n;
}

/* Count a copy call; 0 to go on, else the code it must fail with (a forced failure or misuse). */
static int enter(int which, void* stream, int misuse, int misuse_code) {
  int rc = 0;
  pthread_mutex_lock(&g_lock);
  g_counts[which]++;
  if (stream != g_expected_stream) g_counts[F_WRONG_STREAM]++;
  if (misuse) {
    g_counts[F_MISUSE]++;
    rc = misuse_code;
  } else if (g_copies == g_fail_at) {
    rc = g_fail_code;
    snprintf(g_recent, sizeof(g_recent), "fake driver: copy %ld failed on purpose", g_copies);
  }
  g_copies++;
  pthread_mutex_unlock(&g_lock);
  return rc;
}

static void copy_rows(char* dst, size_t dpitch, const char* src, size_t spitch, size_t width, size_t height) {
  for (size_t r = 0; r < height; r++) memcpy(dst + r * dpitch, src + r * spitch, width);
}

/* --- CUDA driver ------------------------------------------------------------------------------ */
EXPORT pakv_CUresult cuInit(unsigned int flags) {
  pthread_mutex_lock(&g_lock);
  g_counts[F_CU_INIT]++;
  pthread_mutex_unlock(&g_lock);
  return flags == 0 ? PAKV_CUDA_SUCCESS : PAKV_CUDA_ERROR_INVALID_VALUE;
}

EXPORT pakv_CUresult cuMemcpyDtoDAsync_v2(pakv_CUdeviceptr dst, pakv_CUdeviceptr src, size_t bytes,
                                          pakv_CUstream stream) {
  int rc = enter(F_CU_1D, stream, !dst || !src, PAKV_CUDA_ERROR_INVALID_VALUE);
  if (!rc) memcpy((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, bytes);
  return rc;
}

EXPORT pakv_CUresult cuMemcpy2DAsync_v2(const pakv_CUDA_MEMCPY2D* m, pakv_CUstream stream) {
  int misuse = m->srcMemoryType != PAKV_CU_MEMORYTYPE_DEVICE || m->dstMemoryType != PAKV_CU_MEMORYTYPE_DEVICE ||
               m->WidthInBytes > m->srcPitch || m->WidthInBytes > m->dstPitch || m->srcXInBytes || m->srcY ||
               m->dstXInBytes || m->dstY || m->srcHost || m->dstHost || m->srcArray || m->dstArray;
  int rc = enter(F_CU_2D, stream, misuse, PAKV_CUDA_ERROR_INVALID_VALUE);
  if (!rc)
    copy_rows((char*)(uintptr_t)m->dstDevice, m->dstPitch, (const char*)(uintptr_t)m->srcDevice, m->srcPitch,
              m->WidthInBytes, m->Height);
  return rc;
}

EXPORT pakv_CUresult cuGetErrorName(pakv_CUresult error, const char** name) {
  *name = error == 1 ? "CUDA_ERROR_INVALID_VALUE" : error == 700 ? "CUDA_ERROR_ILLEGAL_ADDRESS" : "CUDA_ERROR_UNKNOWN";
  return PAKV_CUDA_SUCCESS;
}

static int g_context_token;
EXPORT pakv_CUresult cuCtxGetCurrent(pakv_CUcontext* ctx) {
  pthread_mutex_lock(&g_lock);
  *ctx = g_has_context ? &g_context_token : NULL;
  pthread_mutex_unlock(&g_lock);
  return PAKV_CUDA_SUCCESS;
}

EXPORT pakv_CUresult cuStreamGetCtx(pakv_CUstream stream, pakv_CUcontext* ctx) {
  *ctx = &g_context_token;
  return PAKV_CUDA_SUCCESS;
}

EXPORT pakv_CUresult cuCtxSetCurrent(pakv_CUcontext ctx) {
  pthread_mutex_lock(&g_lock);
  g_counts[F_CU_SET_CTX]++;
  g_has_context = ctx != NULL;
  pthread_mutex_unlock(&g_lock);
  return PAKV_CUDA_SUCCESS;
}

/* Add n to a counter. */
static void add(int which, long n) {
  pthread_mutex_lock(&g_lock);
  g_counts[which] += n;
  pthread_mutex_unlock(&g_lock);
}

/* Copies of one launch must not write overlapping bytes (their order is unspecified). */
static int overlapping(const pakv_CUdeviceptr* dsts, const size_t* sizes, size_t count) {
  for (size_t i = 0; i < count; i++)
    for (size_t j = i + 1; j < count; j++)
      if (dsts[i] < dsts[j] + sizes[j] && dsts[j] < dsts[i] + sizes[i]) return 1;
  return 0;
}

static int batch_misuse(pakv_CUdeviceptr* dsts, pakv_CUdeviceptr* srcs, size_t* sizes, size_t count,
                        pakv_CUmemcpyAttributes* attrs, size_t* attrs_idxs, size_t num_attrs, pakv_CUstream stream) {
  if (!stream || !count || !dsts || !srcs || !sizes || !attrs || !attrs_idxs || num_attrs != 1 || attrs_idxs[0] != 0 ||
      attrs[0].srcAccessOrder != PAKV_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
    return 1;
  for (size_t i = 0; i < count; i++)
    if (!dsts[i] || !srcs[i]) return 1;
  return overlapping(dsts, sizes, count);
}

__attribute__((unused)) static pakv_CUresult batch(int which, pakv_CUdeviceptr* dsts, pakv_CUdeviceptr* srcs, size_t* sizes, size_t count,
                           pakv_CUmemcpyAttributes* attrs, size_t* attrs_idxs, size_t num_attrs, pakv_CUstream stream) {
  int rc = enter(which, stream, batch_misuse(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream),
                 PAKV_CUDA_ERROR_INVALID_VALUE);
  if (rc) return rc;
  add(F_BATCH_ENTRIES, (long)count);
  for (size_t i = 0; i < count; i++) memcpy((void*)(uintptr_t)dsts[i], (const void*)(uintptr_t)srcs[i], sizes[i]);
  return PAKV_CUDA_SUCCESS;
}

#ifndef FAKE_NO_BATCH_V2
EXPORT pakv_CUresult cuMemcpyBatchAsync_v2(pakv_CUdeviceptr* dsts, pakv_CUdeviceptr* srcs, size_t* sizes, size_t count,
                                           pakv_CUmemcpyAttributes* attrs, size_t* attrs_idxs, size_t num_attrs,
                                           pakv_CUstream stream) {
  return batch(F_CU_BATCH_V2, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream);
}
#endif

#ifndef FAKE_NO_BATCH_V1
EXPORT pakv_CUresult cuMemcpyBatchAsync(pakv_CUdeviceptr* dsts, pakv_CUdeviceptr* srcs, size_t* sizes, size_t count,
                                        pakv_CUmemcpyAttributes* attrs, size_t* attrs_idxs, size_t num_attrs,
                                        size_t* fail_idx, pakv_CUstream stream) {
  if (!fail_idx) return enter(F_CU_BATCH_V1, stream, 1, PAKV_CUDA_ERROR_INVALID_VALUE);
  return batch(F_CU_BATCH_V1, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream);
}
#endif

#ifndef FAKE_NO_KERNEL
/* Stream-ordered "device memory": host blocks, remembered until freed. */
#define MAX_LIVE 64
static void* g_live[MAX_LIVE];
static size_t g_live_bytes[MAX_LIVE];
static int g_module_token, g_function_token, g_inline_token;

/* The live allocation [p, p + bytes) lies in, or -1. */
static int live_index(uintptr_t p, size_t bytes) {
  for (int i = 0; i < MAX_LIVE; i++)
    if (g_live[i] && p >= (uintptr_t)g_live[i] && p + bytes <= (uintptr_t)g_live[i] + g_live_bytes[i]) return i;
  return -1;
}

/* A live allocation (*ptr 0 when the table is full), counted under `which` too where it is >= 0 (the pool's). */
static pakv_CUresult take(pakv_CUdeviceptr* ptr, size_t bytes, pakv_CUstream stream, int which) {
  pthread_mutex_lock(&g_lock);
  if (which >= 0) g_counts[which]++;
  int slot = -1;
  for (int i = 0; i < MAX_LIVE && slot < 0; i++)
    if (!g_live[i]) slot = i;
  void* p = slot >= 0 && bytes ? malloc(bytes) : NULL;
  if (p) {
    g_live[slot] = p;
    g_live_bytes[slot] = bytes;
    g_counts[F_LIVE]++;
  }
  if (stream != g_expected_stream) g_counts[F_WRONG_STREAM]++;
  pthread_mutex_unlock(&g_lock);
  *ptr = (pakv_CUdeviceptr)(uintptr_t)p;
  return p ? PAKV_CUDA_SUCCESS : 2; /* CUDA_ERROR_OUT_OF_MEMORY */
}

EXPORT pakv_CUresult cuMemAllocAsync(pakv_CUdeviceptr* ptr, size_t bytes, pakv_CUstream stream) {
  return take(ptr, bytes, stream, -1);
}

/* A pool of the one fake device: made with CUmemPoolProps as cuda.h lays it out (pinned, on device 0,
 * the rest zero), counted as keeping once its release threshold is set to keep everything. */
#ifndef FAKE_NO_POOL
static int g_pool_token;
EXPORT pakv_CUresult cuCtxGetDevice(pakv_CUdevice* device) {
  *device = 0;
  return PAKV_CUDA_SUCCESS;
}

EXPORT pakv_CUresult cuMemPoolCreate(pakv_CUmemoryPool* pool, const pakv_CUmemPoolProps* props) {
  static const unsigned char zeros[sizeof(props->reserved)];
  int ok = props->allocType == 1 && props->handleTypes == 0 && props->location.type == 1 && props->location.id == 0 &&
           !props->win32SecurityAttributes && props->maxSize == 0 && props->usage == 0 &&
           memcmp(props->reserved, zeros, sizeof(zeros)) == 0;
  if (!ok) add(F_MISUSE, 1);
  *pool = ok ? &g_pool_token : NULL;
  return ok ? PAKV_CUDA_SUCCESS : PAKV_CUDA_ERROR_INVALID_VALUE;
}

EXPORT pakv_CUresult cuMemPoolSetAttribute(pakv_CUmemoryPool pool, int attribute, void* value) {
  int ok = pool == &g_pool_token && attribute == 4 && value;
  if (!ok) add(F_MISUSE, 1);
  else if (*(uint64_t*)value == UINT64_MAX) add(F_POOLS_KEEPING, 1);
  return ok ? PAKV_CUDA_SUCCESS : PAKV_CUDA_ERROR_INVALID_VALUE;
}

EXPORT pakv_CUresult cuMemAllocFromPoolAsync(pakv_CUdeviceptr* ptr, size_t bytes, pakv_CUmemoryPool pool,
                                             pakv_CUstream stream) {
  if (pool != &g_pool_token) {
    add(F_MISUSE, 1);
    return PAKV_CUDA_ERROR_INVALID_VALUE;
  }
  return take(ptr, bytes, stream, F_POOL_ALLOC);
}
#endif

EXPORT pakv_CUresult cuMemFreeAsync(pakv_CUdeviceptr ptr, pakv_CUstream stream) {
  pthread_mutex_lock(&g_lock);
  int i = live_index((uintptr_t)ptr, 0);
  int ok = i >= 0 && (uintptr_t)g_live[i] == (uintptr_t)ptr;
  if (ok) {
    free(g_live[i]);
    g_live[i] = NULL;
    g_counts[F_LIVE]--;
  } else {
    g_counts[F_MISUSE]++;
  }
  if (stream != g_expected_stream) g_counts[F_WRONG_STREAM]++;
  pthread_mutex_unlock(&g_lock);
  return ok ? PAKV_CUDA_SUCCESS : PAKV_CUDA_ERROR_INVALID_VALUE;
}

EXPORT pakv_CUresult cuMemcpyHtoDAsync_v2(pakv_CUdeviceptr dst, const void* src, size_t bytes, pakv_CUstream stream) {
  pthread_mutex_lock(&g_lock);
  int ok = src && live_index((uintptr_t)dst, bytes) >= 0;
  g_counts[F_UPLOAD]++;
  if (!ok) g_counts[F_MISUSE]++;
  if (stream != g_expected_stream) g_counts[F_WRONG_STREAM]++;
  pthread_mutex_unlock(&g_lock);
  if (ok) memcpy((void*)(uintptr_t)dst, src, bytes);
  return ok ? PAKV_CUDA_SUCCESS : PAKV_CUDA_ERROR_INVALID_VALUE;
}

/* The module must be the library's copy kernel in PTX. */
EXPORT pakv_CUresult cuModuleLoadData(pakv_CUmodule* module, const void* image) {
  add(F_MODULE_LOAD, 1);
  const char* ptx = (const char*)image;
  int ok = ptx && strstr(ptx, ".entry pakv_copy_runs(") && strstr(ptx, ".entry pakv_copy_runs_inline(") &&
           strstr(ptx, ".version ") && strstr(ptx, ".target sm_");
  *module = ok ? &g_module_token : NULL;
  return ok ? PAKV_CUDA_SUCCESS : 218; /* CUDA_ERROR_INVALID_PTX */
}

EXPORT pakv_CUresult cuModuleGetFunction(pakv_CUfunction* function, pakv_CUmodule module, const char* name) {
  int ok = module == &g_module_token;
  *function = !ok ? NULL
              : strcmp(name, "pakv_copy_runs") == 0        ? (void*)&g_function_token
              : strcmp(name, "pakv_copy_runs_inline") == 0 ? (void*)&g_inline_token
                                                           : NULL;
  return *function ? PAKV_CUDA_SUCCESS : 500; /* CUDA_ERROR_NOT_FOUND */
}

/* pakv_copy_runs(const {dst, src, bytes}* runs, unsigned long long count), its list in "device memory"
 * from cuMemAllocAsync, or pakv_copy_runs_inline({count, {dst, src, bytes}[160]}), its list in the
 * parameter; done on the host. */
#define FAKE_INLINE_RUNS 160
EXPORT pakv_CUresult cuLaunchKernel(pakv_CUfunction f, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,
                                    unsigned int block_x, unsigned int block_y, unsigned int block_z,
                                    unsigned int shared_bytes, pakv_CUstream stream, void** params, void** extra) {
  int in_param = f == &g_inline_token;
  pakv_CUdeviceptr runs = !params ? 0 : in_param ? (uintptr_t)((unsigned long long*)params[0] + 1) : *(pakv_CUdeviceptr*)params[0];
  unsigned long long count = !params ? 0 : in_param ? *(unsigned long long*)params[0] : *(unsigned long long*)params[1];
  pthread_mutex_lock(&g_lock);
  int bad = (f != &g_function_token && !in_param) || !grid_x || grid_y != 1 || grid_z != 1 || !block_x ||
            block_x > 1024 || block_y != 1 || block_z != 1 || extra || !count ||
            (in_param ? count > FAKE_INLINE_RUNS : live_index((uintptr_t)runs, count * 24) < 0);
  pthread_mutex_unlock(&g_lock);
  int rc = enter(F_CU_LAUNCH, stream, bad, PAKV_CUDA_ERROR_INVALID_VALUE);
  if (rc) return rc;
  const uint64_t* piece = (const uint64_t*)(uintptr_t)runs;
  pakv_CUdeviceptr* dsts = (pakv_CUdeviceptr*)malloc(count * sizeof(*dsts));
  size_t* sizes = (size_t*)malloc(count * sizeof(*sizes));
  for (unsigned long long i = 0; dsts && sizes && i < count; i++) dsts[i] = piece[3 * i], sizes[i] = piece[3 * i + 2];
  if (!dsts || !sizes || overlapping(dsts, sizes, count)) add(F_MISUSE, 1);
  free(dsts);
  free(sizes);
  for (unsigned long long i = 0; i < count; i++)
    memcpy((void*)(uintptr_t)piece[3 * i], (const void*)(uintptr_t)piece[3 * i + 1], piece[3 * i + 2]);
  add(F_KERNEL_PIECES, (long)count);
  return PAKV_CUDA_SUCCESS;
}
#endif

/* --- AscendCL --------------------------------------------------------------------------------- */
EXPORT pakv_aclError aclrtMemcpyAsync(void* dst, size_t dest_max, const void* src, size_t count, int kind,
                                      void* stream) {
  int misuse = !dst || !src || kind != PAKV_ACL_MEMCPY_DEVICE_TO_DEVICE || dest_max < count;
  int rc = enter(F_ACL_1D, stream, misuse, PAKV_ACL_ERROR_INVALID_PARAM);
  if (!rc) memcpy(dst, src, count);
  return rc;
}

EXPORT pakv_aclError aclrtMemcpy2dAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                        size_t height, int kind, void* stream) {
  int misuse = !dst || !src || kind != PAKV_ACL_MEMCPY_DEVICE_TO_DEVICE || width > dpitch || width > spitch ||
               width > 5000000 || height > PAKV_ACL_MEMCPY2D_MAX_HEIGHT;
  int rc = enter(F_ACL_2D, stream, misuse, PAKV_ACL_ERROR_INVALID_PARAM);
  if (!rc) copy_rows((char*)dst, dpitch, (const char*)src, spitch, width, height);
  return rc;
}

EXPORT const char* aclGetRecentErrMsg(void) { return g_recent; }
