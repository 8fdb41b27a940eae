#define _POSIX_C_SOURCE 200809L /* setenv */
/* Drives libpakv_ort.so through a fake OrtApi table (no ONNX Runtime), for valgrind/ASan runs:
 * random valid and invalid calls, every input allocated at its exact size so any out-of-bounds
 * read is reported, every accepted call checked byte-for-byte against a per-token reference.
 * The slot numbers, the op struct, the dtype table and the plan struct come from the library's
 * own headers (compile with -I pakv_onnx/native_lib), so nothing here is a second copy.
 * With a fake device driver (tests/native/fake_device_driver.c) the CUDA and CANN entries run too:
 * caches and outputs labelled device memory, index inputs host memory (now and then not: refused),
 * every driver call checked for ORT's stream; large CPU copies go through a fake ParallelFor.
 * usage: fake_ort_driver <libpakv_ort.so> <iterations> <seed> [<libfake_device_driver.so>]
 * exit 0 = all good */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"
#include "pakv_core.h"
#include "pakv_dtypes.h"
#include "pakv_ep.h"

typedef struct { int code; char msg[1100]; } Status;
typedef struct { int type; size_t nd; int64_t dims[16]; void* data; int mem_type, mem_id; } Value;
typedef struct { Value* in[5]; size_t nin; Value out[2]; int out_mem; long parallel_calls; } Ctx;
typedef struct { const char* mode; int64_t cumsum; } Info; /* cumsum < 0: absent */
/* Room for every cache op (pairs x kinds x EPs), PagedAttention's entries and a few more. */
#define DOMAIN_CAPACITY (PAKV_NUM_DTYPES * PAKV_NUM_DTYPES * PAKV_NUM_OP_KINDS * PAKV_NUM_EPS + PAKV_NUM_ATTENTION_DTYPES + 8)
typedef struct { const PakvOrtCustomOp* ops[DOMAIN_CAPACITY]; int n; char name[32]; } Domain;
typedef struct { char key[4][64]; char value[4][64]; int set; } Options; /* up to 4 config entries */

static Status* CreateStatus(int code, const char* msg) {
  Status* s = calloc(1, sizeof(Status)); s->code = code; snprintf(s->msg, sizeof(s->msg), "%s", msg); return s;
}
static const char* GetErrorMessage(const Status* s) { return s->msg; }
static Status* CreateCustomOpDomain(const char* d, Domain** out) {
  *out = calloc(1, sizeof(Domain)); snprintf((*out)->name, sizeof((*out)->name), "%s", d); return NULL;
}
static Domain *g_domain, *g_ms_domain; /* the pakv domain; com.microsoft's (PagedAttention, CPU only) */
static Status* CustomOpDomain_Add(Domain* d, const PakvOrtCustomOp* op) {
  if (d->n >= DOMAIN_CAPACITY) return CreateStatus(1, "fake ORT: domain full");
  d->ops[d->n++] = op;
  return NULL;
}
static Status* AddCustomOpDomain(void* o, Domain* d) {
  (void)o;
  if (strcmp(d->name, "pakv") == 0) g_domain = d; else g_ms_domain = d;
  return NULL;
}
static Status* GetTensorMutableData(Value* v, void** out) { *out = v->data; return NULL; }
static Status* GetTensorElementType(const Value* v, int* out) { *out = v->type; return NULL; }
static Status* GetDimensionsCount(const Value* v, size_t* out) { *out = v->nd; return NULL; }
static Status* GetDimensions(const Value* v, int64_t* d, size_t n) { memcpy(d, v->dims, n * 8); return NULL; }
static Status* GetTensorTypeAndShape(const Value* v, const Value** out) { *out = v; return NULL; }
/* Attribute getters with ORT's two failure messages: absent, or present with another type. */
static int is_mode(const char* name) { return strcmp(name, "cache_mode") == 0; }
static int present(const Info* i, const char* name) { return is_mode(name) ? i->mode != NULL : i->cumsum >= 0; }
static Status* missing(const Info* i, const char* name) {
  return CreateStatus(1, present(i, name) ? "Attribute name and type don't match" : "No attribute with name:'x'is defined.");
}
static Status* GetAttrInt(const Info* i, const char* name, int64_t* out) {
  if (is_mode(name) || i->cumsum < 0) return missing(i, name);
  *out = i->cumsum; return NULL;
}
static Status* GetAttrFloat(const Info* i, const char* name, float* out) { (void)out; return missing(i, name); }
static Status* GetAttrArray(const Info* i, const char* name, void* out, size_t* n) { (void)out; (void)n; return missing(i, name); }
static Status* GetAttrStr(const Info* i, const char* name, char* out, size_t* size) {
  if (!is_mode(name) || !i->mode) return missing(i, name);
  size_t need = strlen(i->mode) + 1;
  if (!out) { *size = need; return NULL; }
  if (*size < need) { *size = need; return CreateStatus(1, "short"); }
  memcpy(out, i->mode, need); *size = need; return NULL;
}
static Status* GetInputCount(const Ctx* c, size_t* out) { *out = c->nin; return NULL; }
static Status* GetOutputCount(const Ctx* c, size_t* out) { (void)c; *out = 2; return NULL; }
static Status* GetInput(const Ctx* c, size_t i, const Value** out) { *out = i < c->nin ? c->in[i] : NULL; return NULL; }
static int elem_size(int t) { int d = pakv_dtype_index(t); return d < 0 ? 4 : PAKV_CACHE_DTYPES[d].itemsize; }
static Status* GetOutput(Ctx* c, size_t i, const int64_t* dims, size_t n, Value** out) {
  Value* v = &c->out[i]; int64_t count = 1;
  v->nd = n; for (size_t d = 0; d < n; d++) { v->dims[d] = dims[d]; count *= dims[d]; }
  v->type = c->in[i]->type; /* each output takes its own cache's dtype */
  v->mem_type = c->out_mem; v->mem_id = 0;
  v->data = malloc(count * elem_size(v->type) + 1); *out = v; return NULL;
}
/* Memory infos (each value is its own), ORT's stream, ORT's pool (parts run here, last first). */
#define FAKE_STREAM ((void*)0x5EED0)
static Status* GetMemoryInfo(const Value* v, const Value** out) { *out = v; return NULL; }
static void GetDeviceType(const Value* v, int* out) { *out = v->mem_type; }
static Status* GetDeviceId(const Value* v, int* out) { *out = v->mem_id; return NULL; }
static Status* GetStream(const Ctx* c, void** out) { (void)c; *out = FAKE_STREAM; return NULL; }
static Status* ParallelFor(Ctx* c, void (*fn)(void*, size_t), size_t total, size_t batch, void* data) {
  (void)batch; c->parallel_calls++;
  for (size_t i = total; i-- > 0;) fn(data, i);
  return NULL;
}
static void ReleaseStatus(Status* s) { free(s); }
static void ReleaseInfo(void* p) { (void)p; }
static int config_at(const Options* o, const char* key) {
  for (int i = 0; i < o->set; i++) if (!strcmp(o->key[i], key)) return i;
  return -1;
}
static Status* HasConfig(const Options* o, const char* key, int* out) { *out = config_at(o, key) >= 0; return NULL; }
static Status* GetConfig(const Options* o, const char* key, char* value, size_t* size) {
  int i = config_at(o, key);
  if (i < 0) return CreateStatus(1, "absent");
  size_t need = strlen(o->value[i]) + 1;
  if (!value || *size < need) { *size = need; return value ? CreateStatus(1, "short") : NULL; }
  memcpy(value, o->value[i], need); *size = need; return NULL;
}
static Status* AddConfig(Options* o, const char* key, const char* value) {
  int i = config_at(o, key);
  if (i < 0 && o->set == 4) return CreateStatus(1, "fake options: full");
  if (i < 0) i = o->set++;
  snprintf(o->key[i], sizeof(o->key[i]), "%s", key); snprintf(o->value[i], sizeof(o->value[i]), "%s", value); return NULL;
}

static void* g_table[PAKV_SLOT_COUNT_USED];
static const void* GetApi(uint32_t v) { return v <= PAKV_ORT_API_OPSET_RANGE ? g_table : NULL; }
static const char* Version(void) { return "1.17.0-fake"; }
static OrtApiBase g_base;

static uint64_t g_rng;
static int64_t rnd(int64_t n) { g_rng = g_rng * 6364136223846793005ULL + 1442695040888963407ULL; return n > 0 ? (int64_t)((g_rng >> 33) % (uint64_t)n) : 0; }

static Value* make(int type, size_t nd, const int64_t* dims) {
  Value* v = calloc(1, sizeof(Value)); v->type = type; v->nd = nd; int64_t count = 1;
  for (size_t i = 0; i < nd; i++) { v->dims[i] = dims[i]; count *= dims[i]; }
  size_t bytes = (size_t)count * (type == 7 ? 8 : elem_size(type));
  v->data = malloc(bytes ? bytes : 1);
  for (size_t b = 0; b < bytes; b++) ((unsigned char*)v->data)[b] = (unsigned char)rnd(256);
  return v;
}
static int64_t get(const Value* v, int64_t i) { return v->type == 7 ? ((int64_t*)v->data)[i] : ((int32_t*)v->data)[i]; }
static void put(Value* v, int64_t i, int64_t x) { if (v->type == 7) ((int64_t*)v->data)[i] = x; else ((int32_t*)v->data)[i] = (int32_t)x; }

/* Per-token reference (only for calls the kernel accepted): token t of q reads block
 * block_tables[q, seq_offset[q] // bs + t // bs], slot t % bs. */
static int check(Ctx* c, int nz, int cumsum) {
  Value *kc = c->in[0], *bt = c->in[2], *sl = c->in[3], *so = c->nin > 4 ? c->in[4] : NULL;
  int64_t Q = bt->dims[0], cols = bt->dims[1], bs = nz ? kc->dims[2] : kc->dims[1], start = 0;
  for (int64_t q = 0; q < Q; q++) {
    int64_t len = cumsum ? get(sl, q + 1) - get(sl, q) : get(sl, q), col0 = so ? get(so, q) / bs : 0;
    for (int64_t t = 0; t < len; t++) {
      int64_t block = get(bt, q * cols + col0 + t / bs), slot = t % bs;
      for (int o = 0; o < 2; o++) {
        Value* cache = c->in[o]; Value* out = &c->out[o];
        int64_t row = (nz ? cache->dims[1] * cache->dims[3] : cache->dims[2] * cache->dims[3]) * elem_size(cache->type);
        const char* dst = (const char*)out->data + (start + t) * row;
        if (!nz) { if (memcmp(dst, (char*)cache->data + (block * bs + slot) * row, row)) return -1; }
        else for (int64_t f = 0; f < row / 32; f++)
          if (memcmp(dst + f * 32, (char*)cache->data + ((block * (row / 32) + f) * bs + slot) * 32, 32)) return -1;
      }
    }
    start += len;
  }
  return 0;
}

static int64_t cache_dims(int nz, int64_t nb, int64_t bs, int64_t e, int64_t* d) {
  if (!nz) { d[0] = nb; d[1] = bs; d[2] = 1 + rnd(2); d[3] = rnd(4); }
  else { d[0] = nb; d[1] = 1 + rnd(2); d[2] = bs; d[3] = e; }
  return 0;
}

/* The direct entry point: a bad plan is refused, a strided (pool view) plan is gathered in place. */
static int check_direct(void* lib) {
  int (*gather)(const pakv_plan*, char*, size_t) = (int (*)(const pakv_plan*, char*, size_t))dlsym(lib, "pakv_gather");
  int64_t table[2] = {0, 5}, lens[1] = {4}, starts[1] = {0}, colst[1] = {0};
  char pool[2 * 2 * 2 * 8], out_k[4 * 8], out_v[4 * 8], err[256] = "";
  for (size_t i = 0; i < sizeof(pool); i++) pool[i] = (char)i;
  /* pool [nb=2, 2 (k/v), bs=2, row=8 bytes]: key blocks at 0 and 32, value blocks at 16 and 48. */
  pakv_plan p = {PAKV_ABI_VERSION, sizeof(pakv_plan), PAKV_LAYOUT_NORM, 1, 2, 2, pool, pool + 16, 32, 32, 8, 8,
                 out_k, out_v, 1, 2, table, 16, 8, lens, starts, colst, 4, 2, 0, {4, 8, 0}, {4, 8, 0}};
  int wrong = 0;
  if (gather(&p, err, sizeof err) == 0 || !strstr(err, "entry (0, 1) = 5")) { fprintf(stderr, "bad plan accepted: %s\n", err); wrong++; }
  table[1] = 1;
  if (gather(&p, err, sizeof err) != 0) { fprintf(stderr, "strided plan refused: %s\n", err); wrong++; }
  else for (int t = 0; t < 4; t++)
    if (memcmp(out_k + t * 8, pool + 32 * table[t / 2] + (t % 2) * 8, 8) || memcmp(out_v + t * 8, pool + 16 + 32 * table[t / 2] + (t % 2) * 8, 8)) {
      fprintf(stderr, "strided plan: token %d differs\n", t); wrong++; }
  p.struct_size -= 8;
  if (gather(&p, err, sizeof err) == 0 || !strstr(err, "ABI")) { fprintf(stderr, "short plan accepted: %s\n", err); wrong++; }
  return wrong;
}

int main(int argc, char** argv) {
  if (argc < 4) return 2;
  g_rng = strtoull(argv[3], NULL, 10);
  g_base.GetApi = (const OrtApi* (*)(uint32_t))GetApi;
  g_base.GetVersionString = Version;
#define SET(slot, fn) g_table[PAKV_SLOT_##slot] = (void*)fn
  SET(CreateStatus, CreateStatus); SET(GetErrorMessage, GetErrorMessage); SET(CreateCustomOpDomain, CreateCustomOpDomain);
  SET(CustomOpDomain_Add, CustomOpDomain_Add); SET(AddCustomOpDomain, AddCustomOpDomain);
  SET(GetTensorMutableData, GetTensorMutableData); SET(GetTensorElementType, GetTensorElementType);
  SET(GetDimensionsCount, GetDimensionsCount); SET(GetDimensions, GetDimensions); SET(GetTensorTypeAndShape, GetTensorTypeAndShape);
  SET(KernelInfoGetAttribute_float, GetAttrFloat); SET(KernelInfoGetAttribute_int64, GetAttrInt);
  SET(KernelInfoGetAttribute_string, GetAttrStr); SET(KernelInfoGetAttributeArray_float, GetAttrArray);
  SET(KernelInfoGetAttributeArray_int64, GetAttrArray); SET(KernelContext_GetInputCount, GetInputCount);
  SET(KernelContext_GetOutputCount, GetOutputCount); SET(KernelContext_GetInput, GetInput); SET(KernelContext_GetOutput, GetOutput);
  SET(ReleaseStatus, ReleaseStatus); SET(ReleaseTensorTypeAndShapeInfo, ReleaseInfo);
  SET(AddSessionConfigEntry, AddConfig); SET(HasSessionConfigEntry, HasConfig); SET(GetSessionConfigEntry, GetConfig);
  SET(GetTensorMemoryInfo, GetMemoryInfo); SET(MemoryInfoGetDeviceType, GetDeviceType); SET(MemoryInfoGetId, GetDeviceId);
  SET(KernelContext_GetGPUComputeStream, GetStream); SET(KernelContext_ParallelFor, ParallelFor);
  /* The device entries' driver (a fake doing host memcpy), opened by the library on first use. */
  void* fake_driver = NULL;
  long (*driver_count)(const char*) = NULL;
  if (argc > 4) {
    setenv("PAKV_ONNX_CUDA_DRIVER", argv[4], 1); setenv("PAKV_ONNX_CANN_DRIVER", argv[4], 1);
    fake_driver = dlopen(argv[4], RTLD_NOW);
    if (!fake_driver) { fprintf(stderr, "%s\n", dlerror()); return 2; }
    void (*reset)(void*, int) = (void (*)(void*, int))dlsym(fake_driver, "fake_driver_reset");
    driver_count = (long (*)(const char*))dlsym(fake_driver, "fake_driver_count");
    reset(FAKE_STREAM, 1);
  }
  void* lib = dlopen(argv[1], RTLD_NOW);
  if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 2; }
  Status* (*reg)(void*, const OrtApiBase*) = (Status * (*)(void*, const OrtApiBase*)) dlsym(lib, "RegisterCustomOps");
  Options options = {{{0}}, {{0}}, 0}, other = {{{0}}, {{0}}, 0};
  int npairs = PAKV_NUM_DTYPES * PAKV_NUM_DTYPES;
  /* Per EP: the gathers (one per dtype pair), then as many scatters; then PagedAttention's CPU entries. */
  if (reg(&options, &g_base) || !g_domain ||
      g_domain->n != npairs * PAKV_NUM_OP_KINDS * PAKV_NUM_EPS + PAKV_NUM_ATTENTION_DTYPES) {
    fprintf(stderr, "registration failed\n"); return 3; }
  if (!g_ms_domain || strcmp(g_ms_domain->name, "com.microsoft") || g_ms_domain->n != 12) {
    fprintf(stderr, "com.microsoft domain: %d ops\n", g_ms_domain ? g_ms_domain->n : -1); return 3; }
  for (int i = 0; i < g_ms_domain->n; i++) {
    const PakvOrtCustomOp* op = g_ms_domain->ops[i];
    if (strcmp(op->GetName(op), "PagedAttention") || strcmp(op->GetExecutionProviderType(op), "CPUExecutionProvider")) {
      fprintf(stderr, "com.microsoft entry %d: not PagedAttention on the CPU\n", i); return 3; }
  }
  if (strcmp(g_domain->ops[0]->GetName(g_domain->ops[0]), "GatherPaKvCache") ||
      strcmp(g_domain->ops[npairs]->GetName(g_domain->ops[npairs]), "ScatterPaKvCache")) {
    fprintf(stderr, "ops not registered in order\n"); return 3; }
  const PakvOrtCustomOp* first = g_domain->ops[0];
  if (first->version != PAKV_ORT_API_OPSET_RANGE || first->GetStartVersion(first) != 1 || first->GetEndVersion(first) != 1) {
    fprintf(stderr, "ops do not declare pakv opset 1 only\n"); return 3; }
  Status* again = reg(&options, &g_base); /* same options twice: refused, saying why */
  if (!again || !strstr(again->msg, "already registered")) { fprintf(stderr, "second registration not refused\n"); return 3; }
  ReleaseStatus(again);
  Domain* kept = g_domain;
  if (reg(&other, &g_base) || g_domain != kept) { fprintf(stderr, "domain not reused\n"); return 3; }
  long iters = atol(argv[2]), ok = 0, refused = 0, wrong = 0, parallel = 0, device_ok = 0;
  for (long it = 0; it < iters; it++) {
    int kd = (int)rnd(PAKV_NUM_DTYPES), vd = rnd(3) ? kd : (int)rnd(PAKV_NUM_DTYPES), nz = (int)rnd(2), cumsum = (int)rnd(2);
    int ep = fake_driver ? (int)rnd(PAKV_NUM_EPS) : PAKV_EP_CPU; /* entries are registered EP by EP */
    int device = ep == PAKV_EP_CUDA ? 1 : ep == PAKV_EP_CANN ? 3 : 0; /* OrtMemoryInfoDeviceType */
    const PakvOrtCustomOp* op = g_domain->ops[ep * npairs * PAKV_NUM_OP_KINDS + kd * PAKV_NUM_DTYPES + vd];
    if (strcmp(op->GetExecutionProviderType(op), ep == PAKV_EP_CPU ? "CPUExecutionProvider" : ep == PAKV_EP_CUDA
               ? "CUDAExecutionProvider" : "CANNExecutionProvider")) { fprintf(stderr, "entry %d: wrong EP\n", ep); return 3; }
    Info info = {rnd(10) ? (nz ? "PA_NZ" : "Norm") : "bogus", rnd(10) ? cumsum : (rnd(2) ? 7 : -1)};
    if (!rnd(20)) info.mode = NULL; /* absent: Norm */
    if (!info.mode) nz = 0;
    if (info.cumsum < 0) cumsum = 1; /* absent: default */
    void* kernel = NULL;
    Status* st = (Status*)op->CreateKernelV2(op, (const OrtApi*)g_table, (const OrtKernelInfo*)&info, &kernel);
    if (st) { ReleaseStatus(st); refused++; continue; }
    if ((info.mode && strcmp(info.mode, "bogus") == 0) || (info.cumsum != 0 && info.cumsum != 1 && info.cumsum != -1)) wrong++;
    int kt = PAKV_CACHE_DTYPES[kd].onnx_type, vt = PAKV_CACHE_DTYPES[vd].onnx_type;
    int64_t nb = rnd(6), bs = 1 + rnd(5), Q = rnd(4), cols = rnd(5);
    int64_t kdims[4], vdims[4];
    cache_dims(nz, nb, bs, 32 / elem_size(kt), kdims);
    cache_dims(nz, nb, bs, 32 / elem_size(vt), vdims);
    if (!rnd(15)) kdims[3] += 1;                  /* wrong NZ dim / shape */
    if (!rnd(15)) vdims[0] = nb + 1;              /* value num_blocks mismatch */
    if (!rnd(40)) { kdims[0] = 0; kdims[2] = INT64_MAX / 2; } /* zero-element cache with huge dims */
    int it32 = (int)rnd(2) ? 7 : 6;
    Ctx c; memset(&c, 0, sizeof(c));
    c.in[0] = make(kt, !rnd(20) ? 3 : 4, kdims);
    c.in[1] = make(rnd(25) ? vt : 11 /* double: outside the contract */, 4, vdims);
    int64_t btd[2] = {Q, cols};
    c.in[2] = make(rnd(25) ? it32 : 1, !rnd(20) ? 1 : 2, btd);
    for (int64_t i = 0; i < (c.in[2]->nd == 2 ? Q * cols : Q); i++) put(c.in[2], i, rnd(8) ? rnd(nb + 1) - (rnd(8) == 0) : rnd(1 << 30));
    int64_t sln = cumsum ? Q + 1 : Q; if (!rnd(20)) sln++;
    c.in[3] = make(rnd(2) ? 7 : 6, 1, &sln);
    int64_t acc = 0;
    for (int64_t i = 0; i < sln; i++) {
      int64_t len = rnd(3 * bs + 1);
      if (cumsum) { put(c.in[3], i, i == 0 ? (rnd(20) ? 0 : 1) : acc); acc += len; } else put(c.in[3], i, len);
      if (!rnd(30)) put(c.in[3], i, rnd(2) ? -3 : (c.in[3]->type == 7 ? INT64_MAX : INT32_MAX));
    }
    c.nin = rnd(3) ? 5 : 4;
    if (c.nin == 5) { int64_t n = rnd(15) ? Q : Q + 1; c.in[4] = make(rnd(2) ? 7 : 6, 1, &n);
      for (int64_t i = 0; i < n; i++) put(c.in[4], i, rnd(10) ? rnd(2 * bs + 1) : rnd(5) - 2); } /* any offset: floor rule */
    /* Caches and outputs in the entry's device memory; index inputs on the host, now and then not. */
    c.in[0]->mem_type = c.in[1]->mem_type = c.out_mem = device;
    if (device && !rnd(30)) c.in[2 + rnd(c.nin - 2)]->mem_type = device;
    if (device && !rnd(30)) c.in[1]->mem_id = 1; /* value cache on another device */
    st = (Status*)op->KernelComputeV2(kernel, (OrtKernelContext*)&c);
    if (st) { refused++; ReleaseStatus(st); }
    else if (check(&c, nz, cumsum)) { wrong++; fprintf(stderr, "iteration %ld: output differs\n", it); }
    else { ok++; device_ok += device != 0; }
    parallel += c.parallel_calls;
    op->KernelDestroy(kernel);
    for (int i = 0; i < 5; i++) if (c.in[i]) { free(c.in[i]->data); free(c.in[i]); }
    for (int i = 0; i < 2; i++) free(c.out[i].data);
  }
  wrong += check_direct(lib);
  free(g_domain);
  free(g_ms_domain);
  if (driver_count && (driver_count("wrong_stream") || driver_count("misuse"))) {
    fprintf(stderr, "driver calls off ORT's stream: %ld, refused by the driver: %ld\n", driver_count("wrong_stream"),
            driver_count("misuse"));
    wrong++;
  }
  printf("ok=%ld refused=%ld wrong=%ld device_ok=%ld parallel=%ld\n", ok, refused, wrong, device_ok, parallel);
  return wrong ? 1 : (ok > 0 && refused > 0 ? 0 : 4);
}
