/* pakv::GatherPaKvCache, pakv::ScatterPaKvCache, pakv::PagedAttention: the ONNX Runtime kernels of
 * the custom-op library (the ops ORT reads and RegisterCustomOps are pakv_ort_register.c).
 * No ORT header, no libonnxruntime, no Python: see ort_abi.h for the ABI subset used.
 *
 * ORT glue only: strict attributes, and compute: ORT's tensors become the validator's records
 * (pakv_contract_*.c: every rule of the contract, with its message), the outputs ORT hands back are
 * validated too, and the copy core (pakv_core.c) or the attention core (pakv_attention.c) runs the
 * plan. Python backends are reached through pakv_bridge.c.
 *
 * The contract (names, layouts, dtypes) is defined in pakv_onnx/spec.py.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"
#include "pakv_bridge.h"
#include "pakv_contract.h"
#include "pakv_core.h"
#include "pakv_dtypes.h"
#include "pakv_ep.h"
#include "pakv_ort.h"

#define PAKV_MAX_MODE_LEN 64

static const char* const INPUT_NAMES[PAKV_OP_ATTENTION + 1][PAKV_NUM_INPUTS] = {
    {"key_cache", "value_cache", "block_tables", "seq_lens", "seq_offset"},
    {"key", "value", "key_cache", "value_cache", "slot_mapping"},
    {"query", "key_cache", "value_cache", "block_table", "cumulative_sequence_lengths", "past_sequence_lengths"}};
const size_t PAKV_ORT_INPUT_COUNT[PAKV_OP_ATTENTION + 1] = {PAKV_GATHER_INPUTS, PAKV_SCATTER_INPUTS,
                                                        PAKV_ATTENTION_INPUTS};
const size_t PAKV_ORT_OUTPUT_COUNT[PAKV_OP_ATTENTION + 1] = {2, 2, 1};

/* ------------------------------------------------------------------------------------------- */
/* ORT helpers                                                                                 */
/* ------------------------------------------------------------------------------------------- */
OrtStatus* pakv_ort_status(const OrtApi* api, int code, const char* msg) {
  return PAKV_API(api, CreateStatus)(code, msg);
}

/* Turn an ORT status into our error (with context) and release it. */
int pakv_ort_take_status(const OrtApi* api, OrtStatus* st, pakv_err* err, const char* what) {
  return pakv_ort_take_status_of(api, st, err, what, NULL);
}

/* The same with the context "what name" (name NULL: "what"), formatted only when there is an error:
 * a kernel call reads every input and output through here, and formatting costs more than the call. */
int pakv_ort_take_status_of(const OrtApi* api, OrtStatus* st, pakv_err* err, const char* what, const char* name) {
  if (!st) return 0;
  snprintf(err->msg, sizeof(err->msg), "%s%s%s: %s", what, name ? " " : "", name ? name : "",
           PAKV_API(api, GetErrorMessage)(st));
  PAKV_API(api, ReleaseStatus)(st);
  return -1;
}

/* ------------------------------------------------------------------------------------------- */
/* Attributes: absent means the default; present with another type or value is an error      */
/* ------------------------------------------------------------------------------------------- */
const char* const PAKV_ATTR_KIND_NAMES[] = {"absent", "INT", "FLOAT", "STRING", "INTS", "FLOATS",
                                              "STRINGS or another non-scalar type (or an empty list)"};

/* Which type attribute `name` has. ORT has no "attribute type" query in API 16, so each typed
 * getter is tried. The array getters succeed (with 0 elements) for any attribute that is present
 * but holds no ints/floats (STRINGS, TENSOR, GRAPH, an empty list): that tells present from absent
 * without reading ORT's messages; the message ("... type don't match") is the fallback. */
pakv_attr_kind pakv_ort_attribute_kind(const OrtApi* api, const OrtKernelInfo* info, const char* name) {
  int64_t i;
  float f;
  size_t n = 0, ints = 0, floats = 0;
  OrtStatus* st = PAKV_API(api, KernelInfoGetAttribute_int64)(info, name, &i);
  if (!st) return ATTR_INT;
  /* "Attribute name and type don't match" (an absent one: "No attribute with name:'...'is defined.",
   * and a name may itself hold "type", as k_quant_type does). */
  const char* message = PAKV_API(api, GetErrorMessage)(st);
  int type_mismatch = strstr(message, "don't match") != NULL || (strstr(message, "type") && !strstr(message, name));
  PAKV_API(api, ReleaseStatus)(st);
  if (!(st = PAKV_API(api, KernelInfoGetAttribute_float)(info, name, &f))) return ATTR_FLOAT;
  PAKV_API(api, ReleaseStatus)(st);
  if (!(st = PAKV_API(api, KernelInfoGetAttribute_string)(info, name, NULL, &n))) return ATTR_STRING;
  PAKV_API(api, ReleaseStatus)(st);
  int present = 0;
  if (!(st = PAKV_API(api, KernelInfoGetAttributeArray_int64)(info, name, NULL, &ints)))
    present = 1;
  else
    PAKV_API(api, ReleaseStatus)(st);
  if (!(st = PAKV_API(api, KernelInfoGetAttributeArray_float)(info, name, NULL, &floats)))
    present = 1;
  else
    PAKV_API(api, ReleaseStatus)(st);
  if (ints > 0) return ATTR_INTS;
  if (floats > 0) return ATTR_FLOATS;
  return present || type_mismatch ? ATTR_OTHER : ATTR_ABSENT;
}

OrtStatus* pakv_ort_attribute_error(const OrtApi* api, const char* fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  return pakv_ort_status(api, PAKV_ORT_INVALID_ARGUMENT, msg);
}

/* cache_mode: a STRING, exactly "Norm" or "PA_NZ" (default "Norm"). */
static OrtStatus* read_cache_mode(const OrtApi* api, const OrtKernelInfo* info, const char* op, int* nz) {
  static const char* allowed = "'Norm' or 'PA_NZ'";
  pakv_attr_kind kind = pakv_ort_attribute_kind(api, info, "cache_mode");
  *nz = 0;
  if (kind == ATTR_ABSENT) return NULL;
  if (kind != ATTR_STRING)
    return pakv_ort_attribute_error(api, "%s attribute cache_mode must be a STRING attribute (%s), got attribute "
                           "type %s", op, allowed, PAKV_ATTR_KIND_NAMES[kind]);
  char mode[PAKV_MAX_MODE_LEN];
  size_t size = 0;
  OrtStatus* st = PAKV_API(api, KernelInfoGetAttribute_string)(info, "cache_mode", NULL, &size);
  if (st) return st;
  if (size > sizeof(mode))
    return pakv_ort_attribute_error(api, "cache_mode must be %s, got a string of %zu bytes", allowed, size - 1);
  size = sizeof(mode);
  if ((st = PAKV_API(api, KernelInfoGetAttribute_string)(info, "cache_mode", mode, &size))) return st;
  mode[sizeof(mode) - 1] = 0;
  if (size == 0 || strlen(mode) + 1 != size)
    return pakv_ort_attribute_error(api, "%s attribute cache_mode must be %s, got '%s' followed by a NUL byte "
                           "and more bytes", op, allowed, mode);
  if (strcmp(mode, "Norm") == 0) return NULL;
  if (strcmp(mode, "PA_NZ") == 0) {
    *nz = 1;
    return NULL;
  }
  return pakv_ort_attribute_error(api, "cache_mode must be %s, got '%s'", allowed, mode);
}

/* is_seq_lens_cumsum: an INT, 0 or 1 (default 1). */
static OrtStatus* read_cumsum(const OrtApi* api, const OrtKernelInfo* info, int64_t* cumsum) {
  pakv_attr_kind kind = pakv_ort_attribute_kind(api, info, "is_seq_lens_cumsum");
  *cumsum = 1;
  if (kind == ATTR_ABSENT) return NULL;
  if (kind != ATTR_INT)
    return pakv_ort_attribute_error(api, "GatherPaKvCache attribute is_seq_lens_cumsum must be an INT attribute (0 or 1), got "
                           "attribute type %s", PAKV_ATTR_KIND_NAMES[kind]);
  OrtStatus* st = PAKV_API(api, KernelInfoGetAttribute_int64)(info, "is_seq_lens_cumsum", cumsum);
  if (st) return st;
  if (*cumsum != 0 && *cumsum != 1)
    return pakv_ort_attribute_error(api, "is_seq_lens_cumsum must be 0/1 (an INT attribute), got %lld", (long long)*cumsum);
  return NULL;
}

/* scale: a FLOAT (default 0: 1 / sqrt(head_dim); the validator resolves it and checks it is finite). */
static OrtStatus* read_scale(const OrtApi* api, const OrtKernelInfo* info, float* scale) {
  pakv_attr_kind kind = pakv_ort_attribute_kind(api, info, "scale");
  *scale = 0.0f;
  if (kind == ATTR_ABSENT) return NULL;
  if (kind != ATTR_FLOAT)
    return pakv_ort_attribute_error(api, "PagedAttention attribute scale must be a FLOAT attribute, got attribute type %s",
                           PAKV_ATTR_KIND_NAMES[kind]);
  return PAKV_API(api, KernelInfoGetAttribute_float)(info, "scale", scale);
}

/* ------------------------------------------------------------------------------------------- */
/* Kernels                                                                                     */
/* ------------------------------------------------------------------------------------------- */
typedef struct {
  const OrtApi* api;
  int kind, backend, nz;
  int64_t cumsum;
  int ep, parallel_for;
  float scale; /* PagedAttention's */
  pakv_ort_reader reader;
} pakv_kernel;

/* The alias route writes the pools in place, graph inputs included: a pool that is a constant of the model
 * (an initializer) would change under every later reader, the next run included. Refused at session
 * creation, naming the node and the input. (Other readers of a pool input are the opted-in host's to rule
 * out: ORT shows a kernel no graph; Python's make_session checks the graph before it opts in.) */
OrtStatus* pakv_ort_refuse_constant_pools(const OrtApi* api, const OrtKernelInfo* info, const char* op,
                                          size_t first_cache, const char* why, const char* remedy) {
  static const char* const names[2] = {"key_cache", "value_cache"};
  for (size_t i = first_cache; i <= first_cache + 1; i++) {
    int constant = 0;
    const OrtValue* value = NULL;
    OrtStatus* st = PAKV_API(api, KernelInfoGetConstantInput_tensor)(info, i, &constant, &value);
    if (st) return st;
    if (!constant) continue;
    char node[128] = "?", input[128] = "?";
    size_t size = sizeof(node);
    if ((st = PAKV_API(api, KernelInfo_GetNodeName)(info, node, &size))) PAKV_API(api, ReleaseStatus)(st);
    size = sizeof(input);
    if ((st = PAKV_API(api, KernelInfo_GetInputName)(info, i, input, &size))) PAKV_API(api, ReleaseStatus)(st);
    node[sizeof(node) - 1] = input[sizeof(input) - 1] = 0;
    return pakv_ort_attribute_error(api,
                           "%s node '%s': %s '%s' is an initializer (a constant of the model), and %s, which writes "
                           "the pool in place: feed the pool as a graph input, or %s",
                           op, node, names[i - first_cache], input, why, remedy);
  }
  return NULL;
}

OrtStatus* pakv_ort_kernel_create(const PakvOrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  int nz = 0, kind = ((const pakv_op*)op)->kind;
  int64_t cumsum = 1;
  float scale = 0.0f;
  OrtStatus* st = kind == PAKV_OP_ATTENTION ? read_scale(api, info, &scale) : read_cache_mode(api, info, pakv_op_type(kind), &nz);
  if (!st && kind == PAKV_OP_GATHER) st = read_cumsum(api, info, &cumsum);
  if (!st && ((const pakv_op*)op)->alias) st = pakv_ort_refuse_constant_pools(api, info, "ScatterPaKvCache", 2, PAKV_ORT_ALIAS_ROUTE,
                                                                    "leave the alias route off");
  if (st) return st;
  pakv_kernel* k = (pakv_kernel*)calloc(1, sizeof(pakv_kernel));
  if (!k) return pakv_ort_status(api, PAKV_ORT_FAIL, "pakv: out of memory creating the kernel");
  k->api = api;
  k->kind = kind;
  k->backend = ((const pakv_op*)op)->backend;
  k->ep = ((const pakv_op*)op)->ep;
  k->parallel_for = ((const pakv_op*)op)->parallel_for;
  k->nz = nz;
  k->cumsum = cumsum;
  k->scale = scale;
  k->reader = pakv_ort_reader_of(op, api);
  *out = k;
  return NULL;
}

void pakv_ort_kernel_destroy(void* kernel) { free(kernel); }

/* ------------------------------------------------------------------------------------------- */
/* Compute: ORT's tensors -> the validator's records -> the copy core (or a Python backend)    */
/* ------------------------------------------------------------------------------------------- */
/* Input i as a record (absent beyond the node's input count or when ORT passes none). ORT tensors
 * are dense; on the CPU execution provider every input is host memory, on a device EP its memory
 * info says where it is. */
int pakv_ort_read_input(const pakv_ort_reader* r, OrtKernelContext* ctx, const char* name, size_t count, size_t i,
                        pakv_tensor* t, pakv_err* err) {
  memset(t, 0, sizeof(*t));
  if (i >= count) return 0;
  const OrtValue* v = NULL;
  if (pakv_ort_take_status_of(r->api, PAKV_API(r->api, KernelContext_GetInput)(ctx, i, &v), err, "reading input", name))
    return -1;
  return v ? pakv_ort_value_record(r, v, name, t, err) : 0;
}

/* A value's element type, rank and dims (up to PAKV_MAX_RANK of them: a rank past the record's is kept as a
 * rank alone, and the validator refuses it by name). From API 24 one call that reads the value's own dims;
 * before, ORT's five-call route through an OrtTensorTypeAndShapeInfo it allocates and frees. */
static int value_shape(const pakv_ort_reader* r, const OrtValue* v, const char* name, int* type, size_t* nd,
                       int64_t* dims, pakv_err* err) {
  const OrtApi* api = r->api;
  const char* what = "reading input";
  if (r->shape_reference) {
    const int64_t* own = NULL;
    OrtStatus* st = PAKV_API(api, GetTensorElementTypeAndShapeDataReference)(v, type, &own, nd);
    if (pakv_ort_take_status_of(api, st, err, what, name)) return -1;
    if (*nd > 0 && !own) return pakv_fail(err, "%s %s: ORT gave rank %zu and no dims", what, name, *nd);
    for (size_t d = 0; d < *nd && d < PAKV_MAX_RANK; d++) dims[d] = own[d];
    return 0;
  }
  OrtTensorTypeAndShapeInfo* info = NULL;
  if (pakv_ort_take_status_of(api, PAKV_API(api, GetTensorTypeAndShape)(v, &info), err, what, name)) return -1;
  int rc = pakv_ort_take_status_of(api, PAKV_API(api, GetTensorElementType)(info, type), err, what, name);
  if (!rc) rc = pakv_ort_take_status_of(api, PAKV_API(api, GetDimensionsCount)(info, nd), err, what, name);
  if (!rc && *nd <= PAKV_MAX_RANK)
    rc = pakv_ort_take_status_of(api, PAKV_API(api, GetDimensions)(info, dims, *nd), err, what, name);
  PAKV_API(api, ReleaseTensorTypeAndShapeInfo)(info);
  return rc;
}

int pakv_ort_value_record(const pakv_ort_reader* r, const OrtValue* v, const char* name, pakv_tensor* t,
                          pakv_err* err) {
  int type = 0;
  size_t nd = 0;
  int64_t dims[PAKV_MAX_RANK] = {0};
  void* data = NULL;
  if (value_shape(r, v, name, &type, &nd, dims, err) ||
      pakv_ort_take_status_of(r->api, PAKV_API(r->api, GetTensorMutableData)((OrtValue*)v, &data), err, "reading input",
                              name))
    return -1;
  pakv_dense_record(t, data, type, nd > INT32_MAX ? INT32_MAX : (int)nd, dims, "cpu");
  t->host_data = data;
  return r->ep == PAKV_EP_CPU ? 0 : pakv_ep_locate(r->api, r->ep, v, t, err);
}

/* Output `index` of a kernel call, of `dims`: its buffer (an empty one: a byte never written), or NULL with err set. */
static void* pakv_ort_output(const OrtApi* api, OrtKernelContext* ctx, int index, const int64_t* dims, int ndim,
                             pakv_err* err) {
  OrtValue* out = NULL;
  void* data = NULL;
  const char* what = index == 0 ? "allocating output 0" : "allocating output 1";
  if (pakv_ort_take_status(api, PAKV_API(api, KernelContext_GetOutput)(ctx, (size_t)index, dims, (size_t)ndim, &out), err,
                  what))
    return NULL;
  if (pakv_ort_take_status(api, PAKV_API(api, GetTensorMutableData)(out, &data), err, what)) return NULL;
  if (!data) {
    /* An empty output may have no buffer; callers never write through it. */
    static char empty;
    data = &empty;
  }
  return data;
}

/* The Python callback's output `index` (the bridge's request names the kernel call). */
PAKV_EXPORT void* pakv_request_output(pakv_request* req, int index, const int64_t* dims, int ndim) {
  pakv_err err;
  if (!req) return NULL;
  if (index < 0 || index >= PAKV_NUM_OUTPUTS || ndim < 0 || ndim > PAKV_MAX_RANK || (ndim > 0 && !dims)) {
    snprintf(req->error, sizeof(req->error), "bad output request (index %d, rank %d)", index, ndim);
    return NULL;
  }
  void* p = pakv_ort_output(req->api, req->ctx, index, dims, ndim, &err);
  if (!p) snprintf(req->error, sizeof(req->error), "%s", err.msg);
  return p;
}

/* int64 scratch of `len` entries, or NULL (then len becomes -1): when it cannot be had the
 * validator still checks the call's shapes first and then says there is no room, so every
 * refusal keeps its order. */
int64_t* pakv_ort_alloc_scratch(int64_t* len) {
  int64_t bytes = 0;
  int64_t* scratch = NULL;
  if (*len >= 0 && !pakv_mul(*len > 0 ? *len : 1, (int64_t)sizeof(int64_t), &bytes)) scratch = (int64_t*)malloc((size_t)bytes);
  if (!scratch) *len = -1;
  return scratch;
}

/* Output i of the call as a dense record on this EP (the buffer ORT hands back: a host may have
 * bound it to any buffer, so it is validated like an input). */
static int output_record_of(const pakv_kernel* k, OrtKernelContext* ctx, int i, int elem_type, const int64_t* dims,
                            int rank, const char* device, pakv_tensor* t, pakv_err* err) {
  void* data = pakv_ort_output(k->api, ctx, i, dims, rank, err);
  if (!data) return -1;
  pakv_dense_record(t, data, elem_type, rank, dims, device); /* ORT allocates them on the entry's device */
  return 0;
}

/* Gather: validate, take ORT's outputs and validate them too, before anything is written; copy. */
static int run_gather(const pakv_kernel* k, OrtKernelContext* ctx, pakv_tensor* records, pakv_err* err) {
  pakv_plan plan;
  int64_t len = pakv_gather_scratch_len(records);
  int64_t* scratch = pakv_ort_alloc_scratch(&len);
  int rc = pakv_validate_gather(records, k->nz, (int)k->cumsum, &plan, scratch, len, err);
  for (int i = 0; !rc && i < PAKV_NUM_OUTPUTS; i++)
    rc = output_record_of(k, ctx, i, records[i].elem_type, i == 0 ? plan.key_out_dims : plan.value_out_dims,
                          plan.out_rank, records[PAKV_GATHER_KEY_CACHE].device, &records[PAKV_GATHER_KEY_OUT + i], err);
  if (!rc) rc = pakv_validate_gather_outputs(records, &plan, err);
  if (!rc) {
    plan.key_out = (void*)records[PAKV_GATHER_KEY_OUT].data;
    plan.value_out = (void*)records[PAKV_GATHER_VALUE_OUT].data;
    rc = pakv_ep_run_plan(k->api, ctx, k->ep, k->parallel_for, &plan, err);
  }
  free(scratch);
  return rc;
}

/* Bytes of a dense record (its dims' product x element size; the validator checked its extent). */
static int64_t dense_bytes(const pakv_tensor* t) {
  int64_t bytes = PAKV_CACHE_DTYPES[pakv_dtype_index(t->elem_type)].itemsize;
  for (int d = 0; d < t->ndim; d++) bytes *= t->dims[d];
  return bytes;
}

/* Scatter: validate; the updated caches are the buffers ORT hands back. When one is its input's
 * own buffer (the alias map, ORT >= 1.18, when it feeds later nodes; or a host that bound the
 * output to the input's buffer, as ORT GenAI does) only the T rows are written; otherwise the
 * cache is copied there first (correct, and the slow case: the whole pool per call). */
static int run_scatter(const pakv_kernel* k, OrtKernelContext* ctx, pakv_tensor* records, pakv_err* err) {
  pakv_scatter_plan plan;
  int64_t len = pakv_scatter_scratch_len(records);
  int64_t* scratch = pakv_ort_alloc_scratch(&len);
  int rc = pakv_validate_scatter(records, k->nz, &plan, scratch, len, err);
  for (int i = 0; !rc && i < PAKV_NUM_OUTPUTS; i++) {
    const pakv_tensor* cache = &records[PAKV_SCATTER_KEY_CACHE + i];
    rc = output_record_of(k, ctx, i, cache->elem_type, cache->dims, cache->ndim, cache->device,
                          &records[PAKV_SCATTER_KEY_CACHE_OUT + i], err);
  }
  if (!rc) rc = pakv_validate_scatter_outputs(records, err);
  for (int i = 0; !rc && i < PAKV_NUM_OUTPUTS; i++) {
    const pakv_tensor *cache = &records[PAKV_SCATTER_KEY_CACHE + i], *out = &records[PAKV_SCATTER_KEY_CACHE_OUT + i];
    if (out->data != cache->data && k->ep == PAKV_EP_CPU) /* a host may have bound it to read-only memory */
      rc = pakv_check_buffer_writable((void*)out->data, dense_bytes(cache), i ? "value_cache_out" : "key_cache_out", err);
    if (!rc && out->data != cache->data)
      rc = pakv_ep_copy(k->api, ctx, k->ep, (void*)out->data, cache->data, dense_bytes(cache), err);
    if (i == 0)
      plan.key_cache = (void*)out->data;
    else
      plan.value_cache = (void*)out->data;
  }
  if (!rc) rc = pakv_ep_run_scatter(k->api, ctx, k->ep, &plan, err);
  free(scratch);
  return rc;
}

/* Attention: validate, take ORT's output and validate it too, then attend (CPU: ORT's pool). */
static int run_attention(const pakv_kernel* k, OrtKernelContext* ctx, pakv_tensor* records, pakv_err* err) {
  pakv_attention_plan plan;
  int64_t len = pakv_attention_scratch_len(records);
  int64_t* scratch = pakv_ort_alloc_scratch(&len);
  int rc = pakv_validate_attention(records, k->scale, &plan, scratch, len, err);
  if (!rc) {
    int64_t dims[3] = {plan.num_tokens, plan.num_heads, plan.value_head_dim};
    rc = output_record_of(k, ctx, 0, records[PAKV_ATTENTION_QUERY].elem_type, dims, 3,
                          records[PAKV_ATTENTION_QUERY].device, &records[PAKV_ATTENTION_OUT], err);
  }
  if (!rc) rc = pakv_validate_attention_output(records, &plan, err);
  if (!rc) {
    plan.out = (void*)records[PAKV_ATTENTION_OUT].data;
    rc = pakv_ep_run_attention(k->api, ctx, k->ep, k->parallel_for, &plan, err);
  }
  free(scratch);
  return rc;
}

/* The status of a failed call: the validator's kind leads the message, as the Python front raises it. */
OrtStatus* pakv_ort_call_error(const OrtApi* api, const pakv_err* err) {
  char msg[PAKV_ERR_LEN + 16];
  snprintf(msg, sizeof(msg), "%s: %s", err->kind == PAKV_ERR_TYPE ? "TypeError" : "ValueError", err->msg);
  return pakv_ort_status(api, PAKV_ORT_INVALID_ARGUMENT, msg);
}

OrtStatus* pakv_ort_kernel_compute(void* kernel, OrtKernelContext* ctx) {
  const pakv_kernel* k = (const pakv_kernel*)kernel;
  const OrtApi* api = k->api;
  pakv_request* req = (pakv_request*)calloc(1, sizeof(pakv_request));
  pakv_tensor* records = (pakv_tensor*)calloc(PAKV_GATHER_RECORDS, sizeof(pakv_tensor)); /* = every op's */
  OrtStatus* result = NULL;
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  size_t count = 0;
  int rc = !req || !records ? pakv_fail(&err, "pakv: out of memory") : 0;
  if (!rc)
    rc = pakv_ort_take_status(api, PAKV_API_AS(api, KernelContext_GetInputCount, KernelContext_GetCount)(ctx, &count), &err,
                     "counting inputs");
  for (size_t i = 0; !rc && i < PAKV_ORT_INPUT_COUNT[k->kind]; i++) rc = pakv_ort_read_input(&k->reader, ctx, INPUT_NAMES[k->kind][i], count, i, &records[i], &err);
  if (!rc && k->backend != PAKV_NATIVE_BACKEND) rc = pakv_ep_stream(api, ctx, k->ep, &req->stream, &err);
  if (!rc && k->backend != PAKV_NATIVE_BACKEND) {
    memcpy(req->inputs, records, sizeof(req->inputs));
    req->op = pakv_op_type(k->kind);
    req->cache_mode = k->nz ? "PA_NZ" : "Norm";
    req->is_seq_lens_cumsum = k->cumsum;
    req->scale = k->scale;
    req->num_inputs = (int32_t)PAKV_ORT_INPUT_COUNT[k->kind];
    req->ctx = ctx;
    req->api = api;
    if (pakv_call_python(k->backend, req)) result = pakv_ort_status(api, PAKV_ORT_INVALID_ARGUMENT, req->error);
  } else if (!rc) {
    rc = k->kind == PAKV_OP_SCATTER     ? run_scatter(k, ctx, records, &err)
         : k->kind == PAKV_OP_ATTENTION ? run_attention(k, ctx, records, &err)
                                        : run_gather(k, ctx, records, &err);
  }
  if (rc) result = pakv_ort_call_error(api, &err);
  free(records);
  free(req);
  return result;
}
