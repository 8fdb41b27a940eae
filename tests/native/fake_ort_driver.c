/* Drives libpakv_ort.so through a fake OrtApi table (no ONNX Runtime), for valgrind/ASan runs:
 * random valid and invalid calls, every input allocated at its exact size so any out-of-bounds
 * read is reported, every accepted call checked byte-for-byte against a per-token reference.
 * usage: fake_ort_driver <libpakv_ort.so> <iterations> <seed>    exit 0 = all good */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { int code; char msg[1100]; } Status;
typedef struct { int type; size_t nd; int64_t dims[16]; void* data; } Value;
typedef struct { Value* in[5]; size_t nin; Value out[2]; } Ctx;
typedef struct { const char* mode; int64_t cumsum; } Info;
typedef struct { void* ops[64]; int n; } Domain;
typedef struct { uint32_t version; void* f[18]; void* rest[7]; } Op; /* mirrors PakvOrtCustomOp */

static Status* CreateStatus(int code, const char* msg) {
  Status* s = calloc(1, sizeof(Status)); s->code = code; snprintf(s->msg, sizeof(s->msg), "%s", msg); return s;
}
static const char* GetErrorMessage(const Status* s) { return s->msg; }
static Status* CreateCustomOpDomain(const char* d, Domain** out) { (void)d; *out = calloc(1, sizeof(Domain)); return NULL; }
static Domain* g_domain;
static Status* CustomOpDomain_Add(Domain* d, void* op) { d->ops[d->n++] = op; return NULL; }
static Status* AddCustomOpDomain(void* o, Domain* d) { (void)o; g_domain = d; return NULL; }
static Status* GetTensorMutableData(Value* v, void** out) { *out = v->data; return NULL; }
static Status* GetTensorElementType(const Value* v, int* out) { *out = v->type; return NULL; }
static Status* GetDimensionsCount(const Value* v, size_t* out) { *out = v->nd; return NULL; }
static Status* GetDimensions(const Value* v, int64_t* d, size_t n) { memcpy(d, v->dims, n * 8); return NULL; }
static Status* GetTensorTypeAndShape(const Value* v, const Value** out) { *out = v; return NULL; }
static Status* GetAttrInt(const Info* i, const char* name, int64_t* out) {
  if (i->cumsum < 0) return CreateStatus(1, "absent"); *out = i->cumsum; return NULL;
}
static Status* GetAttrStr(const Info* i, const char* name, char* out, size_t* size) {
  if (!i->mode) return CreateStatus(1, "absent");
  size_t need = strlen(i->mode) + 1;
  if (!out) { *size = need; return NULL; }
  if (*size < need) { *size = need; return CreateStatus(1, "short"); }
  memcpy(out, i->mode, need); *size = need; return NULL;
}
static Status* GetInputCount(const Ctx* c, size_t* out) { *out = c->nin; return NULL; }
static Status* GetOutputCount(const Ctx* c, size_t* out) { *out = 2; return NULL; }
static Status* GetInput(const Ctx* c, size_t i, const Value** out) { *out = i < c->nin ? c->in[i] : NULL; return NULL; }
static int elem_size(int t);
static Status* GetOutput(Ctx* c, size_t i, const int64_t* dims, size_t n, Value** out) {
  Value* v = &c->out[i]; int64_t count = 1;
  v->nd = n; for (size_t d = 0; d < n; d++) { v->dims[d] = dims[d]; count *= dims[d]; }
  v->data = malloc(count * elem_size(c->in[0]->type) + 1); *out = v; return NULL;
}
static void ReleaseStatus(Status* s) { free(s); }
static void ReleaseInfo(void* p) { (void)p; }

static void* g_table[128];
static const void* GetApi(uint32_t v) { return v <= 16 ? g_table : NULL; }
static const char* Version(void) { return "fake"; }
static struct { const void* (*GetApi)(uint32_t); const char* (*Version)(void); } g_base = {GetApi, Version};

static const int TYPES[11] = {16, 10, 1, 3, 2, 5, 4, 6, 12, 17, 19};
static int elem_size(int t) { switch (t) { case 1: case 6: case 12: return 4; case 3: case 2: case 17: case 19: return 1; default: return 2; } }

static uint64_t g_rng;
static int64_t rnd(int64_t n) { g_rng = g_rng * 6364136223846793005ULL + 1442695040888963407ULL; return n > 0 ? (int64_t)((g_rng >> 33) % (uint64_t)n) : 0; }

static Value* make(int type, size_t nd, const int64_t* dims) {
  Value* v = calloc(1, sizeof(Value)); v->type = type; v->nd = nd; int64_t count = 1;
  for (size_t i = 0; i < nd; i++) { v->dims[i] = dims[i]; count *= dims[i]; }
  size_t bytes = (size_t)count * (type == 7 ? 8 : type == 6 ? 4 : elem_size(type));
  v->data = malloc(bytes ? bytes : 1);
  for (size_t b = 0; b < bytes; b++) ((unsigned char*)v->data)[b] = (unsigned char)rnd(256);
  return v;
}
static int64_t get(const Value* v, int64_t i) { return v->type == 7 ? ((int64_t*)v->data)[i] : ((int32_t*)v->data)[i]; }
static void put(Value* v, int64_t i, int64_t x) { if (v->type == 7) ((int64_t*)v->data)[i] = x; else ((int32_t*)v->data)[i] = (int32_t)x; }

/* Per-token reference (only for calls the kernel accepted). */
static int check(Ctx* c, int nz, int cumsum) {
  Value *kc = c->in[0], *bt = c->in[2], *sl = c->in[3], *so = c->nin > 4 ? c->in[4] : NULL;
  int64_t Q = bt->dims[0], cols = bt->dims[1], bs = nz ? kc->dims[2] : kc->dims[1], start = 0;
  int es = elem_size(kc->type);
  for (int64_t q = 0; q < Q; q++) {
    int64_t len = cumsum ? get(sl, q + 1) - get(sl, q) : get(sl, q), col0 = so ? get(so, q) / bs : 0;
    for (int64_t t = 0; t < len; t++) {
      int64_t block = get(bt, q * cols + col0 + t / bs), slot = t % bs;
      for (int o = 0; o < 2; o++) {
        Value* cache = c->in[o]; Value* out = &c->out[o];
        int64_t row = (nz ? cache->dims[1] * cache->dims[3] : cache->dims[2] * cache->dims[3]) * es;
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

int main(int argc, char** argv) {
  if (argc < 4) return 2;
  g_rng = strtoull(argv[3], NULL, 10);
  g_table[0] = CreateStatus; g_table[2] = GetErrorMessage; g_table[26] = CreateCustomOpDomain;
  g_table[27] = CustomOpDomain_Add; g_table[28] = AddCustomOpDomain; g_table[51] = GetTensorMutableData;
  g_table[60] = GetTensorElementType; g_table[61] = GetDimensionsCount; g_table[62] = GetDimensions;
  g_table[65] = GetTensorTypeAndShape; g_table[86] = GetAttrInt; g_table[87] = GetAttrStr;
  g_table[88] = GetInputCount; g_table[89] = GetOutputCount; g_table[90] = GetInput; g_table[91] = GetOutput;
  g_table[93] = ReleaseStatus; g_table[99] = ReleaseInfo;
  void* lib = dlopen(argv[1], RTLD_NOW);
  if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 2; }
  Status* (*reg)(void*, void*) = (Status * (*)(void*, void*)) dlsym(lib, "RegisterCustomOps");
  if (reg(NULL, &g_base) || !g_domain || g_domain->n != 11) { fprintf(stderr, "registration failed\n"); return 3; }
  long iters = atol(argv[2]), ok = 0, refused = 0, wrong = 0;
  for (long it = 0; it < iters; it++) {
    int d = (int)rnd(11), nz = (int)rnd(2), cumsum = (int)rnd(2), es = elem_size(TYPES[d]);
    Op* op = g_domain->ops[d];
    Info info = {rnd(10) ? (nz ? "PA_NZ" : "Norm") : "bogus", rnd(10) ? cumsum : (rnd(2) ? 7 : -1)};
    if (info.cumsum < 0) cumsum = 1; /* absent: default */
    void* kernel = NULL;
    Status* st = ((Status * (*)(void*, const void*, const Info*, void**)) op->f[16])(op, g_table, &info, &kernel);
    if (st) { ReleaseStatus(st); refused++; continue; }
    if (strcmp(info.mode, "bogus") == 0 || (info.cumsum != 0 && info.cumsum != 1 && info.cumsum != -1)) { wrong++; }
    int64_t nb = rnd(6), bs = 1 + rnd(5), Q = rnd(4), cols = rnd(5), e = 32 / es;
    int64_t kd[4], vd[4];
    if (!nz) { int64_t k[4] = {nb, bs, 1 + rnd(2), rnd(4)}, v[4] = {nb, bs, 1 + rnd(2), 1 + rnd(3)}; memcpy(kd, k, 32); memcpy(vd, v, 32); }
    else { int64_t k[4] = {nb, 1 + rnd(2), bs, e}, v[4] = {nb, 1 + rnd(2), bs, e}; memcpy(kd, k, 32); memcpy(vd, v, 32); }
    if (!rnd(15)) kd[3] += 1;                     /* wrong NZ dim / shape */
    if (!rnd(15)) vd[0] = nb + 1;                 /* value num_blocks mismatch */
    int it32 = (int)rnd(2) ? 7 : 6;
    Ctx c; memset(&c, 0, sizeof(c));
    c.in[0] = make(TYPES[d], !rnd(20) ? 3 : 4, kd);
    c.in[1] = make(rnd(25) ? TYPES[d] : 1, 4, vd);
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
      for (int64_t i = 0; i < n; i++) put(c.in[4], i, rnd(10) ? bs * rnd(2) : rnd(5) - 2); }
    st = ((Status * (*)(void*, Ctx*)) op->f[17])(kernel, &c);
    if (st) { refused++; ReleaseStatus(st); }
    else if (check(&c, nz, cumsum)) { wrong++; fprintf(stderr, "iteration %ld: output differs\n", it); }
    else ok++;
    ((void (*)(void*))op->f[8])(kernel);
    for (int i = 0; i < 5; i++) if (c.in[i]) { free(c.in[i]->data); free(c.in[i]); }
    for (int i = 0; i < 2; i++) free(c.out[i].data);
  }
  /* The direct entry point with a bad plan is refused, not executed. */
  int (*plan)(int, int64_t, int64_t, const void*, const void*, int64_t, int64_t, void*, void*, int64_t, int64_t,
              const int64_t*, const int64_t*, const int64_t*, const int64_t*, int64_t, char*, size_t) = dlsym(lib, "pakv_gather_plan");
  int64_t table[2] = {0, 5}, lens[1] = {4}, starts[1] = {0}, colst[1] = {0};
  char kcache[2 * 2 * 8], out[4 * 8], err[256];
  if (plan(0, 2, 2, kcache, kcache, 8, 8, out, out, 1, 2, table, lens, starts, colst, 4, err, sizeof err) == 0 ||
      !strstr(err, "block_tables[0, 1] = 5")) { fprintf(stderr, "bad plan accepted: %s\n", err); wrong++; }
  free(g_domain);
  printf("ok=%ld refused=%ld wrong=%ld\n", ok, refused, wrong);
  return wrong ? 1 : (ok > 0 && refused > 0 ? 0 : 4);
}
