/* The contract's validator (see pakv_contract.h for the rules and their order). Every message a
 * caller of the op can see for a broken contract is formatted here, once. */
#include "pakv_contract.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pakv_dtypes.h"

static const char* const GATHER_NAMES[PAKV_GATHER_RECORDS] = {
    "key_cache", "value_cache", "block_tables", "seq_lens", "seq_offset", "key_out", "value_out"};

/* ------------------------------------------------------------------------------------------- */
/* Records                                                                                     */
/* ------------------------------------------------------------------------------------------- */
/* ONNX TensorProto element type names (onnx.proto3 numbering), spelled as torch spells them. */
static const char* const ONNX_TYPE_NAMES[] = {
    "undefined", "float32",  "uint8",         "int8",          "uint16",      "int16",
    "int32",     "int64",    "string",        "bool",          "float16",     "float64",
    "uint32",    "uint64",   "complex64",     "complex128",    "bfloat16",    "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "uint4", "int4", "float4_e2m1"};

static const char* type_name(int onnx_type) {
  int count = (int)(sizeof(ONNX_TYPE_NAMES) / sizeof(ONNX_TYPE_NAMES[0]));
  if (onnx_type <= 0 || onnx_type >= count) return "(a type with no ONNX element type)";
  return ONNX_TYPE_NAMES[onnx_type];
}

static int is_index_type(int t) { return t == PAKV_ONNX_INT32 || t == PAKV_ONNX_INT64; }

static int index_itemsize(int t) { return t == PAKV_ONNX_INT64 ? 8 : 4; }

/* "[6, 4, 16]" (or "rank N" past PAKV_MAX_RANK), into buf. */
static const char* format_list(const int64_t* values, int32_t n, char* buf, size_t size) {
  if (n < 0 || n > PAKV_MAX_RANK) {
    snprintf(buf, size, "rank %d", (int)n);
    return buf;
  }
  size_t at = (size_t)snprintf(buf, size, "[");
  for (int32_t i = 0; i < n && at < size; i++)
    at += (size_t)snprintf(buf + at, size - at, i ? ", %lld" : "%lld", (long long)values[i]);
  if (at < size) snprintf(buf + at, size - at, "]");
  return buf;
}

#define SHAPE(t, buf) format_list((t)->dims, (t)->ndim, buf, sizeof(buf))
#define STRIDES(t, buf) format_list((t)->strides, (t)->ndim, buf, sizeof(buf))

static int require_rank(const pakv_tensor* t, const char* name, int rank, const char* form, pakv_err* err) {
  char shape[160];
  if (t->ndim == rank) return 0;
  return pakv_fail(err, "%s must have rank %d (%s), got shape %s", name, rank, form, SHAPE(t, shape));
}

static int record_ok(const pakv_tensor* t, const char* name, pakv_err* err) {
  int32_t kept = t->ndim < PAKV_MAX_RANK ? t->ndim : PAKV_MAX_RANK;
  if (t->ndim < 0) return pakv_fail(err, "%s has a negative rank %d", name, (int)t->ndim);
  for (int32_t d = 0; d < kept; d++) {
    if (t->dims[d] < 0) return pakv_fail(err, "%s has a negative dimension %lld", name, (long long)t->dims[d]);
    if (t->strides[d] < 0) return pakv_fail(err, "%s has a negative stride %lld", name, (long long)t->strides[d]);
  }
  return 0;
}

static int has_elements(const pakv_tensor* t) {
  for (int32_t d = 0; d < t->ndim && d < PAKV_MAX_RANK; d++)
    if (t->dims[d] == 0) return 0;
  return 1;
}

/* [first, end) of the bytes a record may touch; 0 when it has no elements (or cannot be sized). */
static int byte_extent(const pakv_tensor* t, int itemsize, uintptr_t* first, uintptr_t* end) {
  int64_t span = 0, term;
  if (!t->present || t->ndim > PAKV_MAX_RANK || !has_elements(t)) return 0;
  for (int32_t d = 0; d < t->ndim; d++)
    if (pakv_mul(t->dims[d] - 1, t->strides[d], &term) || pakv_add(span, term, &span)) return 0;
  if (pakv_add(span, 1, &span) || pakv_mul(span, itemsize, &span)) return 0;
  *first = (uintptr_t)t->data;
  *end = *first + (uintptr_t)span;
  return 1;
}

static int element_size(int onnx_type) {
  int d = pakv_dtype_index(onnx_type);
  if (d >= 0) return PAKV_CACHE_DTYPES[d].itemsize;
  return is_index_type(onnx_type) ? index_itemsize(onnx_type) : 1;
}

/* Entry i of a vector record readable on the host. */
static inline int64_t vector_at(const pakv_tensor* t, int64_t i) {
  const char* at = (const char*)t->host_data + i * t->strides[0] * index_itemsize(t->elem_type);
  return t->elem_type == PAKV_ONNX_INT64 ? *(const int64_t*)at : (int64_t) * (const int32_t*)at;
}

void pakv_dense_record(pakv_tensor* t, const void* data, int elem_type, int ndim, const int64_t* dims,
                       const char* device) {
  memset(t, 0, sizeof(*t));
  t->data = data;
  t->present = 1;
  t->elem_type = elem_type;
  t->ndim = ndim;
  snprintf(t->device, sizeof(t->device), "%s", device);
  int64_t stride = 1;
  for (int d = (ndim < PAKV_MAX_RANK ? ndim : PAKV_MAX_RANK) - 1; d >= 0; d--) {
    t->dims[d] = dims[d];
    t->strides[d] = stride;
    /* A tensor with elements fits memory, so its strides fit int64; a zero-element one's strides
     * are never used (saturate instead of overflowing). */
    if (dims[d] > 1 && pakv_mul(stride, dims[d], &stride)) stride = INT64_MAX;
  }
}

/* ------------------------------------------------------------------------------------------- */
/* Caches                                                                                      */
/* ------------------------------------------------------------------------------------------- */
typedef struct {
  int itemsize;
  int64_t num_blocks, block_size, row_bytes, block_bytes, block_stride;
  int64_t token_dims[2]; /* Norm (H, D); PA_NZ (H*D, unused) */
} cache_geometry;

static int require_present(const pakv_tensor* t, const char* name, pakv_err* err) {
  return t->present ? 0 : pakv_fail(err, "%s is required", name);
}

static int cache_dtype(const pakv_tensor* t, const char* name, pakv_err* err) {
  if (require_present(t, name, err)) return -1;
  if (pakv_dtype_index(t->elem_type) >= 0) return 0;
  char allowed[256];
  size_t at = 0;
  for (int i = 0; i < PAKV_NUM_DTYPES && at < sizeof(allowed); i++)
    at += (size_t)snprintf(allowed + at, sizeof(allowed) - at, i ? ", %s" : "%s", PAKV_CACHE_DTYPES[i].name);
  return pakv_fail_type(err, "%s dtype %s is not in the contract (allowed: %s)", name, type_name(t->elem_type),
                        allowed);
}

static int cache_shape(const pakv_tensor* t, const char* name, int nz, cache_geometry* g, pakv_err* err) {
  char shape[160];
  const char* layout =
      nz ? "PA_NZ: [num_blocks, heads*head_dim // E, block_size, E]" : "Norm: [num_blocks, block_size, heads, head_dim]";
  if (require_rank(t, name, 4, layout, err)) return -1;
  g->itemsize = PAKV_CACHE_DTYPES[pakv_dtype_index(t->elem_type)].itemsize;
  g->num_blocks = t->dims[0];
  /* One token's row: Norm dims 2 x 3 (H x D), PA_NZ dims 1 x 3 (H*D/E fractals x E). */
  int row_dim = nz ? 1 : 2;
  if (nz) {
    int64_t e = PAKV_NZ_FRACTAL_BYTES / g->itemsize;
    if (t->dims[3] != e)
      return pakv_fail(err, "%s: PA_NZ last dim must be 32 bytes / element size = %lld for %s, got %lld (shape %s)",
                       name, (long long)e, type_name(t->elem_type), (long long)t->dims[3], SHAPE(t, shape));
  }
  g->block_size = t->dims[nz ? 2 : 1];
  int64_t elements;
  if (pakv_mul(t->dims[row_dim], t->dims[3], &elements) || pakv_mul(elements, g->itemsize, &g->row_bytes))
    return pakv_fail(err, "%s: bytes per token (%lld x %lld x %d) overflow int64", name, (long long)t->dims[row_dim],
                     (long long)t->dims[3], g->itemsize);
  g->token_dims[0] = nz ? elements : t->dims[2];
  g->token_dims[1] = nz ? 0 : t->dims[3];
  if (pakv_mul(g->row_bytes, g->block_size, &g->block_bytes))
    return pakv_fail(err, "%s: one block of %lld tokens x %lld bytes overflows int64", name,
                     (long long)g->block_size, (long long)g->row_bytes);
  return 0;
}

/* Each block row-major contiguous (dims 1..3; size-1 dims may have any stride); the block axis
 * any stride >= 0 whose extent (num_blocks - 1) * stride + one block fits int64. */
static int cache_layout(const pakv_tensor* t, const char* name, cache_geometry* g, pakv_err* err) {
  char shape[160], strides[160];
  g->block_stride = g->block_bytes;
  if (!has_elements(t)) return 0;
  int64_t expected = 1;
  for (int d = 3; d >= 1; d--) {
    if (t->dims[d] != 1 && t->strides[d] != expected)
      return pakv_fail(err,
                       "%s must be row-major contiguous within each block (only dim 0, the block axis, may be "
                       "strided, as in pool[:, 0] of a [num_blocks, 2, ...] pool); got strides %s for shape %s: "
                       "pass %s.contiguous() (a copy of the whole cache)",
                       name, STRIDES(t, strides), SHAPE(t, shape), name);
    expected *= t->dims[d];
  }
  if (g->num_blocks <= 1) return 0; /* one block: its stride is never used */
  int64_t extent;
  if (pakv_mul(t->strides[0], g->itemsize, &g->block_stride) ||
      pakv_mul(g->block_stride, g->num_blocks - 1, &extent) || pakv_add(extent, g->block_bytes, &extent))
    return pakv_fail(err, "%s: %lld blocks of stride %lld elements overflow int64 byte offsets", name,
                     (long long)g->num_blocks, (long long)t->strides[0]);
  return 0;
}

static int check_caches(const pakv_tensor* kc, const pakv_tensor* vc, int nz, cache_geometry* k, cache_geometry* v,
                        pakv_err* err) {
  if (cache_dtype(kc, "key_cache", err) || cache_dtype(vc, "value_cache", err)) return -1;
  if (strncmp(kc->device, vc->device, PAKV_DEVICE_LEN) != 0)
    return pakv_fail(err, "value_cache is on %.24s but key_cache is on %.24s", vc->device, kc->device);
  if (cache_shape(kc, "key_cache", nz, k, err) || cache_shape(vc, "value_cache", nz, v, err)) return -1;
  if (v->num_blocks != k->num_blocks || v->block_size != k->block_size)
    return pakv_fail(err, "value_cache num_blocks/block_size (%lld, %lld) must equal key_cache's (%lld, %lld)",
                     (long long)v->num_blocks, (long long)v->block_size, (long long)k->num_blocks,
                     (long long)k->block_size);
  if (k->block_size < 1) return pakv_fail(err, "key_cache block_size must be >= 1, got %lld", (long long)k->block_size);
  if (cache_layout(kc, "key_cache", k, err) || cache_layout(vc, "value_cache", v, err)) return -1;
  return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* Index tensors                                                                               */
/* ------------------------------------------------------------------------------------------- */
static int index_record(const pakv_tensor* t, const char* name, int rank, const char* form, pakv_err* err) {
  if (require_present(t, name, err)) return -1;
  if (!is_index_type(t->elem_type))
    return pakv_fail_type(err, "%s must be int32 or int64, got %s", name, type_name(t->elem_type));
  if (require_rank(t, name, rank, form, err)) return -1;
  if (has_elements(t) && !t->host_data)
    return pakv_fail(err, "%s: its data is not readable on the host (index tensors are read there)", name);
  return 0;
}

static int check_indices(const pakv_tensor* t, int cumsum, pakv_err* err) {
  const pakv_tensor *bt = &t[PAKV_GATHER_BLOCK_TABLES], *sl = &t[PAKV_GATHER_SEQ_LENS], *so = &t[PAKV_GATHER_SEQ_OFFSET];
  char shape[160];
  if (index_record(bt, "block_tables", 2, "[Q, max_blocks_per_seq]", err)) return -1;
  if (index_record(sl, "seq_lens", 1, "a vector", err)) return -1;
  int64_t Q = bt->dims[0], expected = Q;
  if (cumsum && pakv_add(Q, 1, &expected))
    return pakv_fail(err, "block_tables has %lld rows: Q+1 (seq_lens entries) overflows int64", (long long)Q);
  if (sl->dims[0] != expected)
    return pakv_fail(err, "seq_lens must have %s = %lld entries for block_tables with Q = %lld rows, got shape %s",
                     cumsum ? "Q+1 (cumsum)" : "Q (lengths)", (long long)expected, (long long)Q, SHAPE(sl, shape));
  if (so->present) {
    if (index_record(so, "seq_offset", 1, "a vector", err)) return -1;
    if (so->dims[0] != Q)
      return pakv_fail(err, "seq_offset must have Q = %lld entries, got shape %s", (long long)Q, SHAPE(so, shape));
  }
  return 0;
}

/* Per-sequence lengths and output starts from seq_lens (each entry read once: a snapshot). */
static int read_lengths(const pakv_tensor* sl, int cumsum, int64_t Q, int64_t* lengths, int64_t* starts,
                        int64_t* total_out, pakv_err* err) {
  int64_t total = 0;
  if (cumsum) {
    int64_t a = vector_at(sl, 0);
    if (a != 0) return pakv_fail(err, "seq_lens (cumsum) must start at 0, got seq_lens[0] = %lld", (long long)a);
    for (int64_t q = 0; q < Q; q++) {
      int64_t b = vector_at(sl, q + 1);
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
      int64_t n = vector_at(sl, q);
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

/* First block-table column of each sequence: the FLOOR RULE, seq_offset[q] // block_size. */
static int read_col_starts(const pakv_tensor* so, int64_t Q, int64_t bs, int64_t* cols0, pakv_err* err) {
  for (int64_t q = 0; q < Q; q++) {
    int64_t off = so->present ? vector_at(so, q) : 0;
    if (off < 0)
      return pakv_fail(err, "seq_offset must be non-negative, got seq_offset[%lld] = %lld", (long long)q,
                       (long long)off);
    cols0[q] = off / bs; /* any offset; the remainder is ignored */
  }
  return 0;
}

static inline int64_t table_at(const pakv_tensor* bt, int64_t q, int64_t c) {
  const char* at = (const char*)bt->host_data + (q * bt->strides[0] + c * bt->strides[1]) * index_itemsize(bt->elem_type);
  return bt->elem_type == PAKV_ONNX_INT64 ? *(const int64_t*)at : (int64_t) * (const int32_t*)at;
}

/* Every row long enough for its sequence (all rows first), then every used id in range. */
static int check_tables(const pakv_tensor* bt, int64_t Q, int64_t bs, int64_t nb, const int64_t* lengths,
                        const int64_t* cols0, pakv_err* err) {
  int64_t cols = bt->dims[1];
  for (int64_t q = 0; q < Q; q++) {
    int64_t need = lengths[q] / bs + (lengths[q] % bs != 0); /* ceil without forming len + bs - 1 */
    if (need > cols - cols0[q])
      return pakv_fail(err,
                       "block_tables row %lld is too short: sequence %lld has %lld tokens = %lld blocks of %lld "
                       "starting at column %lld (seq_offset), but block_tables has %lld columns",
                       (long long)q, (long long)q, (long long)lengths[q], (long long)need, (long long)bs,
                       (long long)cols0[q], (long long)cols);
  }
  for (int64_t q = 0; q < Q; q++) {
    int64_t need = lengths[q] / bs + (lengths[q] % bs != 0);
    for (int64_t c = cols0[q]; c < cols0[q] + need; c++) {
      int64_t b = table_at(bt, q, c);
      if (b < 0 || b >= nb)
        return pakv_fail(err,
                         "block_tables[%lld, %lld] = %lld is outside [0, %lld) (num_blocks of key_cache); it is "
                         "used by sequence %lld",
                         (long long)q, (long long)c, (long long)b, (long long)nb, (long long)q);
    }
  }
  return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* Outputs                                                                                     */
/* ------------------------------------------------------------------------------------------- */
static int same_dtype(const pakv_tensor* t, const char* name, const pakv_tensor* cache, const char* cache_name,
                      pakv_err* err) {
  if (t->elem_type == cache->elem_type) return 0;
  return pakv_fail_type(err, "%s must have %s's dtype %s, got %s", name, cache_name, type_name(cache->elem_type),
                        type_name(t->elem_type));
}

static int same_device(const pakv_tensor* t, const char* name, const pakv_tensor* cache, pakv_err* err) {
  if (strncmp(t->device, cache->device, PAKV_DEVICE_LEN) == 0) return 0;
  return pakv_fail(err, "%s must be on the caches' device %.24s, got %.24s", name, cache->device, t->device);
}

/* An output (dense, of its cache's dtype and device) of the given dims. */
static int output_record(const pakv_tensor* t, const char* name, const pakv_tensor* cache, const char* cache_name,
                         const int64_t* dims, int32_t rank, pakv_err* err) {
  char want[160], got[160], strides[160];
  int same = t->ndim == rank;
  for (int32_t d = 0; same && d < rank; d++) same = t->dims[d] == dims[d];
  if (!same)
    return pakv_fail(err, "%s must have shape %s, got %s", name, format_list(dims, rank, want, sizeof(want)),
                     SHAPE(t, got));
  if (same_dtype(t, name, cache, cache_name, err) || same_device(t, name, cache, err)) return -1;
  int64_t expected = 1;
  for (int32_t d = rank - 1; d >= 0 && has_elements(t); d--) {
    if (t->dims[d] != 1 && t->strides[d] != expected)
      return pakv_fail(err, "%s must be contiguous (row-major); got strides %s for shape %s: pass %s.contiguous()",
                       name, STRIDES(t, strides), SHAPE(t, got), name);
    expected *= t->dims[d];
  }
  return 0;
}

static int overlaps(const pakv_tensor* a, const pakv_tensor* b) {
  uintptr_t a0, a1, b0, b1;
  if (!byte_extent(a, element_size(a->elem_type), &a0, &a1) || !byte_extent(b, element_size(b->elem_type), &b0, &b1))
    return 0;
  return a0 < b1 && b0 < a1 && strncmp(a->device, b->device, PAKV_DEVICE_LEN) == 0;
}

/* Output t[which] overlaps none of the inputs t[0 .. inputs), except that it may be exactly input
 * `in_place` (the same buffer: an in-place update; -1: none may). */
static int output_apart(const pakv_tensor* t, const char* const* names, int which, int inputs, int in_place,
                        pakv_err* err) {
  for (int in = 0; in < inputs; in++) {
    if (!t[which].present || !overlaps(&t[which], &t[in])) continue;
    if (in == in_place) {
      uintptr_t a0 = 0, a1 = 0, b0 = 1, b1 = 1; /* overlaps() said both have extents */
      byte_extent(&t[which], element_size(t[which].elem_type), &a0, &a1);
      byte_extent(&t[in], element_size(t[in].elem_type), &b0, &b1);
      if (a0 == b0 && a1 == b1) continue; /* the input itself: updated in place */
      return pakv_fail(err, "%s overlaps %s but is not the same buffer: pass %s itself (in place) or a separate tensor",
                       names[which], names[in], names[in]);
    }
    return pakv_fail(err, "%s overlaps %s in memory: an output must not share bytes with any input", names[which],
                     names[in]);
  }
  return 0;
}

/* The two outputs t[inputs], t[inputs + 1] overlap neither each other nor any input, except that
 * output i may be exactly its input in_place[i] (the same buffer: an in-place update). */
static int outputs_apart(const pakv_tensor* t, const char* const* names, int inputs, const int* in_place,
                         pakv_err* err) {
  const pakv_tensor *first = &t[inputs], *second = &t[inputs + 1];
  if (first->present && overlaps(first, second))
    return pakv_fail(err, "%s and %s overlap in memory; pass two separate tensors", names[inputs], names[inputs + 1]);
  for (int which = inputs; which <= inputs + 1; which++)
    if (output_apart(t, names, which, inputs, in_place ? in_place[which - inputs] : -1, err)) return -1;
  return 0;
}

int pakv_validate_gather_outputs(const pakv_tensor t[PAKV_GATHER_RECORDS], const pakv_plan* plan, pakv_err* err) {
  for (int which = PAKV_GATHER_KEY_OUT; which <= PAKV_GATHER_VALUE_OUT; which++) {
    const pakv_tensor* out = &t[which];
    if (!out->present) continue;
    if (record_ok(out, GATHER_NAMES[which], err)) return -1;
    const int64_t* dims = which == PAKV_GATHER_KEY_OUT ? plan->key_out_dims : plan->value_out_dims;
    int cache = which - PAKV_GATHER_KEY_OUT;
    if (output_record(out, GATHER_NAMES[which], &t[cache], GATHER_NAMES[cache], dims, plan->out_rank, err)) return -1;
  }
  return outputs_apart(t, GATHER_NAMES, PAKV_GATHER_INPUTS, NULL, err);
}

/* ------------------------------------------------------------------------------------------- */
/* The gather                                                                                  */
/* ------------------------------------------------------------------------------------------- */
int64_t pakv_gather_scratch_len(const pakv_tensor t[PAKV_GATHER_RECORDS]) {
  const pakv_tensor* bt = &t[PAKV_GATHER_BLOCK_TABLES];
  int64_t len;
  if (!bt->present || bt->ndim != 2 || bt->dims[0] < 0) return 0;
  return pakv_mul(bt->dims[0], 3, &len) ? -1 : len;
}

int pakv_validate_gather(const pakv_tensor t[PAKV_GATHER_RECORDS], int nz, int cumsum, pakv_plan* plan,
                         int64_t* scratch, int64_t scratch_len, pakv_err* err) {
  cache_geometry k, v;
  for (int i = 0; i < PAKV_GATHER_INPUTS; i++)
    if (t[i].present && record_ok(&t[i], GATHER_NAMES[i], err)) return -1;
  if (check_caches(&t[PAKV_GATHER_KEY_CACHE], &t[PAKV_GATHER_VALUE_CACHE], nz, &k, &v, err) ||
      check_indices(t, cumsum, err))
    return -1;
  const pakv_tensor* bt = &t[PAKV_GATHER_BLOCK_TABLES];
  int64_t Q = bt->dims[0], total = 0, needed = pakv_gather_scratch_len(t);
  if (needed < 0 || scratch_len < needed || (needed > 0 && !scratch))
    return pakv_fail(err, "block_tables has %lld rows: no memory for the plan's 3 x %lld index entries",
                     (long long)Q, (long long)Q);
  int64_t *lengths = scratch, *starts = scratch + Q, *cols0 = scratch + 2 * Q;
  if (read_lengths(&t[PAKV_GATHER_SEQ_LENS], cumsum, Q, lengths, starts, &total, err)) return -1;
  if (read_col_starts(&t[PAKV_GATHER_SEQ_OFFSET], Q, k.block_size, cols0, err)) return -1;
  if (check_tables(bt, Q, k.block_size, k.num_blocks, lengths, cols0, err)) return -1;
  int64_t key_bytes, value_bytes, both;
  for (int which = 0; which < 2; which++) {
    int64_t row = which ? v.row_bytes : k.row_bytes;
    if (pakv_mul(total, row, which ? &value_bytes : &key_bytes))
      return pakv_fail(err, "%s output of %lld tokens x %lld bytes overflows int64 byte offsets",
                       which ? "value" : "key", (long long)total, (long long)row);
  }
  if (pakv_add(key_bytes, value_bytes, &both))
    return pakv_fail(err, "key and value outputs of %lld tokens (%lld + %lld bytes) overflow int64 byte offsets",
                     (long long)total, (long long)key_bytes, (long long)value_bytes);

  memset(plan, 0, sizeof(*plan));
  plan->abi_version = PAKV_ABI_VERSION;
  plan->struct_size = sizeof(pakv_plan);
  plan->layout = nz ? PAKV_LAYOUT_NZ : PAKV_LAYOUT_NORM;
  plan->tables64 = bt->elem_type == PAKV_ONNX_INT64;
  plan->num_blocks = k.num_blocks;
  plan->block_size = k.block_size;
  plan->key_cache = t[PAKV_GATHER_KEY_CACHE].data;
  plan->value_cache = t[PAKV_GATHER_VALUE_CACHE].data;
  plan->key_block_stride = k.block_stride;
  plan->value_block_stride = v.block_stride;
  plan->key_row_bytes = k.row_bytes;
  plan->value_row_bytes = v.row_bytes;
  plan->num_seqs = Q;
  plan->table_cols = bt->dims[1];
  plan->block_tables = bt->host_data;
  plan->table_row_stride = bt->strides[0] * index_itemsize(bt->elem_type);
  plan->table_col_stride = bt->strides[1] * index_itemsize(bt->elem_type);
  plan->seq_lengths = lengths;
  plan->out_starts = starts;
  plan->col_starts = cols0;
  plan->num_tokens = total;
  plan->out_rank = nz ? 2 : 3;
  plan->key_out_dims[0] = plan->value_out_dims[0] = total;
  plan->key_out_dims[1] = k.token_dims[0];
  plan->key_out_dims[2] = k.token_dims[1];
  plan->value_out_dims[1] = v.token_dims[0];
  plan->value_out_dims[2] = v.token_dims[1];
  if (pakv_validate_gather_outputs(t, plan, err)) return -1;
  plan->key_out = t[PAKV_GATHER_KEY_OUT].present ? (void*)t[PAKV_GATHER_KEY_OUT].data : NULL;
  plan->value_out = t[PAKV_GATHER_VALUE_OUT].present ? (void*)t[PAKV_GATHER_VALUE_OUT].data : NULL;
  return pakv_check_plan(plan, err); /* the copy core's memory-safety view of the same plan */
}

/* ------------------------------------------------------------------------------------------- */
/* The scatter                                                                                 */
/* ------------------------------------------------------------------------------------------- */
static const char* const SCATTER_NAMES[PAKV_SCATTER_RECORDS] = {
    "key", "value", "key_cache", "value_cache", "slot_mapping", "key_cache_out", "value_cache_out"};

/* A rank-3 [T, H, D] record whose tokens are each row-major (any token stride >= 0: a slice of a
 * fused QKV projection is fine); the token stride in bytes. */
static int token_layout(const pakv_tensor* t, const char* name, int itemsize, int64_t* token_stride, pakv_err* err) {
  char shape[160], strides[160];
  if (has_elements(t) && ((t->dims[2] != 1 && t->strides[2] != 1) || (t->dims[1] != 1 && t->strides[1] != t->dims[2])))
    return pakv_fail(err,
                     "%s must be row-major contiguous within each token (only dim 0, the token axis, may be "
                     "strided); got strides %s for shape %s: pass %s.contiguous()",
                     name, STRIDES(t, strides), SHAPE(t, shape), name);
  if (pakv_mul(t->strides[0], itemsize, token_stride))
    return pakv_fail(err, "%s: a token stride of %lld elements overflows int64 byte offsets", name,
                     (long long)t->strides[0]);
  return 0;
}

/* key / value: [T, H, D] of its cache's dtype and device, rows matching the cache's token row,
 * each token row-major (any token stride >= 0: a slice of a fused QKV projection is fine). */
static int scatter_source(const pakv_tensor* t, const char* name, const pakv_tensor* cache, const char* cache_name,
                          const cache_geometry* g, int nz, int64_t* token_stride, pakv_err* err) {
  char shape[160], cache_shape[160];
  if (require_present(t, name, err) || same_dtype(t, name, cache, cache_name, err) ||
      same_device(t, name, cache, err) || require_rank(t, name, 3, "[T, heads, head_dim]", err))
    return -1;
  int64_t width;
  if (pakv_mul(t->dims[1], t->dims[2], &width)) width = -1;
  if (!nz && (t->dims[1] != g->token_dims[0] || t->dims[2] != g->token_dims[1]))
    return pakv_fail(err, "%s rows must be [%lld, %lld] (heads, head_dim) for %s of shape %s, got shape %s", name,
                     (long long)g->token_dims[0], (long long)g->token_dims[1], cache_name, SHAPE(cache, cache_shape),
                     SHAPE(t, shape));
  if (nz && width != g->token_dims[0])
    return pakv_fail(err, "%s rows must hold heads x head_dim = %lld elements for %s of shape %s, got shape %s",
                     name, (long long)g->token_dims[0], cache_name, SHAPE(cache, cache_shape), SHAPE(t, shape));
  return token_layout(t, name, g->itemsize, token_stride, err);
}

/* Blocks of a cache a scatter writes never overlap each other (a stride below one block would
 * make two slots one), the two caches share no bytes (pool views side by side in one pool are
 * fine), and the rows read overlap neither cache. */
static int scatter_targets_apart(const pakv_tensor* t, const cache_geometry* k, const cache_geometry* v,
                                 pakv_err* err) {
  const pakv_tensor *kc = &t[PAKV_SCATTER_KEY_CACHE], *vc = &t[PAKV_SCATTER_VALUE_CACHE];
  const cache_geometry* g[2] = {k, v};
  for (int i = 0; i < 2; i++)
    if (g[i]->num_blocks > 1 && g[i]->block_stride < g[i]->block_bytes && g[i]->block_bytes > 0)
      return pakv_fail(err,
                       "%s: block stride %lld bytes is less than one block (%lld bytes): its blocks overlap, and a "
                       "scatter would write one slot's bytes for another",
                       SCATTER_NAMES[PAKV_SCATTER_KEY_CACHE + i], (long long)g[i]->block_stride,
                       (long long)g[i]->block_bytes);
  int apart = !overlaps(kc, vc);
  if (!apart && k->block_stride == v->block_stride && k->num_blocks > 1) {
    /* Interleaved views of one pool: apart when value's blocks sit in the gaps between key's. */
    uintptr_t kb = (uintptr_t)kc->data, vb = (uintptr_t)vc->data, stride = (uintptr_t)k->block_stride;
    uintptr_t d = (vb >= kb ? vb - kb : stride - (kb - vb) % stride) % stride;
    apart = d >= (uintptr_t)k->block_bytes && stride - d >= (uintptr_t)v->block_bytes;
  }
  if (!apart && k->row_bytes > 0 && v->row_bytes > 0)
    return pakv_fail(err, "key_cache and value_cache share bytes: a scatter would write one into the other");
  for (int src = PAKV_SCATTER_KEY; src <= PAKV_SCATTER_VALUE; src++)
    for (int cache = PAKV_SCATTER_KEY_CACHE; cache <= PAKV_SCATTER_VALUE_CACHE; cache++)
      if (overlaps(&t[src], &t[cache]))
        return pakv_fail(err, "%s overlaps %s in memory: the rows a scatter reads must not share bytes with a cache",
                         SCATTER_NAMES[src], SCATTER_NAMES[cache]);
  return 0;
}

typedef struct {
  int64_t slot, token;
} slot_entry;

static int by_slot_then_token(const void* a, const void* b) {
  const slot_entry *x = (const slot_entry*)a, *y = (const slot_entry*)b;
  if (x->slot != y->slot) return x->slot < y->slot ? -1 : 1;
  return x->token < y->token ? -1 : x->token > y->token;
}

/* Every slot < capacity (negative: padding), no slot twice: the first token (in token order) that
 * repeats an earlier token's slot is named. `pairs` holds T entries. */
static int check_slots(const pakv_tensor* sm, int64_t T, int64_t capacity, slot_entry* pairs, pakv_err* err) {
  int64_t n = 0;
  for (int64_t t = 0; t < T; t++) {
    int64_t s = vector_at(sm, t);
    if (s >= capacity)
      return pakv_fail(err,
                       "slot_mapping[%lld] = %lld is outside [0, %lld) (num_blocks x block_size of key_cache; a "
                       "negative slot is padding)",
                       (long long)t, (long long)s, (long long)capacity);
    if (s >= 0) pairs[n++] = (slot_entry){s, t};
  }
  qsort(pairs, (size_t)n, sizeof(slot_entry), by_slot_then_token);
  /* Sorted by (slot, token): in each run of one slot the first two entries are its earliest token
   * and the first token repeating it; the repeat with the smallest token is the one named. */
  int64_t repeat = -1, first = -1;
  for (int64_t i = 1; i < n; i++)
    if (pairs[i].slot == pairs[i - 1].slot && (i < 2 || pairs[i - 2].slot != pairs[i].slot) &&
        (repeat < 0 || pairs[i].token < repeat)) {
      repeat = pairs[i].token;
      first = pairs[i - 1].token;
    }
  if (repeat >= 0)
    return pakv_fail(err, "slot_mapping[%lld] = %lld repeats slot_mapping[%lld]: two tokens cannot write one slot",
                     (long long)repeat, (long long)vector_at(sm, repeat), (long long)first);
  return 0;
}

int pakv_validate_scatter_outputs(const pakv_tensor t[PAKV_SCATTER_RECORDS], pakv_err* err) {
  static const int in_place[2] = {PAKV_SCATTER_KEY_CACHE, PAKV_SCATTER_VALUE_CACHE};
  for (int i = 0; i < 2; i++) {
    const pakv_tensor *out = &t[PAKV_SCATTER_KEY_CACHE_OUT + i], *cache = &t[in_place[i]];
    if (!out->present) continue;
    if (record_ok(out, SCATTER_NAMES[PAKV_SCATTER_KEY_CACHE_OUT + i], err) ||
        output_record(out, SCATTER_NAMES[PAKV_SCATTER_KEY_CACHE_OUT + i], cache, SCATTER_NAMES[in_place[i]],
                      cache->dims, 4, err))
      return -1;
  }
  return outputs_apart(t, SCATTER_NAMES, PAKV_SCATTER_INPUTS, in_place, err);
}

int64_t pakv_scatter_scratch_len(const pakv_tensor t[PAKV_SCATTER_RECORDS]) {
  const pakv_tensor* key = &t[PAKV_SCATTER_KEY];
  int64_t len;
  if (!key->present || key->ndim < 1 || key->ndim > PAKV_MAX_RANK || key->dims[0] < 0) return 0;
  return pakv_mul(key->dims[0], 2, &len) ? -1 : len;
}

int pakv_validate_scatter(const pakv_tensor t[PAKV_SCATTER_RECORDS], int nz, pakv_scatter_plan* plan,
                          int64_t* scratch, int64_t scratch_len, pakv_err* err) {
  cache_geometry k, v;
  char shape[160];
  for (int i = 0; i < PAKV_SCATTER_RECORDS; i++)
    if (t[i].present && record_ok(&t[i], SCATTER_NAMES[i], err)) return -1;
  const pakv_tensor *kc = &t[PAKV_SCATTER_KEY_CACHE], *vc = &t[PAKV_SCATTER_VALUE_CACHE];
  if (check_caches(kc, vc, nz, &k, &v, err)) return -1;
  int64_t key_stride, value_stride, capacity;
  if (scatter_source(&t[PAKV_SCATTER_KEY], "key", kc, "key_cache", &k, nz, &key_stride, err) ||
      scatter_source(&t[PAKV_SCATTER_VALUE], "value", vc, "value_cache", &v, nz, &value_stride, err))
    return -1;
  if (scatter_targets_apart(t, &k, &v, err)) return -1;
  int64_t T = t[PAKV_SCATTER_KEY].dims[0];
  if (t[PAKV_SCATTER_VALUE].dims[0] != T)
    return pakv_fail(err, "value must have T = %lld rows (key's), got shape %s", (long long)T,
                     SHAPE(&t[PAKV_SCATTER_VALUE], shape));
  const pakv_tensor* sm = &t[PAKV_SCATTER_SLOT_MAPPING];
  if (index_record(sm, "slot_mapping", 1, "a vector", err)) return -1;
  if (sm->dims[0] != T)
    return pakv_fail(err, "slot_mapping must have T = %lld entries (key's rows), got shape %s", (long long)T,
                     SHAPE(sm, shape));
  if (pakv_mul(k.num_blocks, k.block_size, &capacity))
    return pakv_fail(err, "key_cache: %lld blocks x %lld slots overflow int64", (long long)k.num_blocks,
                     (long long)k.block_size);
  int64_t needed = pakv_scatter_scratch_len(t);
  if (needed < 0 || scratch_len < needed || (needed > 0 && !scratch))
    return pakv_fail(err, "key has %lld rows: no memory for the plan's 2 x %lld check entries", (long long)T,
                     (long long)T);
  if (check_slots(sm, T, capacity, (slot_entry*)scratch, err)) return -1;
  if (pakv_validate_scatter_outputs(t, err)) return -1;

  memset(plan, 0, sizeof(*plan));
  plan->abi_version = PAKV_ABI_VERSION;
  plan->struct_size = sizeof(pakv_scatter_plan);
  plan->layout = nz ? PAKV_LAYOUT_NZ : PAKV_LAYOUT_NORM;
  plan->slots64 = sm->elem_type == PAKV_ONNX_INT64;
  plan->num_blocks = k.num_blocks;
  plan->block_size = k.block_size;
  plan->key_cache = (void*)kc->data;
  plan->value_cache = (void*)vc->data;
  plan->key_block_stride = k.block_stride;
  plan->value_block_stride = v.block_stride;
  plan->key_row_bytes = k.row_bytes;
  plan->value_row_bytes = v.row_bytes;
  plan->key = t[PAKV_SCATTER_KEY].data;
  plan->value = t[PAKV_SCATTER_VALUE].data;
  plan->key_token_stride = key_stride;
  plan->value_token_stride = value_stride;
  plan->num_tokens = T;
  plan->slot_mapping = sm->host_data;
  plan->slot_stride = sm->strides[0] * index_itemsize(sm->elem_type);
  return pakv_check_scatter_plan(plan, err);
}

/* ------------------------------------------------------------------------------------------- */
/* PagedAttention                                                                              */
/* ------------------------------------------------------------------------------------------- */
static const char* const ATTENTION_NAMES[PAKV_ATTENTION_RECORDS] = {
    "query", "key_cache", "value_cache", "block_table", "cumulative_sequence_lengths", "past_sequence_lengths",
    "output"};

enum { ONNX_FLOAT32 = 1, ONNX_FLOAT16 = 10, ONNX_BFLOAT16 = 16 };

/* 1 / sqrt(d) rounded to float, for d >= 1 (Newton's iteration in double: the library needs no libm).
 * It starts at x itself, which is >= sqrt(x) for every x >= 1: from above, Newton's steps decrease
 * until they reach sqrt(x), so the first step that does not decrease ends it. (A start at x / 2 is
 * below sqrt(x) for x < 4: the first step rose and stopped it at once, so head_dim 2 and 3 got a
 * scale of 1 and 2/3 instead of 1/sqrt(2) and 1/sqrt(3).) ~36 steps for d = 2^62. */
static float inverse_sqrt(int64_t d) {
  double x = (double)d, s = x > 1.0 ? x : 1.0;
  for (int i = 0; i < 200; i++) {
    double next = 0.5 * (s + x / s);
    if (next >= s) break; /* from above it decreases until it reaches sqrt(x) */
    s = next;
  }
  return (float)(1.0 / s);
}

/* [N, Hq, D] of a dtype attention computes in, on the caches' device, D = key_cache's head_dim, Hq a
 * multiple of key_cache's kv heads; every token row-major (any token stride). */
static int attention_query(const pakv_tensor* t, const cache_geometry* k, const cache_geometry* v, pakv_err* err) {
  const pakv_tensor *q = &t[PAKV_ATTENTION_QUERY], *kc = &t[PAKV_ATTENTION_KEY_CACHE];
  char shape[160], key_shape[160];
  if (same_device(q, "query", kc, err) || require_rank(q, "query", 3, "[num_tokens, heads, head_dim]", err)) return -1;
  if (q->dims[2] != k->token_dims[1])
    return pakv_fail(err, "query head_dim %lld must be key_cache's head_dim %lld (query shape %s, key_cache shape %s)",
                     (long long)q->dims[2], (long long)k->token_dims[1], SHAPE(q, shape), SHAPE(kc, key_shape));
  if (k->token_dims[0] < 1)
    return pakv_fail(err, "key_cache must have at least one (kv) head, got shape %s", SHAPE(kc, key_shape));
  if (v->token_dims[0] != k->token_dims[0])
    return pakv_fail(err, "value_cache must have key_cache's %lld kv heads, got shape %s", (long long)k->token_dims[0],
                     SHAPE(&t[PAKV_ATTENTION_VALUE_CACHE], shape));
  if (q->dims[1] % k->token_dims[0])
    return pakv_fail(err, "query's %lld heads must be a multiple of key_cache's %lld kv heads (GQA), query shape %s",
                     (long long)q->dims[1], (long long)k->token_dims[0], SHAPE(q, shape));
  return 0;
}

/* block_table [B, cols], cumulative_sequence_lengths [B+1], past_sequence_lengths [B]. */
static int attention_indices(const pakv_tensor* t, pakv_err* err) {
  const pakv_tensor *bt = &t[PAKV_ATTENTION_BLOCK_TABLE], *cu = &t[PAKV_ATTENTION_CU_SEQ_LENS],
                    *past = &t[PAKV_ATTENTION_PAST_LENS];
  char shape[160];
  if (index_record(bt, "block_table", 2, "[batch, max_blocks]", err) ||
      index_record(cu, "cumulative_sequence_lengths", 1, "a vector", err) ||
      index_record(past, "past_sequence_lengths", 1, "a vector", err))
    return -1;
  int64_t B = bt->dims[0], entries;
  if (pakv_add(B, 1, &entries) || cu->dims[0] != entries)
    return pakv_fail(err, "cumulative_sequence_lengths must have B+1 entries for block_table with B = %lld rows, got shape %s",
                     (long long)B, SHAPE(cu, shape));
  if (past->dims[0] != B)
    return pakv_fail(err, "past_sequence_lengths must have B = %lld entries (block_table's rows), got shape %s",
                     (long long)B, SHAPE(past, shape));
  return 0;
}

/* Per sequence: query start, new tokens and context (past + new) into `starts`, `counts`, `lengths`;
 * the lengths' rules; the table rows and block ids a sequence with new tokens reads. */
static int attention_sequences(const pakv_tensor* t, int64_t N, int64_t bs, int64_t nb, int64_t* starts,
                               int64_t* counts, int64_t* lengths, pakv_err* err) {
  const pakv_tensor *bt = &t[PAKV_ATTENTION_BLOCK_TABLE], *cu = &t[PAKV_ATTENTION_CU_SEQ_LENS],
                    *past = &t[PAKV_ATTENTION_PAST_LENS];
  int64_t B = bt->dims[0], cols = bt->dims[1], a = vector_at(cu, 0);
  if (a != 0)
    return pakv_fail(err, "cumulative_sequence_lengths must start at 0, got cumulative_sequence_lengths[0] = %lld",
                     (long long)a);
  for (int64_t b = 0; b < B; b++) { /* each entry read once: a snapshot */
    int64_t next = vector_at(cu, b + 1), before = vector_at(past, b);
    if (next < a)
      return pakv_fail(err,
                       "cumulative_sequence_lengths must be non-decreasing, got cumulative_sequence_lengths[%lld] = "
                       "%lld < cumulative_sequence_lengths[%lld] = %lld",
                       (long long)(b + 1), (long long)next, (long long)b, (long long)a);
    if (before < 0)
      return pakv_fail(err, "past_sequence_lengths must be non-negative, got past_sequence_lengths[%lld] = %lld",
                       (long long)b, (long long)before);
    starts[b] = a;
    counts[b] = next - a; /* 0 <= a <= next: no overflow */
    if (pakv_add(before, counts[b], &lengths[b]))
      return pakv_fail(err, "past_sequence_lengths[%lld] = %lld plus its %lld new tokens overflows int64", (long long)b,
                       (long long)before, (long long)counts[b]);
    a = next;
  }
  if (a != N)
    return pakv_fail(err, "cumulative_sequence_lengths must end at query's %lld tokens, got cumulative_sequence_lengths[%lld] = %lld",
                     (long long)N, (long long)B, (long long)a);
  for (int64_t b = 0; b < B; b++) { /* rows first, then ids (as the gather) */
    int64_t need = counts[b] ? lengths[b] / bs + (lengths[b] % bs != 0) : 0; /* no new token: nothing read */
    if (need > cols)
      return pakv_fail(err,
                       "block_table row %lld is too short: sequence %lld's context of %lld tokens (%lld past + %lld "
                       "new) needs %lld blocks of %lld, but block_table has %lld columns",
                       (long long)b, (long long)b, (long long)lengths[b], (long long)(lengths[b] - counts[b]),
                       (long long)counts[b], (long long)need, (long long)bs, (long long)cols);
  }
  for (int64_t b = 0; b < B; b++) {
    int64_t need = counts[b] ? lengths[b] / bs + (lengths[b] % bs != 0) : 0;
    for (int64_t c = 0; c < need; c++) {
      int64_t block = table_at(bt, b, c);
      if (block < 0 || block >= nb)
        return pakv_fail(err,
                         "block_table[%lld, %lld] = %lld is outside [0, %lld) (num_blocks of key_cache); sequence %lld "
                         "reads it (entries past a sequence's context may hold anything, e.g. -1)",
                         (long long)b, (long long)c, (long long)block, (long long)nb, (long long)b);
    }
  }
  return 0;
}

int64_t pakv_attention_scratch_len(const pakv_tensor t[PAKV_ATTENTION_RECORDS]) {
  const pakv_tensor* bt = &t[PAKV_ATTENTION_BLOCK_TABLE];
  int64_t len;
  if (!bt->present || bt->ndim != 2 || bt->dims[0] < 0) return 0;
  return pakv_mul(bt->dims[0], 3, &len) ? -1 : len;
}

int pakv_validate_attention_output(const pakv_tensor t[PAKV_ATTENTION_RECORDS], const pakv_attention_plan* plan,
                                   pakv_err* err) {
  const pakv_tensor* out = &t[PAKV_ATTENTION_OUT];
  int64_t dims[3] = {plan->num_tokens, plan->num_heads, plan->value_head_dim};
  if (!out->present) return 0;
  if (record_ok(out, "output", err) || output_record(out, "output", &t[PAKV_ATTENTION_QUERY], "query", dims, 3, err))
    return -1;
  return output_apart(t, ATTENTION_NAMES, PAKV_ATTENTION_OUT, PAKV_ATTENTION_INPUTS, -1, err);
}

int pakv_validate_attention(const pakv_tensor t[PAKV_ATTENTION_RECORDS], float scale, pakv_attention_plan* plan,
                            int64_t* scratch, int64_t scratch_len, pakv_err* err) {
  cache_geometry k, v;
  const pakv_tensor *q = &t[PAKV_ATTENTION_QUERY], *kc = &t[PAKV_ATTENTION_KEY_CACHE],
                    *vc = &t[PAKV_ATTENTION_VALUE_CACHE], *bt = &t[PAKV_ATTENTION_BLOCK_TABLE];
  for (int i = 0; i < PAKV_ATTENTION_INPUTS; i++)
    if (t[i].present && record_ok(&t[i], ATTENTION_NAMES[i], err)) return -1;
  if (require_present(q, "query", err)) return -1;
  if (q->elem_type != ONNX_FLOAT32 && q->elem_type != ONNX_FLOAT16 && q->elem_type != ONNX_BFLOAT16)
    return pakv_fail_type(err, "query dtype %s is not one PagedAttention computes in (float32, float16, bfloat16)",
                          type_name(q->elem_type));
  if (require_present(kc, "key_cache", err) || same_dtype(kc, "key_cache", q, "query", err) ||
      require_present(vc, "value_cache", err) || same_dtype(vc, "value_cache", q, "query", err))
    return -1;
  if (check_caches(kc, vc, 0, &k, &v, err) || attention_query(t, &k, &v, err)) return -1;
  int64_t query_stride;
  if (token_layout(q, "query", k.itemsize, &query_stride, err) || attention_indices(t, err)) return -1;
  if (!(scale > -3.4e38f && scale < 3.4e38f))
    return pakv_fail(err, "scale must be a finite float (0: 1 / sqrt(head_dim)), got %.9g", (double)scale);
  int64_t B = bt->dims[0], N = q->dims[0], out_bytes, needed = pakv_attention_scratch_len(t);
  if (needed < 0 || scratch_len < needed || (needed > 0 && !scratch))
    return pakv_fail(err, "block_table has %lld rows: no memory for the plan's 3 x %lld per-sequence entries",
                     (long long)B, (long long)B);
  int64_t *starts = scratch, *counts = scratch + B, *lengths = scratch + 2 * B;
  if (attention_sequences(t, N, k.block_size, k.num_blocks, starts, counts, lengths, err)) return -1;
  if (pakv_mul(N, q->dims[1], &out_bytes) || pakv_mul(out_bytes, v.token_dims[1], &out_bytes) ||
      pakv_mul(out_bytes, k.itemsize, &out_bytes))
    return pakv_fail(err, "an output of %lld tokens x %lld heads x %lld values overflows int64 byte offsets",
                     (long long)N, (long long)q->dims[1], (long long)v.token_dims[1]);

  memset(plan, 0, sizeof(*plan));
  plan->abi_version = PAKV_ABI_VERSION;
  plan->struct_size = sizeof(pakv_attention_plan);
  plan->elem_type = q->elem_type;
  plan->tables64 = bt->elem_type == PAKV_ONNX_INT64;
  plan->num_blocks = k.num_blocks;
  plan->block_size = k.block_size;
  plan->key_cache = kc->data;
  plan->value_cache = vc->data;
  plan->key_block_stride = k.block_stride;
  plan->value_block_stride = v.block_stride;
  plan->num_heads = q->dims[1];
  plan->num_kv_heads = k.token_dims[0];
  plan->head_dim = k.token_dims[1];
  plan->value_head_dim = v.token_dims[1];
  plan->query = q->data;
  plan->query_token_stride = query_stride;
  plan->num_tokens = N;
  plan->num_seqs = B;
  plan->table_cols = bt->dims[1];
  plan->block_tables = bt->host_data;
  plan->table_row_stride = bt->strides[0] * index_itemsize(bt->elem_type);
  plan->table_col_stride = bt->strides[1] * index_itemsize(bt->elem_type);
  plan->query_starts = starts;
  plan->query_counts = counts;
  plan->context_lens = lengths;
  plan->scale = scale != 0.0f ? scale : plan->head_dim > 0 ? inverse_sqrt(plan->head_dim) : 1.0f;
  if (pakv_validate_attention_output(t, plan, err)) return -1;
  plan->out = t[PAKV_ATTENTION_OUT].present ? (void*)t[PAKV_ATTENTION_OUT].data : NULL;
  return pakv_check_attention_plan(plan, err); /* the attention core's memory-safety view of the same plan */
}

/* ------------------------------------------------------------------------------------------- */
/* Exported entry points (pakv_onnx/validator.py): 0, or the error's kind with its message     */
/* ------------------------------------------------------------------------------------------- */
static int report(int rc, const pakv_err* err, char* err_out, size_t err_len) {
  if (!rc) return 0;
  if (err_out && err_len) snprintf(err_out, err_len, "%s", err->msg);
  return err->kind == PAKV_ERR_TYPE ? PAKV_ERR_TYPE : PAKV_ERR_VALUE;
}

PAKV_EXPORT int pakv_plan_gather(pakv_gather_call* call) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  if (!call) return PAKV_ERR_VALUE;
  int rc = pakv_validate_gather(call->records, call->nz != 0, call->cumsum != 0, &call->plan, call->scratch,
                                call->scratch_len, &err);
  return report(rc, &err, call->error, call->error ? PAKV_ERR_LEN : 0);
}

PAKV_EXPORT int pakv_check_gather_outputs(const pakv_gather_call* call) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  if (!call) return PAKV_ERR_VALUE;
  return report(pakv_validate_gather_outputs(call->records, &call->plan, &err), &err, call->error,
                call->error ? PAKV_ERR_LEN : 0);
}

PAKV_EXPORT size_t pakv_gather_call_size(void) { return sizeof(pakv_gather_call); }

PAKV_EXPORT size_t pakv_tensor_size(void) { return sizeof(pakv_tensor); }

PAKV_EXPORT int pakv_plan_scatter(pakv_scatter_call* call) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  if (!call) return PAKV_ERR_VALUE;
  int rc = pakv_validate_scatter(call->records, call->nz != 0, &call->plan, call->scratch, call->scratch_len, &err);
  return report(rc, &err, call->error, call->error ? PAKV_ERR_LEN : 0);
}

PAKV_EXPORT size_t pakv_scatter_call_size(void) { return sizeof(pakv_scatter_call); }

PAKV_EXPORT int pakv_plan_attention(pakv_attention_call* call) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  if (!call) return PAKV_ERR_VALUE;
  int rc = pakv_validate_attention(call->records, call->scale, &call->plan, call->scratch, call->scratch_len, &err);
  return report(rc, &err, call->error, call->error ? PAKV_ERR_LEN : 0);
}

PAKV_EXPORT int pakv_check_attention_output(const pakv_attention_call* call) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  if (!call) return PAKV_ERR_VALUE;
  return report(pakv_validate_attention_output(call->records, &call->plan, &err), &err, call->error,
                call->error ? PAKV_ERR_LEN : 0);
}

PAKV_EXPORT size_t pakv_attention_call_size(void) { return sizeof(pakv_attention_call); }
