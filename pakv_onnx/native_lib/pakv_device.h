/* Device copies of a plan: the accelerator drivers, opened with dlopen on first use, and the
 * asynchronous device-to-device copies one gather issues on a caller's stream. No ONNX Runtime,
 * no Python (the ORT glue is pakv_ep.c); driver signatures come from device_abi.h.
 *
 *   Norm : one copy per (sequence, block) run per cache, runs that continue each other in both the
 *          cache and the output merged into one copy. CUDA issues all of a call's copies (both caches)
 *          in one launch: one cuMemcpyBatchAsync (driver >= 12.8), else one launch of the copy kernel
 *          (pakv_cuda_copy.cu, its PTX embedded), else (older drivers) one cuMemcpyDtoDAsync_v2 each;
 *          AscendCL one aclrtMemcpyAsync each.
 *   PA_NZ: 2-D strided copies of 32-byte fractals (cuMemcpy2DAsync_v2 / aclrtMemcpy2dAsync): per
 *          run, one per fractal (n rows of one fractal) or one per token (its fractals), whichever
 *          is fewer.
 *   The scatter writes the same way the other way round, one token row at a time (CUDA Norm: its
 *          rows in one launch as above, after the pool's copy when the output is not the pool).
 *
 * The plan is the validator's (pakv_contract_*.c): cache and output addresses are device addresses,
 * index arrays are host memory. The copies are queued on `stream` and not waited for: ORT orders
 * its stream's later work after them.
 */
#ifndef PAKV_DEVICE_H
#define PAKV_DEVICE_H

#include "pakv_core.h"

/* The drivers (index into the driver table of pakv_device.c). */
enum { PAKV_DRIVER_CUDA = 0, PAKV_DRIVER_CANN = 1, PAKV_NUM_DRIVERS };

/* Environment variables naming another driver library than the default (libcuda.so.1,
 * libascendcl.so): for unusual installs, and for the tests' fake driver. */
#define PAKV_CUDA_DRIVER_ENV "PAKV_ONNX_CUDA_DRIVER"
#define PAKV_CANN_DRIVER_ENV "PAKV_ONNX_CANN_DRIVER"
/* How the CUDA entries issue a call's copies: "batch" (cuMemcpyBatchAsync), "kernel" (the PTX copy
 * kernel), "runs" (one cuMemcpyDtoDAsync each), unset or "auto": the first of these the driver has. */
#define PAKV_CUDA_COPY_ENV "PAKV_ONNX_CUDA_COPY"

/* Queue the copies of a checked plan on `stream` with driver `driver`. 0, or -1 with err naming
 * the driver call that failed and its result code (or why the driver could not be opened). */
int pakv_device_run_plan(int driver, const pakv_plan* p, void* stream, pakv_err* err);

/* Queue a checked scatter plan's row writes on `stream`: per written token one copy per cache
 * (Norm; tokens that continue each other in the rows read and written merged into one), or one
 * 2-D copy of its fractals (PA_NZ). Slots are host memory. 0, or -1 with err as above. */
int pakv_device_run_scatter(int driver, const pakv_scatter_plan* p, void* stream, pakv_err* err);

/* Queue one device-to-device copy of `bytes` (a scatter's pool into a separate output). */
int pakv_device_copy(int driver, void* dst, const void* src, size_t bytes, void* stream, pakv_err* err);

#endif /* PAKV_DEVICE_H */
