/* Execution providers of the ops (see pakv_ep.h). */
#include "pakv_ep.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "pakv_device.h"
#include "pakv_fused.h"

typedef struct {
  const char* name;   /* OrtCustomOp.GetExecutionProviderType */
  const char* device; /* the records' device label: "<device>:<id>" ("cpu" alone) */
  int driver;         /* pakv_device.h driver, -1 for the CPU */
} pakv_ep_info;

static const pakv_ep_info EPS[PAKV_NUM_EPS] = {
    {"CPUExecutionProvider", "cpu", -1},
    {"CUDAExecutionProvider", "cuda", PAKV_DRIVER_CUDA},
    {"CANNExecutionProvider", "npu", PAKV_DRIVER_CANN}, /* torch_npu's name for an Ascend device */
};

/* The op table: which inputs a device entry reads on the host (bit i = input i). */
typedef struct {
  const char* op_type;
  uint32_t host_inputs;
} pakv_ep_op;

#define PAKV_OP_ROWS (PAKV_OP_FUSED + 1)
static const pakv_ep_op OPS[PAKV_OP_ROWS] = {
    {"GatherPaKvCache", (1u << PAKV_GATHER_BLOCK_TABLES) | (1u << PAKV_GATHER_SEQ_LENS) | (1u << PAKV_GATHER_SEQ_OFFSET)},
    {"ScatterPaKvCache", 1u << PAKV_SCATTER_SLOT_MAPPING},
    {"PagedAttention",
     (1u << PAKV_ATTENTION_BLOCK_TABLE) | (1u << PAKV_ATTENTION_CU_SEQ_LENS) | (1u << PAKV_ATTENTION_PAST_LENS)},
    {"PagedAttention", 0}, /* com.microsoft's: no device entry (ORT's own CUDA kernel serves it there) */
};

const char* pakv_op_type(int op_kind) {
  return OPS[op_kind >= 0 && op_kind < PAKV_OP_ROWS ? op_kind : PAKV_OP_GATHER].op_type;
}

const char* pakv_ep_name(int ep) { return ep >= 0 && ep < PAKV_NUM_EPS ? EPS[ep].name : EPS[PAKV_EP_CPU].name; }

int pakv_ep_input_memory_type(int ep, int op_kind, size_t index) {
  if (ep == PAKV_EP_CPU || op_kind < 0 || op_kind >= PAKV_OP_ROWS || index >= 32) return PAKV_ORT_MEM_DEFAULT;
  return (OPS[op_kind].host_inputs >> index) & 1u ? PAKV_ORT_MEM_CPU_INPUT : PAKV_ORT_MEM_DEFAULT;
}

static int take(const OrtApi* api, OrtStatus* st, pakv_err* err, const char* what) {
  if (!st) return 0;
  pakv_fail(err, "%s: %s", what, PAKV_API(api, GetErrorMessage)(st));
  PAKV_API(api, ReleaseStatus)(st);
  return -1;
}

int pakv_ep_locate(const OrtApi* api, int ep, const OrtValue* value, pakv_tensor* t, pakv_err* err) {
  const OrtMemoryInfo* info = NULL;
  int type = PAKV_ORT_DEVICE_CPU, id = 0;
  if (take(api, PAKV_API(api, GetTensorMemoryInfo)(value, &info), err, "GetTensorMemoryInfo")) return -1;
  PAKV_API(api, MemoryInfoGetDeviceType)(info, &type);
  if (take(api, PAKV_API(api, MemoryInfoGetId)(info, &id), err, "MemoryInfoGetId")) return -1;
  if (type == PAKV_ORT_DEVICE_CPU) {
    snprintf(t->device, sizeof(t->device), "cpu");
    t->host_data = t->data;
  } else {
    snprintf(t->device, sizeof(t->device), "%s:%d", EPS[ep].device, id);
    t->host_data = NULL; /* device memory: the validator refuses to read it */
  }
  return 0;
}

int pakv_ep_stream(const OrtApi* api, OrtKernelContext* ctx, int ep, void** stream, pakv_err* err) {
  *stream = NULL;
  if (ep == PAKV_EP_CPU) return 0;
  return take(api, PAKV_API(api, KernelContext_GetGPUComputeStream)(ctx, stream), err,
              "KernelContext_GetGPUComputeStream");
}

typedef struct {
  const OrtApi* api;
  OrtKernelContext* ctx;
} ort_pool;

static int ort_parallel_for(void* host, void (*fn)(void*, size_t), size_t parts, void* data) {
  const ort_pool* pool = (const ort_pool*)host;
  /* num_batch 0: ORT hands the parts to its threads one by one (a busy thread takes fewer). */
  OrtStatus* st = PAKV_API(pool->api, KernelContext_ParallelFor)(pool->ctx, fn, parts, 0, data);
  if (!st) return 0;
  PAKV_API(pool->api, ReleaseStatus)(st); /* it ran nothing: the core copies on this thread */
  return -1;
}

int pakv_ep_run_plan(const OrtApi* api, OrtKernelContext* ctx, int ep, int parallel_for, const pakv_plan* plan,
                     pakv_err* err) {
  if (ep == PAKV_EP_CPU) {
    ort_pool pool = {api, ctx};
    pakv_parallel par = {ort_parallel_for, &pool};
    return pakv_run_plan_on(plan, parallel_for ? &par : NULL, err);
  }
  void* stream = NULL;
  if (pakv_ep_stream(api, ctx, ep, &stream, err)) return -1;
  return pakv_device_run_plan(EPS[ep].driver, plan, stream, err);
}

int pakv_ep_run_attention(const OrtApi* api, OrtKernelContext* ctx, int ep, int parallel_for,
                          const pakv_attention_plan* plan, pakv_err* err) {
  if (ep != PAKV_EP_CPU) return pakv_fail(err, "PagedAttention has no %s kernel", pakv_ep_name(ep));
  ort_pool pool = {api, ctx};
  pakv_parallel par = {ort_parallel_for, &pool};
  return pakv_run_attention_on(plan, parallel_for ? &par : NULL, err);
}

int pakv_ep_run_fused(const OrtApi* api, OrtKernelContext* ctx, int ep, int parallel_for, const pakv_fused_plan* plan,
                      pakv_err* err) {
  if (ep != PAKV_EP_CPU) return pakv_fail(err, "com.microsoft::PagedAttention has no %s kernel here", pakv_ep_name(ep));
  ort_pool pool = {api, ctx};
  pakv_parallel par = {ort_parallel_for, &pool};
  return pakv_run_fused_on(plan, parallel_for ? &par : NULL, err);
}

int pakv_ep_run_scatter(const OrtApi* api, OrtKernelContext* ctx, int ep, const pakv_scatter_plan* plan, pakv_err* err) {
  if (ep == PAKV_EP_CPU) return pakv_run_scatter(plan, err);
  void* stream = NULL;
  if (pakv_ep_stream(api, ctx, ep, &stream, err)) return -1;
  return pakv_device_run_scatter(EPS[ep].driver, plan, stream, err);
}

int pakv_ep_copy(const OrtApi* api, OrtKernelContext* ctx, int ep, void* dst, const void* src, int64_t bytes,
                 pakv_err* err) {
  if (bytes <= 0) return 0;
  if (ep == PAKV_EP_CPU) {
    memcpy(dst, src, (size_t)bytes);
    return 0;
  }
  void* stream = NULL;
  if (pakv_ep_stream(api, ctx, ep, &stream, err)) return -1;
  return pakv_device_copy(EPS[ep].driver, dst, src, (size_t)bytes, stream, err);
}
