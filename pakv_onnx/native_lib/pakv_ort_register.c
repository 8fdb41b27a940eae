/* pakv::GatherPaKvCache, pakv::ScatterPaKvCache, pakv::PagedAttention: the ops ONNX Runtime reads and
 * the library's entry point.
 *
 * Entry point: RegisterCustomOps(OrtSessionOptions*, const OrtApiBase*), loaded by ORT with
 * SessionOptions.register_custom_ops_library(path) (Python) / RegisterCustomOpsLibrary (C API).
 * No ORT header, no libonnxruntime, no Python: see ort_abi.h for the ABI subset used.
 *
 * ORT glue only: one domain per backend, reused; the ops (the cache ops one per (key dtype, value
 * dtype) pair of the contract, so a dtype outside it has no kernel and the session is refused at
 * creation, and each pair once per execution provider of pakv_ep.h; PagedAttention once per dtype
 * it computes in, CPU only), each op's types, counts, memory types and the scatter's alias map. The
 * kernels are pakv_ort.c.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"
#include "pakv_bridge.h"
#include "pakv_core.h"
#include "pakv_dtypes.h"
#include "pakv_ep.h"
#include "pakv_ort.h"

#define PAKV_DOMAIN "pakv"
#define PAKV_OPSET_VERSION 1
#define PAKV_NUM_PAIRS (PAKV_NUM_DTYPES * PAKV_NUM_DTYPES)
/* The cache ops (pakv_ep.h's PAKV_OP_GATHER / PAKV_OP_SCATTER), each registered once per execution
 * provider (pakv_ep.h) and (key dtype, value dtype) pair: op n < PAKV_NUM_CACHE_OPS is EP
 * n / (kinds x pairs), kind (n / pairs) % kinds, pair n % pairs. Then PagedAttention on the CPU, one
 * op per dtype of ATTENTION_DTYPES. */
#define PAKV_NUM_CACHE_OPS (PAKV_NUM_EPS * PAKV_NUM_OP_KINDS * PAKV_NUM_PAIRS)
#define PAKV_NUM_PAKV_OPS (PAKV_NUM_CACHE_OPS + PAKV_NUM_ATTENTION_DTYPES)
/* Then com.microsoft::PagedAttention (its own domain), CPU only, once per (T, T_CACHE) of FUSED_TYPES. */
#define PAKV_NUM_FUSED_OPS 12
#define PAKV_NUM_OPS (PAKV_NUM_PAKV_OPS + PAKV_NUM_FUSED_OPS)
#define PAKV_MS_DOMAIN "com.microsoft"
/* Session config entry naming the backend these SessionOptions were registered for. */
#define PAKV_CONFIG_KEY "pakv_onnx.backend"
/* Session config entry: "1" opts these SessionOptions into the write op's alias route (below); the library
 * writes "0" or "1" there when it registers, so a host can read which ops it got. */
#define PAKV_CONFIG_ALIAS "pakv_onnx.alias_caches"
/* PagedAttention's dtypes, as indices into PAKV_CACHE_DTYPES: bfloat16, float16, float32. */
static const int ATTENTION_DTYPES[PAKV_NUM_ATTENTION_DTYPES] = {0, 1, 2};
/* com.microsoft::PagedAttention's (T, T_CACHE) pairs, as indices into PAKV_CACHE_DTYPES: T is bfloat16,
 * float16 or float32 (ORT's schema: the first two); T_CACHE is T itself, int8, float8e4m3fn, or uint8
 * (ORT's packed int4 / float4e2m1, registered so that the kernel refuses it by name). */
static const int FUSED_TYPES[PAKV_NUM_FUSED_OPS][2] = {{0, 0}, {0, 3}, {0, 9}, {0, 4}, {1, 1}, {1, 3},
                                                       {1, 9}, {1, 4}, {2, 2}, {2, 3}, {2, 9}, {2, 4}};

/* ------------------------------------------------------------------------------------------- */
/* Ops: what ORT asks of each                                                                  */
/* ------------------------------------------------------------------------------------------- */
static const char* op_name(const PakvOrtCustomOp* op) { return pakv_op_type(((const pakv_op*)op)->kind); }
static const char* op_ep(const PakvOrtCustomOp* op) { return pakv_ep_name(((const pakv_op*)op)->ep); }
/* Gather: key_cache, value_cache, then index tensors. Scatter: key, value (of their caches'
 * dtypes), key_cache, value_cache, then slot_mapping. Attention: query, key_cache, value_cache of
 * one dtype, then index tensors. Index inputs are int32 or int64 (checked at run time). */
static int op_input_type(const PakvOrtCustomOp* op, size_t i) {
  const pakv_op* o = (const pakv_op*)op;
  size_t typed = o->kind == PAKV_OP_SCATTER ? 4 : o->kind == PAKV_OP_ATTENTION ? 3 : 2;
  if (i >= typed) return PAKV_ONNX_UNDEFINED;
  return PAKV_CACHE_DTYPES[i % 2 == 0 ? o->key_dtype : o->value_dtype].onnx_type;
}
static size_t op_input_count(const PakvOrtCustomOp* op) { return PAKV_ORT_INPUT_COUNT[((const pakv_op*)op)->kind]; }
static int op_output_type(const PakvOrtCustomOp* op, size_t i) {
  const pakv_op* o = (const pakv_op*)op;
  return PAKV_CACHE_DTYPES[i == 0 ? o->key_dtype : o->value_dtype].onnx_type;
}
static size_t op_output_count(const PakvOrtCustomOp* op) { return PAKV_ORT_OUTPUT_COUNT[((const pakv_op*)op)->kind]; }
static int op_input_char(const PakvOrtCustomOp* op, size_t i) {
  return ((const pakv_op*)op)->kind == PAKV_OP_GATHER && i == 4 ? PAKV_ORT_OPTIONAL : PAKV_ORT_REQUIRED;
}
static int op_output_char(const PakvOrtCustomOp* op, size_t i) { (void)op; (void)i; return PAKV_ORT_REQUIRED; }
static int op_mem_type(const PakvOrtCustomOp* op, size_t i) {
  const pakv_op* o = (const pakv_op*)op;
  return pakv_ep_input_memory_type(o->ep, o->kind, i); /* a device entry's index inputs on the host */
}
static int op_min_arity(const PakvOrtCustomOp* op) { (void)op; return 1; }
static int op_homogeneity(const PakvOrtCustomOp* op) { (void)op; return 0; }
static int op_opset_version(const PakvOrtCustomOp* op) { (void)op; return PAKV_OPSET_VERSION; }
/* The scatter's alias map (ORT >= 1.18 reads it): key_cache (input 2) is key_cache_out (output 0),
 * value_cache (3) is value_cache_out (1). Static arrays: ReleaseAliasMap has nothing to free.
 *
 * Declared only by the ops of a registration that opted in (PAKV_CONFIG_ALIAS, or pakv_bind_next_alias from
 * Python's make_session after it checked the graph): ORT applies an alias whatever else reads the buffer (a
 * second reader of the pool sees the write, two writes of one pool see each other's rows, an initializer
 * pool changes), so only a host that knows each pool input feeds its write alone may ask for it. Without it
 * the updated caches are the host's bound outputs (in place when bound to the pools) or ORT's (a copy). */
static int g_alias_inputs[2] = {2, 3}, g_alias_outputs[2] = {0, 1};
static size_t scatter_alias_map(int** inputs, int** outputs) {
  *inputs = g_alias_inputs;
  *outputs = g_alias_outputs;
  return 2;
}
static void release_alias_map(int* inputs, int* outputs) { (void)inputs; (void)outputs; }

/* com.microsoft::PagedAttention: 17 inputs, 3 outputs (bert_defs.cc). T: query, key, value, cos/sin,
 * head_sink, the norm weights, output; T_CACHE: the caches; float: the scales; the index inputs any
 * integer type (int32 in ORT's schema; int64 too here, checked at run time). */
static int fused_input_type(const PakvOrtCustomOp* op, size_t i) {
  const pakv_op* o = (const pakv_op*)op;
  if (i == 3 || i == 4) return PAKV_CACHE_DTYPES[o->key_dtype].onnx_type;
  if (i == 14 || i == 15) return 1; /* float */
  if ((i >= 5 && i <= 7) || i == 10 || i >= 16) return PAKV_ONNX_UNDEFINED;
  return PAKV_CACHE_DTYPES[o->query_dtype].onnx_type;
}
static size_t fused_input_count(const PakvOrtCustomOp* op) { (void)op; return 17; }
static int fused_output_type(const PakvOrtCustomOp* op, size_t i) {
  const pakv_op* o = (const pakv_op*)op;
  return PAKV_CACHE_DTYPES[i == 0 ? o->query_dtype : o->key_dtype].onnx_type;
}
static size_t fused_output_count(const PakvOrtCustomOp* op) { (void)op; return 3; }
static int fused_input_char(const PakvOrtCustomOp* op, size_t i) {
  (void)op;
  return i == 0 || i == 3 || (i >= 5 && i <= 7) ? PAKV_ORT_REQUIRED : PAKV_ORT_OPTIONAL;
}
static int fused_output_char(const PakvOrtCustomOp* op, size_t i) {
  (void)op;
  return i == 0 ? PAKV_ORT_REQUIRED : PAKV_ORT_OPTIONAL;
}
/* key_cache (input 3) is key_cache_out (output 1), value_cache (4) is value_cache_out (2). */
static int g_fused_alias_inputs[2] = {3, 4}, g_fused_alias_outputs[2] = {1, 2};
static size_t fused_alias_map(int** inputs, int** outputs) {
  *inputs = g_fused_alias_inputs;
  *outputs = g_fused_alias_outputs;
  return 2;
}

/* ------------------------------------------------------------------------------------------- */
/* Registration                                                                                */
/* ------------------------------------------------------------------------------------------- */
static pthread_mutex_t g_reg_lock = PTHREAD_MUTEX_INITIALIZER;
/* PAKV_NUM_OPS ops per (backend, alias route off / on), never freed; two domains each (pakv's ops, then
 * com.microsoft's PagedAttention), reused (no leak per call). */
static pakv_op* g_ops[PAKV_MAX_BACKENDS][2];
static OrtCustomOpDomain* g_domains[PAKV_MAX_BACKENDS][2];
static OrtCustomOpDomain* g_ms_domains[PAKV_MAX_BACKENDS][2];
/* The backend (and alias route) the next RegisterCustomOps call on this thread binds to. Thread-local: a raw
 * registration on another thread always gets native without the alias route, and cannot take a choice made here. */
static _Thread_local int g_next_backend = PAKV_NATIVE_BACKEND;
static _Thread_local int g_next_alias = 0;

PAKV_EXPORT int pakv_bind_next_registration(const char* name) {
  int slot = name ? pakv_backend_slot(name) : PAKV_NATIVE_BACKEND;
  g_next_backend = slot < 0 ? PAKV_NATIVE_BACKEND : slot;
  return slot;
}

PAKV_EXPORT void pakv_bind_next_alias(int on) { g_next_alias = on != 0; }

static size_t no_inplace(int** inputs, int** outputs) {
  *inputs = *outputs = NULL;
  return 0;
}

/* Declare `o`'s outputs aliased to its inputs as `alias_map` says (API 18's GetAliasMap; no other
 * in-place reuse): the one place the alias route's entries are set, for the scatter and the fused op. */
static void declare_alias(pakv_op* o, size_t (*alias_map)(int**, int**)) {
  o->alias = 1;
  o->base.version = PAKV_ORT_API_ALIAS_MAP;
  o->base.GetMayInplace = no_inplace;
  o->base.ReleaseMayInplace = release_alias_map;
  o->base.GetAliasMap = alias_map;
  o->base.ReleaseAliasMap = release_alias_map;
}

/* com.microsoft::PagedAttention's entry `i` (of FUSED_TYPES), over what init_ops set: CPU, its own
 * types, counts and kernel; the cache inputs aliased to the cache outputs from API 18 when the
 * registration opted into the alias route (as the scatter's: see scatter_alias_map). */
static void init_fused_op(pakv_op* o, int i, int api, int alias) {
  o->kind = PAKV_OP_FUSED;
  o->ep = PAKV_EP_CPU;
  o->query_dtype = FUSED_TYPES[i][0];
  o->key_dtype = o->value_dtype = FUSED_TYPES[i][1];
  o->base.GetInputType = fused_input_type;
  o->base.GetInputTypeCount = fused_input_count;
  o->base.GetOutputType = fused_output_type;
  o->base.GetOutputTypeCount = fused_output_count;
  o->base.GetInputCharacteristic = fused_input_char;
  o->base.GetOutputCharacteristic = fused_output_char;
  o->base.CreateKernelV2 = pakv_ort_fused_create;
  o->base.KernelComputeV2 = pakv_ort_fused_compute;
  o->base.KernelDestroy = pakv_ort_fused_destroy;
  if (alias && api >= PAKV_ORT_API_ALIAS_MAP) declare_alias(o, fused_alias_map);
}

/* Every op of `backend` (PAKV_NUM_OPS, ordered as PAKV_NUM_OPS says). `api` is the runtime's API
 * version: it reads the opset range and has ParallelFor from 17, reads the scatter's alias map
 * from 18 (declared when `alias`). */
static void init_ops(pakv_op* ops, int backend, int api, int alias) {
  for (int n = 0; n < PAKV_NUM_OPS; n++) {
    pakv_op* o = &ops[n];
    int ep = n / (PAKV_NUM_OP_KINDS * PAKV_NUM_PAIRS), kind = (n / PAKV_NUM_PAIRS) % PAKV_NUM_OP_KINDS;
    int d = n % PAKV_NUM_PAIRS;
    if (n >= PAKV_NUM_CACHE_OPS && n < PAKV_NUM_PAKV_OPS) { /* PagedAttention: CPU, one dtype for every tensor */
      int dtype = ATTENTION_DTYPES[n - PAKV_NUM_CACHE_OPS];
      ep = PAKV_EP_CPU;
      kind = PAKV_OP_ATTENTION;
      d = dtype * PAKV_NUM_DTYPES + dtype;
    }
    memset(o, 0, sizeof(*o));
    o->base.version = api >= PAKV_ORT_API_OPSET_RANGE ? PAKV_ORT_API_OPSET_RANGE : PAKV_ORT_API_VERSION;
    if (kind == PAKV_OP_SCATTER && alias && api >= PAKV_ORT_API_ALIAS_MAP) declare_alias(o, scatter_alias_map);
    o->base.GetName = op_name;
    o->base.GetExecutionProviderType = op_ep;
    o->base.GetInputType = op_input_type;
    o->base.GetInputTypeCount = op_input_count;
    o->base.GetOutputType = op_output_type;
    o->base.GetOutputTypeCount = op_output_count;
    o->base.KernelDestroy = pakv_ort_kernel_destroy;
    o->base.GetInputCharacteristic = op_input_char;
    o->base.GetOutputCharacteristic = op_output_char;
    o->base.GetInputMemoryType = op_mem_type;
    o->base.GetVariadicInputMinArity = op_min_arity;
    o->base.GetVariadicInputHomogeneity = op_homogeneity;
    o->base.GetVariadicOutputMinArity = op_min_arity;
    o->base.GetVariadicOutputHomogeneity = op_homogeneity;
    o->base.CreateKernelV2 = pakv_ort_kernel_create;
    o->base.KernelComputeV2 = pakv_ort_kernel_compute;
    o->base.GetStartVersion = op_opset_version; /* read by ORT only for version >= 17 */
    o->base.GetEndVersion = op_opset_version;
    o->kind = kind;
    o->key_dtype = d / PAKV_NUM_DTYPES;
    o->value_dtype = d % PAKV_NUM_DTYPES;
    o->backend = backend;
    o->ep = ep;
    o->parallel_for = api >= PAKV_ORT_API_PARALLEL_FOR;
    o->shape_reference = api >= PAKV_ORT_API_SHAPE_REFERENCE;
    if (n >= PAKV_NUM_PAKV_OPS) init_fused_op(o, n - PAKV_NUM_PAKV_OPS, api, alias);
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

/* The domains of `backend` with or without the alias route (pakv's ops, then com.microsoft's), created on
 * first use (caller holds g_reg_lock). com.microsoft::PagedAttention runs the C kernel whatever the backend. */
static OrtStatus* backend_domain(const OrtApi* api, const OrtApiBase* base, int backend, int alias,
                                 OrtCustomOpDomain** out) {
  if (g_domains[backend][alias]) {
    out[0] = g_domains[backend][alias];
    out[1] = g_ms_domains[backend][alias];
    return NULL;
  }
  if (!g_ops[backend][alias]) {
    pakv_op* ops = (pakv_op*)calloc(PAKV_NUM_OPS, sizeof(pakv_op));
    if (!ops) return pakv_ort_status(api, PAKV_ORT_FAIL, "pakv: out of memory registering the ops");
    init_ops(ops, backend, runtime_api_version(base), alias);
    g_ops[backend][alias] = ops;
  }
  OrtCustomOpDomain *domain = NULL, *ms_domain = NULL;
  OrtStatus* st = PAKV_API(api, CreateCustomOpDomain)(PAKV_DOMAIN, &domain);
  if (!st) st = PAKV_API(api, CreateCustomOpDomain)(PAKV_MS_DOMAIN, &ms_domain);
  for (int n = 0; !st && n < PAKV_NUM_OPS; n++)
    st = PAKV_API(api, CustomOpDomain_Add)(n < PAKV_NUM_PAKV_OPS ? domain : ms_domain, &g_ops[backend][alias][n]);
  if (st) return st; /* a half-built domain is not kept (ORT owns nothing of it yet; it is leaked once) */
  g_domains[backend][alias] = out[0] = domain;
  g_ms_domains[backend][alias] = out[1] = ms_domain;
  return NULL;
}

/* Whether these options opted into the alias route: this thread's choice, or the host's config entry "1";
 * written back as "0" / "1" (a host's own entry is left as it is). */
static OrtStatus* alias_route(const OrtApi* api, OrtSessionOptions* options, int chosen, int* alias) {
  int has = 0;
  char value[4] = "";
  size_t size = sizeof(value);
  OrtStatus* st = PAKV_API(api, HasSessionConfigEntry)(options, PAKV_CONFIG_ALIAS, &has);
  if (!st && has) st = PAKV_API(api, GetSessionConfigEntry)(options, PAKV_CONFIG_ALIAS, value, &size);
  if (st) return st;
  *alias = chosen || (has && strcmp(value, "1") == 0);
  if (has && !chosen) return NULL;
  return PAKV_API(api, AddSessionConfigEntry)(options, PAKV_CONFIG_ALIAS, *alias ? "1" : "0");
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
    return pakv_ort_status(api, PAKV_ORT_INVALID_ARGUMENT, msg);
  }
  return PAKV_API(api, AddSessionConfigEntry)(options, PAKV_CONFIG_KEY, pakv_backend_name(backend));
}

PAKV_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  int backend = g_next_backend, alias = 0, chosen_alias = g_next_alias;
  g_next_backend = PAKV_NATIVE_BACKEND; /* one registration per selection; hosts that never select get native */
  g_next_alias = 0;
  const OrtApi* api = api_base->GetApi(PAKV_ORT_API_VERSION);
  if (!api) {
    /* Older runtime: find any API table to report the error with (CreateStatus is slot 0 in all). */
    for (uint32_t v = PAKV_ORT_API_VERSION - 1; v >= 1 && !api; v--) api = api_base->GetApi(v);
    if (!api) return NULL; /* cannot even report; ORT this old has no usable API */
    char msg[256];
    snprintf(msg, sizeof(msg),
             "pakv GatherPaKvCache plugin needs ONNX Runtime >= 1.16 (C API version %d); this runtime is %s",
             PAKV_ORT_API_VERSION, api_base->GetVersionString ? api_base->GetVersionString() : "older");
    return pakv_ort_status(api, PAKV_ORT_FAIL, msg);
  }
  OrtStatus* st = mark_options(api, options, backend);
  if (!st) st = alias_route(api, options, chosen_alias, &alias);
  if (st) return st;
  OrtCustomOpDomain* domains[2] = {NULL, NULL};
  pthread_mutex_lock(&g_reg_lock);
  st = backend_domain(api, api_base, backend, alias, domains);
  pthread_mutex_unlock(&g_reg_lock);
  if (!st) st = PAKV_API(api, AddCustomOpDomain)(options, domains[0]);
  if (!st) st = PAKV_API(api, AddCustomOpDomain)(options, domains[1]);
  return st;
}
