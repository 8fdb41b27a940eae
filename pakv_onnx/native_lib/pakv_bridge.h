/* The Python bridge: backend names, the callback into Python, and the request it receives.
 *
 * The ORT glue (pakv_ort.c) binds each registration to a backend slot; slot 0 is the native C
 * kernel. A kernel of another slot hands its raw inputs (the validator's tensor records, which
 * the Python side validates through the same C validator) to the Python callback as a
 * pakv_request (mirrored as a ctypes.Structure in pakv_onnx/native_lib/__init__.py; the
 * library checks its size at load time).
 */
#ifndef PAKV_BRIDGE_H
#define PAKV_BRIDGE_H

#include <stdint.h>

#include "ort_abi.h"
#include "pakv_contract.h"
#include "pakv_core.h"

#define PAKV_NUM_INPUTS PAKV_ATTENTION_INPUTS /* the most any op has */
#define PAKV_NUM_OUTPUTS 2
#define PAKV_MAX_BACKENDS 16
#define PAKV_BACKEND_NAME_LEN 32
#define PAKV_NATIVE_BACKEND 0

typedef struct pakv_request {
  const char* backend;    /* registry name, e.g. "golden" */
  const char* op;         /* "GatherPaKvCache" / "ScatterPaKvCache" / "PagedAttention" */
  const char* cache_mode; /* "Norm" / "PA_NZ" (the attention's: "Norm") */
  int64_t is_seq_lens_cumsum; /* the gather's */
  float scale;                /* the attention's attribute (0: 1 / sqrt(head_dim)) */
  int32_t num_inputs;         /* the op's inputs (5 or 6); records past them are absent */
  pakv_tensor inputs[PAKV_NUM_INPUTS];
  OrtKernelContext* ctx;
  const OrtApi* api;
  void* stream; /* ORT's compute stream on a device EP (cudaStream_t / aclrtStream), NULL on the CPU */
  char error[PAKV_ERR_LEN];
} pakv_request;

/* Slot of backend `name` (added if new); -1 if the name is too long or the table is full. */
int pakv_backend_slot(const char* name);
/* Name of a slot ("native" for 0). */
const char* pakv_backend_name(int slot);
/* Hand a request to the Python callback; 0 on success, else req->error says why. */
int pakv_call_python(int slot, pakv_request* req);
/* The callback's way to its outputs, pakv_request_output (exported), is the ORT glue's (pakv_ort.c): the
 * bridge stands below the glue and never calls into it. */

#endif /* PAKV_BRIDGE_H */
