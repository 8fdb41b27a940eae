/* What the two halves of the ORT glue share: pakv_ort.c (the kernels: attributes, ORT's tensors ->
 * the validator's records -> the copy and attention cores) and pakv_ort_register.c (the ops ORT
 * reads, one domain per backend, RegisterCustomOps). Internal to the library. */
#ifndef PAKV_ORT_H
#define PAKV_ORT_H

#include <stddef.h>

#include "ort_abi.h"
#include "pakv_ep.h"

/* One registered op. */
typedef struct {
  PakvOrtCustomOp base; /* first: ORT sees an OrtCustomOp* */
  int kind;             /* PAKV_OP_GATHER / PAKV_OP_SCATTER (pakv_ep.h) */
  int key_dtype;        /* index into PAKV_CACHE_DTYPES */
  int value_dtype;
  int backend;          /* bridge slot; PAKV_NATIVE_BACKEND = the C kernel */
  int ep;               /* PAKV_EP_*: the execution provider of this entry */
  int parallel_for;     /* the runtime offers KernelContext_ParallelFor (API >= 17) */
  int query_dtype;      /* com.microsoft::PagedAttention: T (index into PAKV_CACHE_DTYPES); key_dtype is T_CACHE */
  int alias;            /* the write op declares its caches aliased to its outputs (opted in: pakv_ort_register.c) */
  int shape_reference;  /* the runtime offers GetTensorElementTypeAndShapeDataReference (API >= 24) */
} pakv_op;

/* Inputs and outputs of each op kind (PAKV_OP_GATHER, PAKV_OP_SCATTER, PAKV_OP_ATTENTION). */
extern const size_t PAKV_ORT_INPUT_COUNT[PAKV_OP_ATTENTION + 1];
extern const size_t PAKV_ORT_OUTPUT_COUNT[PAKV_OP_ATTENTION + 1];

OrtStatus* pakv_ort_status(const OrtApi* api, int code, const char* msg);

/* What the kernels of both domains share (pakv_ort.c) ---------------------------------------- */
/* An attribute's type as ORT holds it (absent: not on the node). */
typedef enum { ATTR_ABSENT, ATTR_INT, ATTR_FLOAT, ATTR_STRING, ATTR_INTS, ATTR_FLOATS, ATTR_OTHER } pakv_attr_kind;
extern const char* const PAKV_ATTR_KIND_NAMES[];
pakv_attr_kind pakv_ort_attribute_kind(const OrtApi* api, const OrtKernelInfo* info, const char* name);
OrtStatus* pakv_ort_attribute_error(const OrtApi* api, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
/* 0, or -1 with err set to "what: ORT's message" (the status released). */
int pakv_ort_take_status(const OrtApi* api, OrtStatus* st, pakv_err* err, const char* what);
int pakv_ort_take_status_of(const OrtApi* api, OrtStatus* st, pakv_err* err, const char* what, const char* name);
/* How a kernel reads ORT's values: its runtime, its EP, and whether that runtime gives a value's dims by
 * reference (API >= 24: one call, nothing allocated). */
typedef struct {
  const OrtApi* api;
  int ep;
  int shape_reference;
} pakv_ort_reader;
static inline pakv_ort_reader pakv_ort_reader_of(const PakvOrtCustomOp* op, const OrtApi* api) {
  pakv_ort_reader r = {api, ((const pakv_op*)op)->ep, ((const pakv_op*)op)->shape_reference};
  return r;
}
/* Input i as a record (absent beyond the node's `count` inputs or when ORT passes none). */
int pakv_ort_read_input(const pakv_ort_reader* r, OrtKernelContext* ctx, const char* name, size_t count, size_t i,
                        pakv_tensor* t, pakv_err* err);
/* An ORT tensor value as a record (the dense record of its type, dims and data; on a device EP, located). */
int pakv_ort_value_record(const pakv_ort_reader* r, const OrtValue* v, const char* name, pakv_tensor* t, pakv_err* err);
/* int64 scratch of *len entries, or NULL with *len = -1 (the validator then says there is no room). */
int64_t* pakv_ort_alloc_scratch(int64_t* len);
/* The status of a failed call: "TypeError: ..." / "ValueError: ..." as the Python front raises it. */
OrtStatus* pakv_ort_call_error(const OrtApi* api, const pakv_err* err);

/* com.microsoft::PagedAttention's kernel (pakv_ort_fused.c). */
OrtStatus* pakv_ort_fused_create(const PakvOrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out);
OrtStatus* pakv_ort_fused_compute(void* kernel, OrtKernelContext* ctx);
void pakv_ort_fused_destroy(void* kernel);

/* The kernel of `op` (its attributes read strictly), its compute and its release. */
OrtStatus* pakv_ort_kernel_create(const PakvOrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out);
OrtStatus* pakv_ort_kernel_compute(void* kernel, OrtKernelContext* ctx);
void pakv_ort_kernel_destroy(void* kernel);

/* Where a kernel writes its pools in place (the alias route: the op declares its caches aliased to its
 * outputs; a com.microsoft::PagedAttention node without cache outputs), refuse at session creation a
 * cache input (inputs first_cache, first_cache + 1) that is an initializer, naming `op`'s node and it,
 * `why` the pools are written in place and the `remedy` besides feeding the pool as a graph input. */
#define PAKV_ORT_ALIAS_ROUTE "these SessionOptions opted into the alias route (pakv_onnx.alias_caches = 1)"
OrtStatus* pakv_ort_refuse_constant_pools(const OrtApi* api, const OrtKernelInfo* info, const char* op,
                                          size_t first_cache, const char* why, const char* remedy);

#endif /* PAKV_ORT_H */
