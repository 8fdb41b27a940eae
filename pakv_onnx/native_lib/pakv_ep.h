/* Execution providers: the table of EPs every op of the library is registered for, which inputs
 * each op reads on the host, and the ORT glue a kernel of a device EP needs (where a tensor lives,
 * ORT's compute stream, ORT's intra-op pool on the CPU). Stands on ort_abi.h, the validator's
 * records (pakv_contract.h), the copy core and the device copies (pakv_device.h).
 *
 * Each op is registered once per EP with the same inputs, outputs and characteristics (ORT refuses
 * entries of one name that differ); a device entry declares its index inputs host-resident
 * (OrtMemTypeCPUInput), so the validator reads them on the host with no device sync, while the
 * caches and outputs stay in device memory. The CPU entry stays registered: ORT needs it to place
 * the node on CPU-only hosts and on sessions without the device EP.
 */
#ifndef PAKV_EP_H
#define PAKV_EP_H

#include <stddef.h>

#include "ort_abi.h"
#include "pakv_contract.h"
#include "pakv_core.h"

/* The EPs, in registration order (every op's CPU entries first). */
enum { PAKV_EP_CPU = 0, PAKV_EP_CUDA = 1, PAKV_EP_CANN = 2, PAKV_NUM_EPS };

/* The ops of the library, one row each in pakv_ep.c's op table (its op type, and which of its
 * inputs a device entry takes in host memory). The cache ops (the first PAKV_NUM_OP_KINDS) are
 * registered on every EP for every (key, value) dtype pair; PagedAttention only on the CPU, for its
 * three dtypes (PAKV_NUM_ATTENTION_DTYPES, after every cache op). */
enum {
  PAKV_OP_GATHER = 0,
  PAKV_OP_SCATTER = 1,
  PAKV_NUM_OP_KINDS,
  PAKV_OP_ATTENTION = PAKV_NUM_OP_KINDS,
  PAKV_OP_FUSED /* com.microsoft::PagedAttention (pakv_fused.h): CPU only, in its own domain */
};
#define PAKV_NUM_ATTENTION_DTYPES 3

/* "GatherPaKvCache", "ScatterPaKvCache", "PagedAttention". */
const char* pakv_op_type(int op_kind);

/* "CPUExecutionProvider", "CUDAExecutionProvider", "CANNExecutionProvider". */
const char* pakv_ep_name(int ep);

/* OrtCustomOp.GetInputMemoryType of input `index` of op `op_kind` on `ep`: OrtMemTypeCPUInput for
 * a device entry's index inputs, OrtMemTypeDefault otherwise. */
int pakv_ep_input_memory_type(int ep, int op_kind, size_t index);

/* A device entry's input as a record (t already filled from its type, shape and data address):
 * labelled with its memory's device ("cuda:0", "npu:0", or "cpu"); readable on the host
 * (host_data) only when ORT says it is host memory. 0, or -1 with err set. */
int pakv_ep_locate(const OrtApi* api, int ep, const OrtValue* value, pakv_tensor* t, pakv_err* err);

/* ORT's compute stream for this call (KernelContext_GetGPUComputeStream); NULL on the CPU. */
int pakv_ep_stream(const OrtApi* api, OrtKernelContext* ctx, int ep, void** stream, pakv_err* err);

/* Run a validated plan where the entry's data is: on the device (async copies on ORT's stream),
 * or on the CPU, split over ORT's intra-op pool (KernelContext_ParallelFor) when the runtime has
 * one (`parallel_for`: it offers API >= 17), else over the library's own threads. */
int pakv_ep_run_plan(const OrtApi* api, OrtKernelContext* ctx, int ep, int parallel_for, const pakv_plan* plan,
                     pakv_err* err);

/* Run a validated scatter where the entry's data is (CPU: the core's row writes; a device: async
 * copies on ORT's stream). */
int pakv_ep_run_scatter(const OrtApi* api, OrtKernelContext* ctx, int ep, const pakv_scatter_plan* plan, pakv_err* err);

/* Run a validated attention on the CPU, its parts on ORT's intra-op pool when the runtime has one
 * (`parallel_for`), else on this thread. (PagedAttention has no device entry.) */
int pakv_ep_run_attention(const OrtApi* api, OrtKernelContext* ctx, int ep, int parallel_for,
                          const pakv_attention_plan* plan, pakv_err* err);

/* Run a validated and bound com.microsoft::PagedAttention on the CPU (prologue, then attention), on
 * ORT's intra-op pool when the runtime has one. */
struct pakv_fused_plan;
int pakv_ep_run_fused(const OrtApi* api, OrtKernelContext* ctx, int ep, int parallel_for,
                      const struct pakv_fused_plan* plan, pakv_err* err);

/* Copy `bytes` from src to dst where the entry's data is (a scatter's pool into a separate output). */
int pakv_ep_copy(const OrtApi* api, OrtKernelContext* ctx, int ep, void* dst, const void* src, int64_t bytes,
                 pakv_err* err);

#endif /* PAKV_EP_H */
