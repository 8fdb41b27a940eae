/* The few accelerator driver calls the device entries make, declared from the vendors' public
 * documentation (the CUDA Driver API reference; CANN's AscendCL runtime API reference). No CUDA
 * or CANN header is included and neither library is linked: pakv_device.c opens the driver with
 * dlopen on first use and looks these symbols up, so the plugin still loads on CPU-only hosts.
 *
 * This is the only place their signatures, structs and constants are written (as ort_abi.h is
 * for ONNX Runtime); tests/native/fake_device_driver.c implements them from this header.
 */
#ifndef PAKV_DEVICE_ABI_H
#define PAKV_DEVICE_ABI_H

#include <stddef.h>
#include <stdint.h>

/* ------------------------------------------------------------------------------------------- */
/* CUDA driver API (libcuda.so.1). cudaStream_t and CUstream are the same handle type.          */
/* ------------------------------------------------------------------------------------------- */
#define PAKV_CUDA_DRIVER_LIBRARY "libcuda.so.1"

typedef int pakv_CUresult; /* CUDA_SUCCESS = 0 */
typedef unsigned long long pakv_CUdeviceptr; /* the _v2 entry points' 64-bit device pointer */
typedef void* pakv_CUstream;
typedef void* pakv_CUcontext;

enum { PAKV_CUDA_SUCCESS = 0, PAKV_CUDA_ERROR_INVALID_VALUE = 1 };
/* CUmemorytype */
enum { PAKV_CU_MEMORYTYPE_HOST = 1, PAKV_CU_MEMORYTYPE_DEVICE = 2, PAKV_CU_MEMORYTYPE_ARRAY = 3,
       PAKV_CU_MEMORYTYPE_UNIFIED = 4 };

/* CUDA_MEMCPY2D (the _v2 layout: size_t offsets and pitches), in the reference's field order. */
typedef struct {
  size_t srcXInBytes;
  size_t srcY;
  int srcMemoryType; /* CUmemorytype */
  const void* srcHost;
  pakv_CUdeviceptr srcDevice;
  void* srcArray;
  size_t srcPitch;
  size_t dstXInBytes;
  size_t dstY;
  int dstMemoryType;
  void* dstHost;
  pakv_CUdeviceptr dstDevice;
  void* dstArray;
  size_t dstPitch;
  size_t WidthInBytes; /* must not exceed srcPitch or dstPitch */
  size_t Height;
} pakv_CUDA_MEMCPY2D;

typedef pakv_CUresult (*pakv_cuInit_fn)(unsigned int flags);
typedef pakv_CUresult (*pakv_cuMemcpyDtoDAsync_fn)(pakv_CUdeviceptr dst, pakv_CUdeviceptr src, size_t bytes,
                                                   pakv_CUstream stream);
typedef pakv_CUresult (*pakv_cuMemcpy2DAsync_fn)(const pakv_CUDA_MEMCPY2D* copy, pakv_CUstream stream);
typedef pakv_CUresult (*pakv_cuGetErrorName_fn)(pakv_CUresult error, const char** name);
typedef pakv_CUresult (*pakv_cuCtxGetCurrent_fn)(pakv_CUcontext* ctx);
typedef pakv_CUresult (*pakv_cuStreamGetCtx_fn)(pakv_CUstream stream, pakv_CUcontext* ctx);
typedef pakv_CUresult (*pakv_cuCtxSetCurrent_fn)(pakv_CUcontext ctx);

/* The batched copy (CUDA >= 12.8). Its symbol and parameters changed once: drivers 12.8 / 12.9 export
 * cuMemcpyBatchAsync with a failIdx parameter before the stream; CUDA 13 headers map the name to
 * cuMemcpyBatchAsync_v2, without it (and drivers keep exporting the 12.8 symbol). */
typedef struct {
  int type; /* CUmemLocationType; 0 (invalid): no hint */
  int id;
} pakv_CUmemLocation;

typedef struct {
  int srcAccessOrder; /* CUmemcpySrcAccessOrder */
  pakv_CUmemLocation srcLocHint; /* hints for managed memory only */
  pakv_CUmemLocation dstLocHint;
  unsigned int flags; /* CUmemcpyFlags */
} pakv_CUmemcpyAttributes;

/* CUmemcpySrcAccessOrder: the source is read in stream order (after the stream's earlier work). */
enum { PAKV_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1 };

typedef pakv_CUresult (*pakv_cuMemcpyBatchAsync_v2_fn)(pakv_CUdeviceptr* dsts, pakv_CUdeviceptr* srcs, size_t* sizes,
                                                       size_t count, pakv_CUmemcpyAttributes* attrs, size_t* attrs_idxs,
                                                       size_t num_attrs, pakv_CUstream stream);
typedef pakv_CUresult (*pakv_cuMemcpyBatchAsync_v1_fn)(pakv_CUdeviceptr* dsts, pakv_CUdeviceptr* srcs, size_t* sizes,
                                                       size_t count, pakv_CUmemcpyAttributes* attrs, size_t* attrs_idxs,
                                                       size_t num_attrs, size_t* fail_idx, pakv_CUstream stream);

/* A kernel from PTX (pakv_cuda_copy.cu), launched on the stream, its run list uploaded first into
 * stream-ordered memory (CUDA >= 11.2). */
typedef void* pakv_CUmodule;
typedef void* pakv_CUfunction;
typedef pakv_CUresult (*pakv_cuModuleLoadData_fn)(pakv_CUmodule* module, const void* image);
typedef pakv_CUresult (*pakv_cuModuleGetFunction_fn)(pakv_CUfunction* function, pakv_CUmodule module, const char* name);
typedef pakv_CUresult (*pakv_cuLaunchKernel_fn)(pakv_CUfunction f, unsigned int grid_x, unsigned int grid_y,
                                                unsigned int grid_z, unsigned int block_x, unsigned int block_y,
                                                unsigned int block_z, unsigned int shared_bytes, pakv_CUstream stream,
                                                void** params, void** extra);
typedef pakv_CUresult (*pakv_cuMemAllocAsync_fn)(pakv_CUdeviceptr* ptr, size_t bytes, pakv_CUstream stream);
typedef pakv_CUresult (*pakv_cuMemFreeAsync_fn)(pakv_CUdeviceptr ptr, pakv_CUstream stream);
typedef pakv_CUresult (*pakv_cuMemcpyHtoDAsync_fn)(pakv_CUdeviceptr dst, const void* src, size_t bytes,
                                                   pakv_CUstream stream);

/* The library's own memory pool for the kernel's run lists (CUDA >= 11.2): the current device's
 * default pool hands its memory back at every synchronization (release threshold 0), and taking it
 * again cost ~400 us a call for a 0.4 MB list on an H200; the host's pools are never reconfigured. */
typedef void* pakv_CUmemoryPool;
typedef int pakv_CUdevice;
typedef struct { /* CUmemPoolProps (88 bytes on LP64) */
  int allocType;   /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
  int handleTypes; /* CU_MEM_HANDLE_TYPE_NONE = 0 */
  pakv_CUmemLocation location;
  void* win32SecurityAttributes;
  size_t maxSize;
  unsigned short usage;
  unsigned char reserved[54];
} pakv_CUmemPoolProps;
enum { PAKV_CU_MEM_ALLOCATION_TYPE_PINNED = 1, PAKV_CU_MEM_LOCATION_TYPE_DEVICE = 1,
       PAKV_CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4 };
typedef pakv_CUresult (*pakv_cuCtxGetDevice_fn)(pakv_CUdevice* device);
typedef pakv_CUresult (*pakv_cuMemPoolCreate_fn)(pakv_CUmemoryPool* pool, const pakv_CUmemPoolProps* props);
typedef pakv_CUresult (*pakv_cuMemPoolSetAttribute_fn)(pakv_CUmemoryPool pool, int attribute, void* value);
typedef pakv_CUresult (*pakv_cuMemAllocFromPoolAsync_fn)(pakv_CUdeviceptr* ptr, size_t bytes, pakv_CUmemoryPool pool,
                                                         pakv_CUstream stream);

/* ------------------------------------------------------------------------------------------- */
/* AscendCL runtime (libascendcl.so). aclrtStream is an opaque handle.                          */
/* ------------------------------------------------------------------------------------------- */
#define PAKV_CANN_DRIVER_LIBRARY "libascendcl.so"

typedef int pakv_aclError; /* ACL_SUCCESS = 0 */
enum { PAKV_ACL_SUCCESS = 0, PAKV_ACL_ERROR_INVALID_PARAM = 100000 };
/* aclrtMemcpyKind */
enum { PAKV_ACL_MEMCPY_HOST_TO_HOST = 0, PAKV_ACL_MEMCPY_HOST_TO_DEVICE = 1, PAKV_ACL_MEMCPY_DEVICE_TO_HOST = 2,
       PAKV_ACL_MEMCPY_DEVICE_TO_DEVICE = 3 };
/* aclrtMemcpy2dAsync: height at most 5 * 1024 * 1024 rows, width at most 5,000,000 bytes. */
#define PAKV_ACL_MEMCPY2D_MAX_HEIGHT ((size_t)5 * 1024 * 1024)

typedef pakv_aclError (*pakv_aclrtMemcpyAsync_fn)(void* dst, size_t dest_max, const void* src, size_t count,
                                                 int kind, void* stream);
typedef pakv_aclError (*pakv_aclrtMemcpy2dAsync_fn)(void* dst, size_t dpitch, const void* src, size_t spitch,
                                                    size_t width, size_t height, int kind, void* stream);
typedef const char* (*pakv_aclGetRecentErrMsg_fn)(void);

#endif /* PAKV_DEVICE_ABI_H */
