/* com.microsoft::PagedAttention's ONNX Runtime kernel (CPU): ORT's own fused paged-attention op, of
 * which ORT ships CUDA and WebGPU kernels only (the ops ORT reads are pakv_ort_register.c).
 *
 * ORT glue only: each attribute read with its type checked (the values' rules are the contract's,
 * pakv_contract_fused.c, checked once at kernel creation), ORT's tensors -> records -> the validator ->
 * ORT's outputs validated too -> the caches copied to separate cache outputs when ORT gave some ->
 * the prologue and attention cores on ORT's intra-op pool. The caches are written in place when the
 * node has no cache outputs, or when the outputs are the caches' own buffers (the alias map on ORT >=
 * 1.18 when they feed later nodes; a host binding them so, as ORT GenAI does). */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"
#include "pakv_dtypes.h"
#include "pakv_ep.h"
#include "pakv_fused.h"
#include "pakv_ort.h"

typedef struct {
  const OrtApi* api;
  int ep, parallel_for;
  pakv_ort_reader reader;
  pakv_fused_attributes attributes;
  uint32_t constant;                        /* bit i: input i is an initializer, its record read once, here */
  pakv_tensor constants[PAKV_FUSED_INPUTS]; /* those records (an initializer's value lives as long as the session) */
} fused_kernel;

/* The schema's attributes: name, type, where it goes in pakv_fused_attributes. */
typedef struct {
  const char* name;
  pakv_attr_kind kind;
  size_t offset;
  int32_t given; /* PAKV_FUSED_HAS_* set when present */
} fused_attribute;

#define FIELD(f) offsetof(pakv_fused_attributes, f)
static const fused_attribute ATTRIBUTES[] = {
    {"num_heads", ATTR_INT, FIELD(num_heads), PAKV_FUSED_HAS_NUM_HEADS},
    {"kv_num_heads", ATTR_INT, FIELD(kv_num_heads), PAKV_FUSED_HAS_KV_NUM_HEADS},
    {"local_window_size", ATTR_INT, FIELD(local_window_size), 0},
    {"is_causal", ATTR_INT, FIELD(is_causal), 0},
    {"do_rotary", ATTR_INT, FIELD(do_rotary), 0},
    {"rotary_interleaved", ATTR_INT, FIELD(rotary_interleaved), 0},
    {"v_head_size", ATTR_INT, FIELD(v_head_size), 0},
    {"rotary_offset", ATTR_INT, FIELD(rotary_offset), 0},
    {"scale", ATTR_FLOAT, FIELD(scale), 0},
    {"softcap", ATTR_FLOAT, FIELD(softcap), 0},
    {"qk_norm_epsilon", ATTR_FLOAT, FIELD(qk_norm_epsilon), 0},
    {"k_quant_type", ATTR_STRING, FIELD(k_quant_type), 0},
    {"v_quant_type", ATTR_STRING, FIELD(v_quant_type), 0},
    {"k_cache_dtype", ATTR_STRING, FIELD(k_cache_dtype), 0},
    {"v_cache_dtype", ATTR_STRING, FIELD(v_cache_dtype), 0},
    {"kv_cache_layout", ATTR_STRING, FIELD(kv_cache_layout), 0},
};
#undef FIELD
#define NUM_ATTRIBUTES (sizeof(ATTRIBUTES) / sizeof(ATTRIBUTES[0]))

/* One attribute into `a` (absent: its default stays); a present attribute of another type is an error. */
static OrtStatus* read_attribute(const OrtApi* api, const OrtKernelInfo* info, const fused_attribute* at,
                                 pakv_fused_attributes* a) {
  pakv_attr_kind kind = pakv_ort_attribute_kind(api, info, at->name);
  if (kind == ATTR_ABSENT) return NULL;
  if (kind != at->kind)
    return pakv_ort_attribute_error(api, "PagedAttention attribute %s must be a%s %s attribute, got attribute type %s",
                                    at->name, at->kind == ATTR_INT ? "n" : "", PAKV_ATTR_KIND_NAMES[at->kind],
                                    PAKV_ATTR_KIND_NAMES[kind]);
  char* field = (char*)a + at->offset;
  a->given |= at->given;
  if (kind == ATTR_INT) return PAKV_API(api, KernelInfoGetAttribute_int64)(info, at->name, (int64_t*)field);
  if (kind == ATTR_FLOAT) return PAKV_API(api, KernelInfoGetAttribute_float)(info, at->name, (float*)field);
  char text[256] = {0};
  size_t size = 0;
  OrtStatus* st = PAKV_API(api, KernelInfoGetAttribute_string)(info, at->name, NULL, &size);
  if (st) return st;
  if (size > sizeof(text)) { /* longer than any allowed value: described instead, and refused by the validator */
    pakv_fused_string(field, NULL, size - 1);
    return NULL;
  }
  if ((st = PAKV_API(api, KernelInfoGetAttribute_string)(info, at->name, text, &size))) return st;
  pakv_fused_string(field, text, size > 0 ? size - 1 : 0); /* size counts the terminating NUL */
  return NULL;
}

/* The node's declared cache outputs, before any run: the rule they meet (a LATENT node declaring
 * value_cache_out would otherwise get no value from ORT for it), and, with none, the caches are written
 * in place (ORT's contract), so neither may be a constant of the model. */
static OrtStatus* check_node_outputs(const OrtApi* api, const OrtKernelInfo* info, const pakv_fused_attributes* a) {
  size_t count = 0;
  int declared[PAKV_FUSED_OUTPUTS] = {0};
  OrtStatus* st = PAKV_API(api, KernelInfo_GetOutputCount)(info, &count);
  for (size_t i = 1; !st && i < count && i < PAKV_FUSED_OUTPUTS; i++) {
    size_t size = 0; /* the name's bytes and its NUL; an absent optional output is named "" */
    st = PAKV_API(api, KernelInfo_GetOutputName)(info, i, NULL, &size);
    declared[i] = size > 1;
  }
  if (st) return st;
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  if (pakv_fused_cache_outputs(pakv_fused_latent(a), declared[1], declared[2], &err)) return pakv_ort_call_error(api, &err);
  if (declared[1] || declared[2]) return NULL;
  return pakv_ort_refuse_constant_pools(api, info, "PagedAttention", PAKV_FUSED_KEY_CACHE,
                                        "the node has no cache outputs (ORT's contract: then its caches are updated "
                                        "in place)", "give the node its cache outputs");
}

/* The node's constant inputs (rotary caches, norm weights, scales: initializers) read once, at kernel creation:
 * each call then takes their records as they are (still validated with the call's other inputs). An input ORT
 * does not report as constant is read per call. */
static void read_constants(const OrtApi* api, const OrtKernelInfo* info, fused_kernel* k) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  for (size_t i = 0; k->ep == PAKV_EP_CPU && i < PAKV_FUSED_INPUTS; i++) {
    int constant = 0;
    const OrtValue* value = NULL;
    OrtStatus* st = PAKV_API(api, KernelInfoGetConstantInput_tensor)(info, i, &constant, &value);
    if (st) { /* past the node's inputs: none */
      PAKV_API(api, ReleaseStatus)(st);
      continue;
    }
    if (constant && value && !pakv_ort_value_record(&k->reader, value, PAKV_FUSED_NAMES[i], &k->constants[i], &err))
      k->constant |= 1u << i;
  }
}

OrtStatus* pakv_ort_fused_create(const PakvOrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  pakv_fused_attributes a;
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  pakv_fused_default_attributes(&a);
  for (size_t i = 0; i < NUM_ATTRIBUTES; i++) {
    OrtStatus* st = read_attribute(api, info, &ATTRIBUTES[i], &a);
    if (st) return st;
  }
  if (pakv_check_fused_attributes(&a, &err)) return pakv_ort_call_error(api, &err);
  OrtStatus* st = NULL;
  if (((const pakv_op*)op)->alias)
    st = pakv_ort_refuse_constant_pools(api, info, "PagedAttention", PAKV_FUSED_KEY_CACHE, PAKV_ORT_ALIAS_ROUTE,
                                        "leave the alias route off");
  if (!st) st = check_node_outputs(api, info, &a);
  if (st) return st;
  fused_kernel* k = (fused_kernel*)calloc(1, sizeof(fused_kernel));
  if (!k) return pakv_ort_status(api, PAKV_ORT_FAIL, "pakv: out of memory creating the kernel");
  k->api = api;
  k->ep = ((const pakv_op*)op)->ep;
  k->parallel_for = ((const pakv_op*)op)->parallel_for;
  k->attributes = a;
  k->reader = pakv_ort_reader_of(op, api);
  read_constants(api, info, k);
  *out = k;
  return NULL;
}

void pakv_ort_fused_destroy(void* kernel) { free(kernel); }

/* Output i as a dense record of `type` and `dims`, or absent when the node does not have it (ORT
 * hands back no value for an optional output the node left out). */
static int output_of(const OrtApi* api, OrtKernelContext* ctx, size_t count, int i, int type, const int64_t* dims,
                     int rank, pakv_tensor* t, pakv_err* err) {
  OrtValue* value = NULL;
  void* data = NULL;
  const char* name = PAKV_FUSED_NAMES[PAKV_FUSED_OUTPUT + i];
  memset(t, 0, sizeof(*t));
  if ((size_t)i >= count) return 0;
  if (pakv_ort_take_status_of(api, PAKV_API(api, KernelContext_GetOutput)(ctx, (size_t)i, dims, (size_t)rank, &value),
                              err, "allocating output", name))
    return -1;
  if (!value) return 0;
  if (pakv_ort_take_status_of(api, PAKV_API(api, GetTensorMutableData)(value, &data), err, "allocating output", name))
    return -1;
  static char empty; /* an empty output may have no buffer; nothing is written through it */
  pakv_dense_record(t, data ? data : &empty, type, rank, dims, "cpu");
  t->host_data = t->data;
  return 0;
}

/* Bytes of a dense cache record (the validator checked its extent). */
static int64_t cache_bytes(const pakv_tensor* t) {
  int64_t bytes = PAKV_CACHE_DTYPES[pakv_dtype_index(t->elem_type)].itemsize;
  for (int d = 0; d < t->ndim; d++) bytes *= t->dims[d];
  return bytes;
}

/* A decode step's scratch and prepared query rows fit on the stack; larger calls take the heap. */
#define FUSED_STACK_SCRATCH 512   /* int64 words: the per-sequence entries and per-token slots of ~64 tokens */
#define FUSED_STACK_ROWS 16384    /* bytes of prepared query rows: 16 tokens of 16 heads x 64 floats */

/* Validate, take ORT's outputs and validate them, copy each cache to its output when ORT gave a
 * separate buffer, bind, run. */
static int run_fused(const fused_kernel* k, OrtKernelContext* ctx, pakv_tensor* t, pakv_err* err) {
  const OrtApi* api = k->api;
  pakv_fused_plan plan;
  size_t count = 0;
  void* query_rows = NULL;
  int64_t stack_scratch[FUSED_STACK_SCRATCH];
  _Alignas(64) char stack_rows[FUSED_STACK_ROWS];
  int64_t len = pakv_fused_scratch_len(t);
  int64_t* scratch = len >= 0 && len <= FUSED_STACK_SCRATCH ? stack_scratch : pakv_ort_alloc_scratch(&len);
  int rc = pakv_validate_fused(t, &k->attributes, &plan, scratch, len, err);
  if (!rc)
    rc = pakv_ort_take_status(api, PAKV_API_AS(api, KernelContext_GetOutputCount, KernelContext_GetCount)(ctx, &count),
                              err, "counting outputs");
  if (!rc) {
    int64_t dims[2] = {plan.num_tokens, plan.num_heads * plan.attention.value_head_dim};
    rc = output_of(api, ctx, count, 0, plan.query_type, dims, 2, &t[PAKV_FUSED_OUTPUT], err);
  }
  for (int i = 1; !rc && i < PAKV_FUSED_OUTPUTS; i++) {
    const pakv_tensor* cache = &t[PAKV_FUSED_KEY_CACHE + i - 1];
    if (cache->present) rc = output_of(api, ctx, count, i, cache->elem_type, cache->dims, 4, &t[PAKV_FUSED_OUTPUT + i], err);
  }
  if (!rc && !t[PAKV_FUSED_OUTPUT].present) rc = pakv_fail(err, "ORT gave no buffer for output 0 (output)");
  if (!rc) rc = pakv_validate_fused_outputs(t, &plan, err);
  void* caches[2] = {NULL, NULL};
  for (int i = 0; !rc && i < 2; i++) {
    const pakv_tensor *cache = &t[PAKV_FUSED_KEY_CACHE + i], *out = &t[PAKV_FUSED_KEY_CACHE_OUT + i];
    if (!cache->present) continue;
    caches[i] = out->present ? (void*)out->data : (void*)cache->data; /* no cache output: in place, as ORT says */
    if (caches[i] != cache->data) /* a host may have bound it to read-only memory */
      rc = pakv_check_buffer_writable(caches[i], cache_bytes(cache), i ? "value_cache_out" : "key_cache_out", err);
    if (!rc && caches[i] != cache->data) memcpy(caches[i], cache->data, (size_t)cache_bytes(cache));
  }
  int64_t rows = rc ? 0 : pakv_fused_query_rows_bytes(&plan);
  if (rows > 0 && rows <= FUSED_STACK_ROWS)
    query_rows = stack_rows;
  else if (rows > 0 && !(query_rows = malloc((size_t)rows)))
    rc = pakv_fail(err, "out of memory for the prepared query rows (%lld bytes)", (long long)rows);
  if (!rc) {
    pakv_fused_bind(&plan, (void*)t[PAKV_FUSED_OUTPUT].data, query_rows, caches[0], caches[1]);
    rc = pakv_ep_run_fused(api, ctx, k->ep, k->parallel_for, &plan, err);
  }
  if (query_rows != stack_rows) free(query_rows);
  if (scratch != stack_scratch) free(scratch);
  return rc;
}

OrtStatus* pakv_ort_fused_compute(void* kernel, OrtKernelContext* ctx) {
  const fused_kernel* k = (const fused_kernel*)kernel;
  const OrtApi* api = k->api;
  pakv_tensor records[PAKV_FUSED_RECORDS]; /* on the stack: no allocation per call */
  memset(records, 0, sizeof(records));     /* a record never filled in is absent */
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  size_t count = 0;
  int rc = 0;
  if (!rc)
    rc = pakv_ort_take_status(api, PAKV_API_AS(api, KernelContext_GetInputCount, KernelContext_GetCount)(ctx, &count),
                              &err, "counting inputs");
  for (size_t i = 0; !rc && i < PAKV_FUSED_INPUTS; i++) {
    if (i < count && (k->constant >> i & 1u))
      records[i] = k->constants[i];
    else
      rc = pakv_ort_read_input(&k->reader, ctx, PAKV_FUSED_NAMES[i], count, i, &records[i], &err);
  }
  if (!rc) rc = run_fused(k, ctx, records, &err);
  return rc ? pakv_ort_call_error(api, &err) : NULL;
}
