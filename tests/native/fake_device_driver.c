/* A fake accelerator driver for the device entries' tests: the few CUDA driver and AscendCL
 * symbols libpakv_ort.so looks up (declared in pakv_onnx/native_lib/device_abi.h, included here
 * so nothing is a second copy), implemented with host memcpy ("device memory" is host memory the
 * tests hand ORT's fake as device tensors). Each copy checks what the real driver would refuse
 * (memory types, copy kind, a 2-D width wider than a pitch, a short destMax) and is counted per
 * function, with the streams it got; the tests read the counts and can make the n-th copy fail.
 *
 * build: gcc -shared -fPIC -I pakv_onnx/native_lib -o libfake_device_driver.so fake_device_driver.c
 * use:   PAKV_ONNX_CUDA_DRIVER=/path/libfake_device_driver.so (and PAKV_ONNX_CANN_DRIVER) */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "device_abi.h"

#define EXPORT __attribute__((visibility("default")))

enum { F_CU_1D, F_CU_2D, F_ACL_1D, F_ACL_2D, F_CU_INIT, F_CU_SET_CTX, F_MISUSE, F_WRONG_STREAM, F_COUNT };
static const char* const NAMES[F_COUNT] = {"cuMemcpyDtoDAsync_v2", "cuMemcpy2DAsync_v2", "aclrtMemcpyAsync",
                                           "aclrtMemcpy2dAsync", "cuInit", "cuCtxSetCurrent", "misuse",
                                           "wrong_stream"};

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
  memset(g_counts, 0, sizeof(g_counts));
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
