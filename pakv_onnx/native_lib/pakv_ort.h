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
  int alias;            /* the write op declares its caches aliased to its outputs (opted in: pakv_ort_register.c) */
} pakv_op;

/* Inputs and outputs of each op kind (PAKV_OP_GATHER, PAKV_OP_SCATTER, PAKV_OP_ATTENTION). */
extern const size_t PAKV_ORT_INPUT_COUNT[PAKV_OP_ATTENTION + 1];
extern const size_t PAKV_ORT_OUTPUT_COUNT[PAKV_OP_ATTENTION + 1];

OrtStatus* pakv_ort_status(const OrtApi* api, int code, const char* msg);

/* The kernel of `op` (its attributes read strictly), its compute and its release. */
OrtStatus* pakv_ort_kernel_create(const PakvOrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out);
OrtStatus* pakv_ort_kernel_compute(void* kernel, OrtKernelContext* ctx);
void pakv_ort_kernel_destroy(void* kernel);

#endif /* PAKV_ORT_H */
