/* pakv::GatherPaKvCache: the ONNX Runtime glue of the custom-op library.
 *
 * Entry point: RegisterCustomOps(OrtSessionOptions*, const OrtApiBase*), loaded by ORT with
 * SessionOptions.register_custom_ops_library(path) (Python) / RegisterCustomOpsLibrary (C API).
 * No ORT header, no libonnxruntime, no Python: see ort_abi.h for the ABI subset used.
 *
 * This file: registration (one domain per backend, reused), the ops (one per (key dtype, value
 * dtype) pair of the contract, so a dtype outside it has no kernel and the session is refused at
 * creation), strict attributes, and the raw ORT inputs -> pakv_plan step (the checks the copy
 * needs to stay memory-safe, each refusal an ORT error naming the input). The copy itself is in
 * pakv_core.c; Python backends are reached through pakv_bridge.c.
 *
 * The contract (names, layouts, dtypes) is defined in pakv_onnx/spec.py.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"
#include "pakv_bridge.h"
#include "pakv_core.h"
#include "pakv_dtypes.h"

#define PAKV_DOMAIN "pakv"
#define PAKV_OP_TYPE "GatherPaKvCache"
#define PAKV_OPSET_VERSION 1
#define PAKV_NUM_PAIRS (PAKV_NUM_DTYPES * PAKV_NUM_DTYPES)
#define PAKV_MAX_MODE_LEN 64
/* Session config entry naming the backend these SessionOptions were registered for. */
#define PAKV_CONFIG_KEY "pakv_onnx.backend"

static const char* const INPUT_NAMES[PAKV_NUM_INPUTS] = {"key_cache", "value_cache", "block_tables", "seq_lens",
                                                         "seq_offset"};

/* ------------------------------------------------------------------------------------------- */
/* ORT helpers                                                                                 */
/* ------------------------------------------------------------------------------------------- */
static OrtStatus* make_status(const OrtApi* api, int code, const char* msg) {
  return PAKV_API(api, CreateStatus)(code, msg);
}

/* Turn an ORT status into our error (with context) and release it. */
static int take_status(const OrtApi* api, OrtStatus* st, pakv_err* err, const char* what) {
  if (!st) return 0;
  snprintf(err->msg, sizeof(err->msg), "%s: %s", what, PAKV_API(api, GetErrorMessage)(st));
  PAKV_API(api, ReleaseStatus)(st);
  return -1;
}

/* ------------------------------------------------------------------------------------------- */
/* Attributes: absent means the default; present with another type or value is an error      */
/* ------------------------------------------------------------------------------------------- */
typedef enum { ATTR_ABSENT, ATTR_INT, ATTR_FLOAT, ATTR_STRING, ATTR_INTS, ATTR_FLOATS, ATTR_OTHER } attr_kind;
static const char* const ATTR_KIND_NAMES[] = {"absent", "INT", "FLOAT", "STRING", "INTS", "FLOATS",
                                              "STRINGS or another non-scalar type (or an empty list)"};

/* Which type attribute `name` has. ORT has no "attribute type" query in API 16, so each typed
 * getter is tried. The array getters succeed (with 0 elements) for any attribute that is present
 * but holds no ints/floats (STRINGS, TENSOR, GRAPH, an empty list): that tells present from absent
 * without reading ORT's messages; the message ("... type don't match") is the fallback. */
static attr_kind attribute_kind(const OrtApi* api, const OrtKernelInfo* info, const char* name) {
  int64_t i;
  float f;
  size_t n = 0, ints = 0, floats = 0;
  OrtStatus* st = PAKV_API(api, KernelInfoGetAttribute_int64)(info, name, &i);
  if (!st) return ATTR_INT;
  int type_mismatch = strstr(PAKV_API(api, GetErrorMessage)(st), "type") != NULL;
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

static OrtStatus* attribute_error(const OrtApi* api, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static OrtStatus* attribute_error(const OrtApi* api, const char* fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  return make_status(api, PAKV_ORT_INVALID_ARGUMENT, msg);
}

/* cache_mode: a STRING, exactly "Norm" or "PA_NZ" (default "Norm"). */
static OrtStatus* read_cache_mode(const OrtApi* api, const OrtKernelInfo* info, int* nz) {
  static const char* allowed = "'Norm' or 'PA_NZ'";
  attr_kind kind = attribute_kind(api, info, "cache_mode");
  *nz = 0;
  if (kind == ATTR_ABSENT) return NULL;
  if (kind != ATTR_STRING)
    return attribute_error(api, "GatherPaKvCache attribute cache_mode must be a STRING attribute (%s), got attribute "
                           "type %s", allowed, ATTR_KIND_NAMES[kind]);
  char mode[PAKV_MAX_MODE_LEN];
  size_t size = 0;
  OrtStatus* st = PAKV_API(api, KernelInfoGetAttribute_string)(info, "cache_mode", NULL, &size);
  if (st) return st;
  if (size > sizeof(mode))
    return attribute_error(api, "cache_mode must be %s, got a string of %zu bytes", allowed, size - 1);
  size = sizeof(mode);
  if ((st = PAKV_API(api, KernelInfoGetAttribute_string)(info, "cache_mode", mode, &size))) return st;
  mode[sizeof(mode) - 1] = 0;
  if (size == 0 || strlen(mode) + 1 != size)
    return attribute_error(api, "GatherPaKvCache attribute cache_mode must be %s, got '%s' followed by a NUL byte "
                           "and more bytes", allowed, mode);
  if (strcmp(mode, "Norm") == 0) return NULL;
  if (strcmp(mode, "PA_NZ") == 0) {
    *nz = 1;
    return NULL;
  }
  return attribute_error(api, "cache_mode must be %s, got '%s'", allowed, mode);
}

/* is_seq_lens_cumsum: an INT, 0 or 1 (default 1). */
static OrtStatus* read_cumsum(const OrtApi* api, const OrtKernelInfo* info, int64_t* cumsum) {
  attr_kind kind = attribute_kind(api, info, "is_seq_lens_cumsum");
  *cumsum = 1;
  if (kind == ATTR_ABSENT) return NULL;
  if (kind != ATTR_INT)
    return attribute_error(api, "GatherPaKvCache attribute is_seq_lens_cumsum must be an INT attribute (0 or 1), got "
                           "attribute type %s", ATTR_KIND_NAMES[kind]);
  OrtStatus* st = PAKV_API(api, KernelInfoGetAttribute_int64)(info, "is_seq_lens_cumsum", cumsum);
  if (st) return st;
  if (*cumsum != 0 && *cumsum != 1)
    return attribute_error(api, "is_seq_lens_cumsum must be 0/1 (an INT attribute), got %lld", (long long)*cumsum);
  return NULL;
}

/* ------------------------------------------------------------------------------------------- */
/* Ops and kernels                                                                             */
/* ------------------------------------------------------------------------------------------- */
typedef struct {
  PakvOrtCustomOp base; /* first: ORT sees an OrtCustomOp* */
  int key_dtype;        /* index into PAKV_CACHE_DTYPES */
  int value_dtype;
  int backend;          /* bridge slot; PAKV_NATIVE_BACKEND = the C kernel */
} pakv_op;

typedef struct {
  const OrtApi* api;
  int backend, nz;
  int64_t cumsum;
} pakv_kernel;

static const char* op_name(const PakvOrtCustomOp* op) { (void)op; return PAKV_OP_TYPE; }
static const char* op_ep(const PakvOrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static int op_input_type(const PakvOrtCustomOp* op, size_t i) {
  const pakv_op* o = (const pakv_op*)op;
  if (i == 0) return PAKV_CACHE_DTYPES[o->key_dtype].onnx_type;
  if (i == 1) return PAKV_CACHE_DTYPES[o->value_dtype].onnx_type;
  return PAKV_ONNX_UNDEFINED; /* index inputs: int32 or int64, checked at run time */
}
static size_t op_input_count(const PakvOrtCustomOp* op) { (void)op; return PAKV_NUM_INPUTS; }
static int op_output_type(const PakvOrtCustomOp* op, size_t i) {
  const pakv_op* o = (const pakv_op*)op;
  return PAKV_CACHE_DTYPES[i == 0 ? o->key_dtype : o->value_dtype].onnx_type;
}
static size_t op_output_count(const PakvOrtCustomOp* op) { (void)op; return PAKV_NUM_OUTPUTS; }
static int op_input_char(const PakvOrtCustomOp* op, size_t i) { (void)op; return i == 4 ? PAKV_ORT_OPTIONAL : PAKV_ORT_REQUIRED; }
static int op_output_char(const PakvOrtCustomOp* op, size_t i) { (void)op; (void)i; return PAKV_ORT_REQUIRED; }
static int op_mem_type(const PakvOrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; /* OrtMemTypeDefault */ }
static int op_min_arity(const PakvOrtCustomOp* op) { (void)op; return 1; }
static int op_homogeneity(const PakvOrtCustomOp* op) { (void)op; return 0; }
static int op_opset_version(const PakvOrtCustomOp* op) { (void)op; return PAKV_OPSET_VERSION; }

static OrtStatus* kernel_create(const PakvOrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  int nz;
  int64_t cumsum;
  OrtStatus* st = read_cache_mode(api, info, &nz);
  if (!st) st = read_cumsum(api, info, &cumsum);
  if (st) return st;
  pakv_kernel* k = (pakv_kernel*)calloc(1, sizeof(pakv_kernel));
  if (!k) return make_status(api, PAKV_ORT_FAIL, "GatherPaKvCache: out of memory creating the kernel");
  k->api = api;
  k->backend = ((const pakv_op*)op)->backend;
  k->nz = nz;
  k->cumsum = cumsum;
  *out = k;
  return NULL;
}

static void kernel_destroy(void* kernel) { free(kernel); }

/* ------------------------------------------------------------------------------------------- */
/* Raw ORT inputs -> pakv_plan                                                                 */
/* ------------------------------------------------------------------------------------------- */
typedef struct {
  pakv_plan plan;
  int64_t k_out_dims[3], v_out_dims[3];
  int out_ndim;
  int64_t* scratch; /* lengths, out_starts, col_starts: 3 * Q int64 (a snapshot of seq_lens/seq_offset) */
} pakv_prepared;

static int is_index_type(int t) { return t == PAKV_ONNX_INT32 || t == PAKV_ONNX_INT64; }

static int require_index(const pakv_tensor* t, const char* name, int rank, pakv_err* err) {
  if (!is_index_type(t->elem_type))
    return pakv_fail(err, "%s must be int32 or int64, got ONNX element type %d", name, t->elem_type);
  if (t->ndim != rank) return pakv_fail(err, "%s must have rank %d, got rank %d", name, rank, t->ndim);
  return 0;
}

static inline int64_t idx_at(const void* p, int is64, int64_t i) {
  return is64 ? ((const int64_t*)p)[i] : (int64_t)((const int32_t*)p)[i];
}

/* One rank-4 cache: (num_blocks, block_size, bytes per token, output token dims). Products are
 * checked: a cache with a zero dim holds no data, so its other dims can be anything. */
static int cache_geometry(const pakv_tensor* t, const char* name, int nz, int itemsize, int64_t* nb, int64_t* bs,
                          int64_t* row_bytes, int64_t* tok_dims, pakv_err* err) {
  const char* layout =
      nz ? "PA_NZ: [num_blocks, heads*head_dim // E, block_size, E]" : "Norm: [num_blocks, block_size, heads, head_dim]";
  if (t->ndim != 4) return pakv_fail(err, "%s must have rank 4 (%s), got rank %d", name, layout, t->ndim);
  *nb = t->dims[0];
  if (!nz) {
    int64_t e = 0;
    *bs = t->dims[1];
    tok_dims[0] = t->dims[2];
    tok_dims[1] = t->dims[3];
    if (pakv_mul(t->dims[2], t->dims[3], &e) || pakv_mul(e, itemsize, row_bytes))
      return pakv_fail(err, "%s: bytes per token (%lld x %lld x %d) overflow int64", name, (long long)t->dims[2],
                       (long long)t->dims[3], itemsize);
  } else {
    int64_t e = PAKV_NZ_FRACTAL_BYTES / itemsize;
    if (t->dims[3] != e)
      return pakv_fail(err, "%s: PA_NZ last dim must be 32 bytes / element size = %lld, got %lld", name, (long long)e,
                       (long long)t->dims[3]);
    *bs = t->dims[2];
    if (pakv_mul(t->dims[1], t->dims[3], &tok_dims[0]) || pakv_mul(tok_dims[0], itemsize, row_bytes))
      return pakv_fail(err, "%s: bytes per token (%lld x %lld x %d) overflow int64", name, (long long)t->dims[1],
                       (long long)t->dims[3], itemsize);
  }
  return 0;
}

static int read_lengths(const pakv_tensor* sl, int cumsum, int64_t Q, int64_t* lengths, int64_t* starts,
                        int64_t* total_out, pakv_err* err) {
  int sl64 = sl->elem_type == PAKV_ONNX_INT64;
  int64_t total = 0;
  if (cumsum) {
    int64_t first = idx_at(sl->data, sl64, 0);
    if (first != 0) return pakv_fail(err, "seq_lens (cumsum) must start at 0, got seq_lens[0] = %lld", (long long)first);
    int64_t a = 0;
    for (int64_t q = 0; q < Q; q++) {
      int64_t b = idx_at(sl->data, sl64, q + 1); /* each entry read once: a snapshot */
      if (b < a)
        return pakv_fail(err,
                         "seq_lens (cumsum) must be non-decreasing, got seq_lens[%lld] = %lld < seq_lens[%lld] = %lld",
                         (long long)(q + 1), (long long)b, (long long)q, (long long)a);
      lengths[q] = b - a; /* 0 <= a <= b: no overflow */
      starts[q] = a;
      a = b;
    }
    total = a;
  } else {
    for (int64_t q = 0; q < Q; q++) {
      int64_t n = idx_at(sl->data, sl64, q);
      if (n < 0)
        return pakv_fail(err, "seq_lens (lengths) must be non-negative, got seq_lens[%lld] = %lld", (long long)q,
                         (long long)n);
      if (n > INT64_MAX - total)
        return pakv_fail(err, "seq_lens (lengths): the total token count overflows int64 at seq_lens[%lld]",
                         (long long)q);
      lengths[q] = n;
      starts[q] = total;
      total += n;
    }
  }
  *total_out = total;
  return 0;
}

static int prepare(const pakv_tensor in[PAKV_NUM_INPUTS], int nz, int cumsum, pakv_prepared* p, pakv_err* err) {
  const pakv_tensor *kc = &in[0], *vc = &in[1], *bt = &in[2], *sl = &in[3], *so = &in[4];
  memset(p, 0, sizeof(*p));
  int kd = pakv_dtype_index(kc->elem_type), vd = pakv_dtype_index(vc->elem_type);
  if (kd < 0) return pakv_fail(err, "key_cache ONNX element type %d is not in the contract", kc->elem_type);
  if (vd < 0) return pakv_fail(err, "value_cache ONNX element type %d is not in the contract", vc->elem_type);
  int64_t nb, bs, vnb, vbs, k_row, v_row, ktok[2] = {0, 0}, vtok[2] = {0, 0};
  if (cache_geometry(kc, "key_cache", nz, PAKV_CACHE_DTYPES[kd].itemsize, &nb, &bs, &k_row, ktok, err)) return -1;
  if (cache_geometry(vc, "value_cache", nz, PAKV_CACHE_DTYPES[vd].itemsize, &vnb, &vbs, &v_row, vtok, err)) return -1;
  if (vnb != nb || vbs != bs)
    return pakv_fail(err, "value_cache num_blocks/block_size (%lld, %lld) must equal key_cache's (%lld, %lld)",
                     (long long)vnb, (long long)vbs, (long long)nb, (long long)bs);
  if (bs < 1) return pakv_fail(err, "key_cache block_size must be >= 1, got %lld", (long long)bs);

  if (require_index(bt, "block_tables", 2, err)) return -1;
  int64_t Q = bt->dims[0], cols = bt->dims[1], expected = Q, scratch_bytes;
  if (require_index(sl, "seq_lens", 1, err)) return -1;
  if (cumsum && pakv_add(Q, 1, &expected))
    return pakv_fail(err, "block_tables has %lld rows: Q+1 (seq_lens entries) overflows int64", (long long)Q);
  if (sl->dims[0] != expected)
    return pakv_fail(err, "seq_lens must have %s = %lld entries for block_tables with Q = %lld rows, got %lld",
                     cumsum ? "Q+1 (cumsum)" : "Q (lengths)", (long long)expected, (long long)Q,
                     (long long)sl->dims[0]);
  if (so->present) {
    if (require_index(so, "seq_offset", 1, err)) return -1;
    if (so->dims[0] != Q)
      return pakv_fail(err, "seq_offset must have Q = %lld entries, got %lld", (long long)Q, (long long)so->dims[0]);
  }
  if (pakv_mul(Q > 0 ? Q : 1, 3 * (int64_t)sizeof(int64_t), &scratch_bytes))
    return pakv_fail(err, "out of memory for %lld sequences", (long long)Q);
  p->scratch = (int64_t*)malloc((size_t)scratch_bytes);
  if (!p->scratch) return pakv_fail(err, "out of memory for %lld sequences", (long long)Q);
  int64_t *lengths = p->scratch, *starts = p->scratch + Q, *cols0 = p->scratch + 2 * Q, total = 0;
  if (read_lengths(sl, cumsum, Q, lengths, starts, &total, err)) return -1;
  int so64 = so->present && so->elem_type == PAKV_ONNX_INT64;
  for (int64_t q = 0; q < Q; q++) {
    int64_t off = so->present ? idx_at(so->data, so64, q) : 0;
    if (off < 0)
      return pakv_fail(err, "seq_offset must be non-negative, got seq_offset[%lld] = %lld", (long long)q,
                       (long long)off);
    cols0[q] = off / bs; /* the floor rule: any offset, first column seq_offset // block_size */
  }

  pakv_plan* j = &p->plan;
  j->abi_version = PAKV_ABI_VERSION;
  j->struct_size = sizeof(pakv_plan);
  j->layout = nz ? PAKV_LAYOUT_NZ : PAKV_LAYOUT_NORM;
  j->tables64 = bt->elem_type == PAKV_ONNX_INT64;
  j->num_blocks = nb;
  j->block_size = bs;
  j->key_cache = kc->data;
  j->value_cache = vc->data;
  if (pakv_mul(k_row, bs, &j->key_block_stride) || pakv_mul(v_row, bs, &j->value_block_stride))
    return pakv_fail(err, "key_cache/value_cache: one block of %lld tokens overflows int64 bytes", (long long)bs);
  j->key_row_bytes = k_row;
  j->value_row_bytes = v_row;
  j->num_seqs = Q;
  j->table_cols = cols;
  j->block_tables = bt->data;
  j->seq_lengths = lengths;
  j->out_starts = starts;
  j->col_starts = cols0;
  j->num_tokens = total;
  if (pakv_check_plan(j, err)) return -1;
  p->out_ndim = nz ? 2 : 3;
  p->k_out_dims[0] = p->v_out_dims[0] = total;
  p->k_out_dims[1] = ktok[0];
  p->v_out_dims[1] = vtok[0];
  p->k_out_dims[2] = ktok[1];
  p->v_out_dims[2] = vtok[1];
  return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* Compute                                                                                     */
/* ------------------------------------------------------------------------------------------- */
static int read_input(const OrtApi* api, OrtKernelContext* ctx, size_t count, size_t i, pakv_tensor* t,
                      pakv_err* err) {
  memset(t, 0, sizeof(*t));
  if (i >= count) return 0;
  const OrtValue* v = NULL;
  char what[64];
  snprintf(what, sizeof(what), "reading input %s", INPUT_NAMES[i]);
  if (take_status(api, PAKV_API(api, KernelContext_GetInput)(ctx, i, &v), err, what)) return -1;
  if (!v) return 0;
  OrtTensorTypeAndShapeInfo* info = NULL;
  if (take_status(api, PAKV_API(api, GetTensorTypeAndShape)(v, &info), err, what)) return -1;
  int type = 0;
  size_t nd = 0;
  int rc = take_status(api, PAKV_API(api, GetTensorElementType)(info, &type), err, what);
  if (!rc) rc = take_status(api, PAKV_API(api, GetDimensionsCount)(info, &nd), err, what);
  if (!rc && nd > PAKV_MAX_RANK)
    rc = pakv_fail(err, "%s has rank %zu, more than %d", INPUT_NAMES[i], nd, PAKV_MAX_RANK);
  if (!rc) rc = take_status(api, PAKV_API(api, GetDimensions)(info, t->dims, nd), err, what);
  PAKV_API(api, ReleaseTensorTypeAndShapeInfo)(info);
  if (rc) return -1;
  void* data = NULL;
  if (take_status(api, PAKV_API(api, GetTensorMutableData)((OrtValue*)v, &data), err, what)) return -1;
  t->present = 1;
  t->data = data;
  t->elem_type = type;
  t->ndim = (int32_t)nd;
  for (size_t d = 0; d < nd; d++)
    if (t->dims[d] < 0) return pakv_fail(err, "%s has a negative dimension", INPUT_NAMES[i]);
  return 0;
}

void* pakv_ort_output(const OrtApi* api, OrtKernelContext* ctx, int index, const int64_t* dims, int ndim,
                      pakv_err* err) {
  OrtValue* out = NULL;
  void* data = NULL;
  const char* what = index == 0 ? "allocating output key" : "allocating output value";
  if (take_status(api, PAKV_API(api, KernelContext_GetOutput)(ctx, (size_t)index, dims, (size_t)ndim, &out), err,
                  what))
    return NULL;
  if (take_status(api, PAKV_API(api, GetTensorMutableData)(out, &data), err, what)) return NULL;
  if (!data) {
    /* An empty output may have no buffer; callers never write through it. */
    static char empty;
    data = &empty;
  }
  return data;
}

static int run_native(const pakv_kernel* k, OrtKernelContext* ctx, const pakv_tensor* inputs, pakv_err* err) {
  pakv_prepared p;
  int rc = prepare(inputs, k->nz, (int)k->cumsum, &p, err);
  if (!rc) {
    p.plan.key_out = pakv_ort_output(k->api, ctx, 0, p.k_out_dims, p.out_ndim, err);
    p.plan.value_out = p.plan.key_out ? pakv_ort_output(k->api, ctx, 1, p.v_out_dims, p.out_ndim, err) : NULL;
    rc = p.plan.key_out && p.plan.value_out ? pakv_run_plan(&p.plan, err) : -1;
  }
  free(p.scratch);
  return rc;
}

/* The native Python backend's fast path (pakv_onnx.kernels.native.gather_raw): the raw inputs as
 * the ORT kernel reads them plus two caller outputs, t[0..4] = key_cache, value_cache,
 * block_tables, seq_lens, seq_offset (present = 0 when absent), t[5..6] = key_out, value_out, all
 * dense (the caller checked that, and that nothing overlaps). Runs the kernel's own checks
 * (prepare: the same rules the ORT kernel applies) and the outputs' types and shapes.
 * Returns 0 when gathered; 1 when declined before anything was written (some check failed: the
 * caller then runs the contract's checks in Python, which word the error); -1 when the copy
 * itself failed (err_out says why). Safe for any input: ranks are bounded, every read is sized
 * by the dims given. */
PAKV_EXPORT int pakv_gather_raw(const pakv_tensor* t, int nz, int cumsum, char* err_out, size_t err_len) {
  pakv_prepared p;
  pakv_err err;
  err.msg[0] = 0;
  if (!t) return 1;
  for (int i = 0; i < PAKV_NUM_INPUTS + PAKV_NUM_OUTPUTS; i++) {
    if (t[i].ndim < 0 || t[i].ndim > PAKV_MAX_RANK) return 1;
    if (i != 4 && !t[i].present) return 1;
    for (int d = 0; d < t[i].ndim; d++)
      if (t[i].dims[d] < 0) return 1;
  }
  if (prepare(t, nz != 0, cumsum != 0, &p, &err)) {
    free(p.scratch);
    return 1;
  }
  const pakv_tensor *ko = &t[5], *vo = &t[6];
  int ok = ko->elem_type == t[0].elem_type && vo->elem_type == t[1].elem_type && ko->ndim == p.out_ndim &&
           vo->ndim == p.out_ndim;
  for (int d = 0; ok && d < p.out_ndim; d++) ok = ko->dims[d] == p.k_out_dims[d] && vo->dims[d] == p.v_out_dims[d];
  if (!ok) {
    free(p.scratch);
    return 1;
  }
  p.plan.key_out = ko->data;
  p.plan.value_out = vo->data;
  int rc = pakv_run_plan(&p.plan, &err);
  free(p.scratch);
  if (rc) {
    if (err_out && err_len) snprintf(err_out, err_len, "%s", err.msg);
    return -1;
  }
  return 0;
}

static OrtStatus* kernel_compute(void* kernel, OrtKernelContext* ctx) {
  const pakv_kernel* k = (const pakv_kernel*)kernel;
  const OrtApi* api = k->api;
  pakv_request* req = (pakv_request*)calloc(1, sizeof(pakv_request));
  if (!req) return make_status(api, PAKV_ORT_FAIL, "GatherPaKvCache: out of memory");
  pakv_err err;
  size_t count = 0;
  int rc = take_status(api, PAKV_API_AS(api, KernelContext_GetInputCount, KernelContext_GetCount)(ctx, &count), &err,
                       "counting inputs");
  for (size_t i = 0; !rc && i < PAKV_NUM_INPUTS; i++) rc = read_input(api, ctx, count, i, &req->inputs[i], &err);
  for (size_t i = 0; !rc && i < 4; i++)
    if (!req->inputs[i].present) rc = pakv_fail(&err, "%s is required", INPUT_NAMES[i]);
  OrtStatus* result = NULL;
  if (!rc && k->backend != PAKV_NATIVE_BACKEND) {
    req->cache_mode = k->nz ? "PA_NZ" : "Norm";
    req->is_seq_lens_cumsum = k->cumsum;
    req->ctx = ctx;
    req->api = api;
    if (pakv_call_python(k->backend, req)) result = make_status(api, PAKV_ORT_INVALID_ARGUMENT, req->error);
  } else if (!rc) {
    rc = run_native(k, ctx, req->inputs, &err);
  }
  if (rc) result = make_status(api, PAKV_ORT_INVALID_ARGUMENT, err.msg);
  free(req);
  return result;
}

/* ------------------------------------------------------------------------------------------- */
/* Registration                                                                                */
/* ------------------------------------------------------------------------------------------- */
static pthread_mutex_t g_reg_lock = PTHREAD_MUTEX_INITIALIZER;
static pakv_op* g_ops[PAKV_MAX_BACKENDS];                /* PAKV_NUM_PAIRS ops per backend, never freed */
static OrtCustomOpDomain* g_domains[PAKV_MAX_BACKENDS];  /* one domain per backend, reused (no leak per call) */
/* The backend the next RegisterCustomOps call on this thread binds to. Thread-local: a raw
 * registration on another thread always gets native, and cannot take a backend chosen here. */
static _Thread_local int g_next_backend = PAKV_NATIVE_BACKEND;

PAKV_EXPORT int pakv_bind_next_registration(const char* name) {
  int slot = name ? pakv_backend_slot(name) : PAKV_NATIVE_BACKEND;
  g_next_backend = slot < 0 ? PAKV_NATIVE_BACKEND : slot;
  return slot;
}

static void init_ops(pakv_op* ops, int backend, uint32_t version) {
  for (int d = 0; d < PAKV_NUM_PAIRS; d++) {
    pakv_op* o = &ops[d];
    memset(o, 0, sizeof(*o));
    o->base.version = version;
    o->base.GetName = op_name;
    o->base.GetExecutionProviderType = op_ep;
    o->base.GetInputType = op_input_type;
    o->base.GetInputTypeCount = op_input_count;
    o->base.GetOutputType = op_output_type;
    o->base.GetOutputTypeCount = op_output_count;
    o->base.KernelDestroy = kernel_destroy;
    o->base.GetInputCharacteristic = op_input_char;
    o->base.GetOutputCharacteristic = op_output_char;
    o->base.GetInputMemoryType = op_mem_type;
    o->base.GetVariadicInputMinArity = op_min_arity;
    o->base.GetVariadicInputHomogeneity = op_homogeneity;
    o->base.GetVariadicOutputMinArity = op_min_arity;
    o->base.GetVariadicOutputHomogeneity = op_homogeneity;
    o->base.CreateKernelV2 = kernel_create;
    o->base.KernelComputeV2 = kernel_compute;
    o->base.GetStartVersion = op_opset_version; /* read by ORT only for version >= 17 */
    o->base.GetEndVersion = op_opset_version;
    o->key_dtype = d / PAKV_NUM_DTYPES;
    o->value_dtype = d % PAKV_NUM_DTYPES;
    o->backend = backend;
  }
}

/* The runtime's API version from its version string ("1.16.3" -> 16: ORT 1.x ships API x).
 * Parsed rather than probed with GetApi(17), which prints an error on older runtimes. */
static int runtime_api_version(const OrtApiBase* base) {
  const char* v = base->GetVersionString ? base->GetVersionString() : NULL;
  long major = 0, minor = 0;
  if (!v || sscanf(v, "%ld.%ld", &major, &minor) != 2) return PAKV_ORT_API_VERSION;
  return major > 1 ? 1000 : (int)minor;
}

/* The domain of `backend`, created on first use (caller holds g_reg_lock). */
static OrtStatus* backend_domain(const OrtApi* api, const OrtApiBase* base, int backend, OrtCustomOpDomain** out) {
  if (g_domains[backend]) {
    *out = g_domains[backend];
    return NULL;
  }
  if (!g_ops[backend]) {
    pakv_op* ops = (pakv_op*)calloc(PAKV_NUM_PAIRS, sizeof(pakv_op));
    if (!ops) return make_status(api, PAKV_ORT_FAIL, "pakv: out of memory registering the ops");
    /* A runtime that knows API 17 reads the opset range (pakv opset 1 only). */
    init_ops(ops, backend, runtime_api_version(base) >= PAKV_ORT_API_OPSET_RANGE ? PAKV_ORT_API_OPSET_RANGE
                                                                                  : PAKV_ORT_API_VERSION);
    g_ops[backend] = ops;
  }
  OrtCustomOpDomain* domain = NULL;
  OrtStatus* st = PAKV_API(api, CreateCustomOpDomain)(PAKV_DOMAIN, &domain);
  for (int d = 0; !st && d < PAKV_NUM_PAIRS; d++) st = PAKV_API(api, CustomOpDomain_Add)(domain, &g_ops[backend][d]);
  if (st) return st; /* a half-built domain is not kept (ORT owns nothing of it yet; it is leaked once) */
  g_domains[backend] = *out = domain;
  return NULL;
}

/* A second registration on the same SessionOptions would make ORT fail at session creation with
 * "Domain already set in registry"; refuse it here, saying what to do. */
static OrtStatus* mark_options(const OrtApi* api, OrtSessionOptions* options, int backend) {
  int has = 0;
  OrtStatus* st = PAKV_API(api, HasSessionConfigEntry)(options, PAKV_CONFIG_KEY, &has);
  if (st) return st;
  if (has) {
    char prev[PAKV_BACKEND_NAME_LEN + 8] = "?";
    size_t size = sizeof(prev);
    st = PAKV_API(api, GetSessionConfigEntry)(options, PAKV_CONFIG_KEY, prev, &size);
    if (st) PAKV_API(api, ReleaseStatus)(st);
    prev[sizeof(prev) - 1] = 0;
    char msg[512];
    snprintf(msg, sizeof(msg),
             "the pakv GatherPaKvCache library is already registered on these SessionOptions (backend '%s'); "
             "register it once per SessionOptions (every session made from them can use it), or use a new "
             "SessionOptions for backend '%s'",
             prev, pakv_backend_name(backend));
    return make_status(api, PAKV_ORT_INVALID_ARGUMENT, msg);
  }
  return PAKV_API(api, AddSessionConfigEntry)(options, PAKV_CONFIG_KEY, pakv_backend_name(backend));
}

PAKV_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  int backend = g_next_backend;
  g_next_backend = PAKV_NATIVE_BACKEND; /* one registration per selection; hosts that never select get native */
  const OrtApi* api = api_base->GetApi(PAKV_ORT_API_VERSION);
  if (!api) {
    /* Older runtime: find any API table to report the error with (CreateStatus is slot 0 in all). */
    for (uint32_t v = PAKV_ORT_API_VERSION - 1; v >= 1 && !api; v--) api = api_base->GetApi(v);
    if (!api) return NULL; /* cannot even report; ORT this old has no usable API */
    char msg[256];
    snprintf(msg, sizeof(msg),
             "pakv GatherPaKvCache plugin needs ONNX Runtime >= 1.16 (C API version %d); this runtime is %s",
             PAKV_ORT_API_VERSION, api_base->GetVersionString ? api_base->GetVersionString() : "older");
    return make_status(api, PAKV_ORT_FAIL, msg);
  }
  OrtStatus* st = mark_options(api, options, backend);
  if (st) return st;
  OrtCustomOpDomain* domain = NULL;
  pthread_mutex_lock(&g_reg_lock);
  st = backend_domain(api, api_base, backend, &domain);
  pthread_mutex_unlock(&g_reg_lock);
  if (st) return st;
  return PAKV_API(api, AddCustomOpDomain)(options, domain);
}
