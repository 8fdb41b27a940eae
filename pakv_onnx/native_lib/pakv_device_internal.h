/* What pakv_device.c (the drivers, the copies of a plan) and pakv_device_cuda.c (a CUDA call's
 * copies in one launch) share: the opened driver's entry points and the list of a call's copies. */
#ifndef PAKV_DEVICE_INTERNAL_H
#define PAKV_DEVICE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "device_abi.h"
#include "pakv_core.h"

/* A driver's entry points, looked up once (pakv_device.c); optional ones may be NULL. */
typedef struct {
  void* handle;
  /* CUDA */
  pakv_cuMemcpyDtoDAsync_fn cu_memcpy;
  pakv_cuMemcpy2DAsync_fn cu_memcpy_2d;
  pakv_cuGetErrorName_fn cu_error_name;     /* optional */
  pakv_cuCtxGetCurrent_fn cu_ctx_get;       /* optional, with the next two */
  pakv_cuStreamGetCtx_fn cu_stream_ctx;
  pakv_cuCtxSetCurrent_fn cu_ctx_set;
  pakv_cuMemcpyBatchAsync_v2_fn cu_batch_v2;  /* optional: CUDA >= 13 */
  pakv_cuMemcpyBatchAsync_v1_fn cu_batch_v1;  /* optional: CUDA 12.8 / 12.9 */
  pakv_cuModuleLoadData_fn cu_module_load;    /* optional, with the next five (the copy kernel) */
  pakv_cuModuleGetFunction_fn cu_module_function;
  pakv_cuLaunchKernel_fn cu_launch;
  pakv_cuMemAllocAsync_fn cu_alloc_async;
  pakv_cuMemFreeAsync_fn cu_free_async;
  pakv_cuMemcpyHtoDAsync_fn cu_upload;
  pakv_cuCtxGetDevice_fn cu_ctx_device;             /* optional, with the next three (the kernel's own pool) */
  pakv_cuMemPoolCreate_fn cu_pool_create;
  pakv_cuMemPoolSetAttribute_fn cu_pool_set;
  pakv_cuMemAllocFromPoolAsync_fn cu_alloc_from_pool;
  /* AscendCL */
  pakv_aclrtMemcpyAsync_fn acl_memcpy;
  pakv_aclrtMemcpy2dAsync_fn acl_memcpy_2d;
  pakv_aclGetRecentErrMsg_fn acl_message;   /* optional */
} pakv_driver;

/* A CUDA call's 1-D copies, collected and then issued at once (pakv_cuda_issue_copies). */
typedef struct {
  pakv_CUdeviceptr* dst;
  pakv_CUdeviceptr* src;
  size_t* bytes;
  size_t count, capacity;
  int no_memory;
} pakv_copy_list;

/* Append a copy (no_memory set, and nothing more appended, when the list cannot grow). */
void pakv_copy_list_append(pakv_copy_list* l, uintptr_t dst, uintptr_t src, size_t bytes);
void pakv_copy_list_free(pakv_copy_list* l);

/* err := "<op> (CUDAExecutionProvider): <call> failed with CUresult N (its name)"; returns -1. */
int pakv_cuda_failed(const pakv_driver* d, pakv_err* err, const char* op, const char* call, pakv_CUresult rc);

/* Queue the list's copies on `stream`, then free the list: one copy as itself; more in one launch,
 * the embedded copy kernel where the driver can load it, else cuMemcpyBatchAsync where the driver has
 * it (not on the legacy default stream), else one cuMemcpyDtoDAsync_v2 per copy; PAKV_ONNX_CUDA_COPY
 * forces one.
 * 0, or -1 with err. */
int pakv_cuda_issue_copies(const pakv_driver* d, pakv_copy_list* l, void* stream, const char* op, pakv_err* err);

#endif /* PAKV_DEVICE_INTERNAL_H */
