/* What every op's validator reads a record with (pakv_contract_records.h): element types and their
 * names, shapes and extents, the caches' geometry, index tensors, the output rules, the report. */
#include "pakv_contract_records.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pakv_dtypes.h"

/* ------------------------------------------------------------------------------------------- */
/* Records                                                                                     */
/* ------------------------------------------------------------------------------------------- */
/* ONNX TensorProto element type names (onnx.proto3 numbering), spelled as torch spells them. */
static const char* const ONNX_TYPE_NAMES[] = {
    "undefined", "float32",  "uint8",         "int8",          "uint16",      "int16",
    "int32",     "int64",    "string",        "bool",          "float16",     "float64",
    "uint32",    "uint64",   "complex64",     "complex128",    "bfloat16",    "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "uint4", "int4", "float4_e2m1"};

const char* pakv_type_name(int onnx_type) {
  int count = (int)(sizeof(ONNX_TYPE_NAMES) / sizeof(ONNX_TYPE_NAMES[0]));
  if (onnx_type <= 0 || onnx_type >= count) return "(a type with no ONNX element type)";
  return ONNX_TYPE_NAMES[onnx_type];
}

/* "[6, 4, 16]" (or "rank N" past PAKV_MAX_RANK), into buf. */
const char* pakv_format_list(const int64_t* values, int32_t n, char* buf, size_t size) {
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

int pakv_require_rank(const pakv_tensor* t, const char* name, int rank, const char* form, pakv_err* err) {
  char shape[160];
  if (t->ndim == rank) return 0;
  return pakv_fail(err, "%s must have rank %d (%s), got shape %s", name, rank, form, SHAPE(t, shape));
}

int pakv_record_ok(const pakv_tensor* t, const char* name, pakv_err* err) {
  int32_t kept = t->ndim < PAKV_MAX_RANK ? t->ndim : PAKV_MAX_RANK;
  if (t->ndim < 0) return pakv_fail(err, "%s has a negative rank %d", name, (int)t->ndim);
  for (int32_t d = 0; d < kept; d++) {
    if (t->dims[d] < 0) return pakv_fail(err, "%s has a negative dimension %lld", name, (long long)t->dims[d]);
    if (t->strides[d] < 0) return pakv_fail(err, "%s has a negative stride %lld", name, (long long)t->strides[d]);
  }
  return 0;
}

int pakv_has_elements(const pakv_tensor* t) {
  for (int32_t d = 0; d < t->ndim && d < PAKV_MAX_RANK; d++)
    if (t->dims[d] == 0) return 0;
  return 1;
}

int64_t pakv_element_count(const pakv_tensor* t) {
  int64_t count = 1;
  if (t->ndim < 0 || t->ndim > PAKV_MAX_RANK) return 0;
  for (int32_t d = 0; d < t->ndim; d++)
    if (pakv_mul(count, t->dims[d], &count)) return 0;
  return count;
}

void* pakv_plan_address(const pakv_tensor* t) {
  static max_align_t nothing;
  return t->data || pakv_has_elements(t) ? (void*)t->data : (void*)&nothing;
}

/* [first, end) of the bytes a record may touch; 0 when it has no elements (or cannot be sized). */
int pakv_byte_extent(const pakv_tensor* t, int itemsize, uintptr_t* first, uintptr_t* end) {
  int64_t span = 0, term;
  if (!t->present || t->ndim > PAKV_MAX_RANK || !pakv_has_elements(t)) return 0;
  for (int32_t d = 0; d < t->ndim; d++)
    if (pakv_mul(t->dims[d] - 1, t->strides[d], &term) || pakv_add(span, term, &span)) return 0;
  if (pakv_add(span, 1, &span) || pakv_mul(span, itemsize, &span)) return 0;
  *first = (uintptr_t)t->data;
  *end = *first + (uintptr_t)span;
  return 1;
}

int pakv_element_size(int onnx_type) {
  int d = pakv_dtype_index(onnx_type);
  if (d >= 0) return PAKV_CACHE_DTYPES[d].itemsize;
  return pakv_is_index_type(onnx_type) ? pakv_index_itemsize(onnx_type) : 1;
}

void pakv_dense_record(pakv_tensor* t, const void* data, int elem_type, int ndim, const int64_t* dims,
                       const char* device) {
  memset(t, 0, sizeof(*t));
  t->data = data;
  t->present = 1;
  t->elem_type = elem_type;
  t->ndim = ndim;
  /* A bounded copy, not snprintf: it runs for every record of every call (the rest of t is zeroed). */
  for (size_t c = 0; c + 1 < sizeof(t->device) && device[c]; c++) t->device[c] = device[c];
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

int pakv_require_present(const pakv_tensor* t, const char* name, pakv_err* err) {
  return t->present ? 0 : pakv_fail(err, "%s is required", name);
}

int pakv_cache_dtype(const pakv_tensor* t, const char* name, pakv_err* err) {
  if (pakv_require_present(t, name, err)) return -1;
  if (pakv_dtype_index(t->elem_type) >= 0) return 0;
  char allowed[256];
  size_t at = 0;
  for (int i = 0; i < PAKV_NUM_DTYPES && at < sizeof(allowed); i++)
    at += (size_t)snprintf(allowed + at, sizeof(allowed) - at, i ? ", %s" : "%s", PAKV_CACHE_DTYPES[i].name);
  return pakv_fail_type(err, "%s dtype %s is not in the contract (allowed: %s)", name, pakv_type_name(t->elem_type),
                        allowed);
}

int pakv_cache_shape(const pakv_tensor* t, const char* name, int nz, pakv_cache_geometry* g, pakv_err* err) {
  char shape[160];
  const char* layout =
      nz ? "PA_NZ: [num_blocks, heads*head_dim // E, block_size, E]" : "Norm: [num_blocks, block_size, heads, head_dim]";
  if (pakv_require_rank(t, name, 4, layout, err)) return -1;
  g->itemsize = PAKV_CACHE_DTYPES[pakv_dtype_index(t->elem_type)].itemsize;
  g->num_blocks = t->dims[0];
  /* One token's row: Norm dims 2 x 3 (H x D), PA_NZ dims 1 x 3 (H*D/E fractals x E). */
  int row_dim = nz ? 1 : 2;
  if (nz) {
    int64_t e = PAKV_NZ_FRACTAL_BYTES / g->itemsize;
    if (t->dims[3] != e)
      return pakv_fail(err, "%s: PA_NZ last dim must be 32 bytes / element size = %lld for %s, got %lld (shape %s)",
                       name, (long long)e, pakv_type_name(t->elem_type), (long long)t->dims[3], SHAPE(t, shape));
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
int pakv_cache_layout(const pakv_tensor* t, const char* name, pakv_cache_geometry* g, pakv_err* err) {
  char shape[160], strides[160];
  g->block_stride = g->block_bytes;
  if (!pakv_has_elements(t)) return 0;
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

int pakv_require_compute_dtype(const pakv_tensor* query, pakv_err* err) {
  if (query->elem_type == 1 || query->elem_type == 10 || query->elem_type == 16) return 0;
  return pakv_fail_type(err, "query dtype %s is not one PagedAttention computes in (float32, float16, bfloat16)",
                        pakv_type_name(query->elem_type));
}

int pakv_check_block_size(const pakv_cache_geometry* k, pakv_err* err) {
  if (k->block_size >= 1) return 0;
  return pakv_fail(err, "key_cache block_size must be >= 1, got %lld", (long long)k->block_size);
}

int pakv_check_caches(const pakv_tensor* kc, const pakv_tensor* vc, int nz, pakv_cache_geometry* k, pakv_cache_geometry* v,
                        pakv_err* err) {
  if (pakv_cache_dtype(kc, "key_cache", err) || pakv_cache_dtype(vc, "value_cache", err)) return -1;
  if (strncmp(kc->device, vc->device, PAKV_DEVICE_LEN) != 0)
    return pakv_fail(err, "value_cache is on %.24s but key_cache is on %.24s", vc->device, kc->device);
  if (pakv_cache_shape(kc, "key_cache", nz, k, err) || pakv_cache_shape(vc, "value_cache", nz, v, err)) return -1;
  if (v->num_blocks != k->num_blocks || v->block_size != k->block_size)
    return pakv_fail(err, "value_cache num_blocks/block_size (%lld, %lld) must equal key_cache's (%lld, %lld)",
                     (long long)v->num_blocks, (long long)v->block_size, (long long)k->num_blocks,
                     (long long)k->block_size);
  if (pakv_check_block_size(k, err)) return -1;
  if (pakv_cache_layout(kc, "key_cache", k, err) || pakv_cache_layout(vc, "value_cache", v, err)) return -1;
  return 0;
}
int pakv_caches_apart(const pakv_tensor* kc, const pakv_tensor* vc, const pakv_cache_geometry* k,
                      const pakv_cache_geometry* v, pakv_err* err) {
  const pakv_cache_geometry* g[2] = {k, v};
  const char* names[2] = {"key_cache", "value_cache"};
  for (int i = 0; i < (vc->present ? 2 : 1); i++)
    if (g[i]->num_blocks > 1 && g[i]->block_stride < g[i]->block_bytes && g[i]->block_bytes > 0)
      return pakv_fail(err,
                       "%s: block stride %lld bytes is less than one block (%lld bytes): its blocks overlap, and a "
                       "write would put one slot's bytes into another",
                       names[i], (long long)g[i]->block_stride, (long long)g[i]->block_bytes);
  if (!vc->present || !pakv_overlaps(kc, vc)) return 0;
  if (k->block_stride == v->block_stride && k->num_blocks > 1) {
    /* Interleaved views of one pool: apart when value's blocks sit in the gaps between key's. */
    uintptr_t kb = (uintptr_t)kc->data, vb = (uintptr_t)vc->data, stride = (uintptr_t)k->block_stride;
    uintptr_t d = (vb >= kb ? vb - kb : stride - (kb - vb) % stride) % stride;
    if (d >= (uintptr_t)k->block_bytes && stride - d >= (uintptr_t)v->block_bytes) return 0;
  }
  if (k->row_bytes == 0 || v->row_bytes == 0) return 0;
  return pakv_fail(err, "key_cache and value_cache share bytes: a write into one would change the other");
}

int pakv_index_record(const pakv_tensor* t, const char* name, int rank, const char* form, pakv_err* err) {
  if (pakv_require_present(t, name, err)) return -1;
  if (!pakv_is_index_type(t->elem_type))
    return pakv_fail_type(err, "%s must be int32 or int64, got %s", name, pakv_type_name(t->elem_type));
  if (pakv_require_rank(t, name, rank, form, err)) return -1;
  return pakv_has_elements(t) ? pakv_require_host(t, name, err) : 0;
}

int pakv_refuse_meta(const pakv_tensor* t, const char* name, pakv_err* err) {
  if (strncmp(t->device, "meta", PAKV_DEVICE_LEN) != 0) return 0;
  return pakv_fail(err, "%s is on the meta device (a shape with no data to read or write)", name);
}

int pakv_require_host(const pakv_tensor* t, const char* name, pakv_err* err) {
  if (t->host_data) return 0;
  return pakv_fail(err, "%s: its data is not readable on the host (the validator reads it there; it is on %.24s)",
                   name, t->device);
}

int pakv_cumulative_counts(const pakv_tensor* cu, const char* rule, const char* name, int64_t count, int64_t* starts,
                           int64_t* counts, int64_t* total, pakv_err* err) {
  int64_t a = pakv_vector_at(cu, 0);
  if (a != 0) return pakv_fail(err, "%s must start at 0, got %s[0] = %lld", rule, name, (long long)a);
  for (int64_t i = 0; i < count; i++) { /* each entry read once: a snapshot */
    int64_t b = pakv_vector_at(cu, i + 1);
    if (b < a)
      return pakv_fail(err, "%s must be non-decreasing, got %s[%lld] = %lld < %s[%lld] = %lld", rule, name,
                       (long long)(i + 1), (long long)b, name, (long long)i, (long long)a);
    starts[i] = a;
    counts[i] = b - a; /* 0 <= a <= b: no overflow */
    a = b;
  }
  *total = a;
  return 0;
}

int pakv_fail_id(const pakv_id_rule* rule, int64_t id, int64_t bound, int64_t row, int64_t col, int64_t reader,
                 pakv_err* err) {
  char entry[160], reads[64] = "";
  if (col >= 0)
    snprintf(entry, sizeof(entry), "%s[%lld, %lld]", rule->name, (long long)row, (long long)col);
  else
    snprintf(entry, sizeof(entry), "%s[%lld]", rule->name, (long long)row);
  if (reader >= 0) snprintf(reads, sizeof(reads), "; sequence %lld reads it", (long long)reader);
  return pakv_fail(err, "%s = %lld is outside [0, %lld) (%s)%s%s", entry, (long long)id, (long long)bound, rule->bound,
                   reads, rule->after);
}

/* The paged-attention ops' block ids (entries a sequence does not read may hold anything). */
static const pakv_id_rule TABLE_READ = {"block_table", "num_blocks of key_cache",
                                        " (entries a sequence does not read, past its context or before its window, "
                                        "may hold anything, e.g. -1)",
                                        0};

int pakv_check_table_reads(const pakv_tensor* bt, const int64_t* counts, const int64_t* lengths, int64_t bs, int64_t nb,
                           int64_t window, pakv_err* err) {
  int64_t batch = bt->dims[0], cols = bt->dims[1];
  for (int64_t b = 0; b < batch; b++) { /* rows first, then ids (as the gather) */
    int64_t need = counts[b] ? lengths[b] / bs + (lengths[b] % bs != 0) : 0; /* no new token: nothing read */
    if (need > cols)
      return pakv_fail(err,
                       "block_table row %lld is too short: sequence %lld's context of %lld tokens (%lld past + %lld "
                       "new) needs %lld blocks of %lld, but block_table has %lld columns",
                       (long long)b, (long long)b, (long long)lengths[b], (long long)(lengths[b] - counts[b]),
                       (long long)counts[b], (long long)need, (long long)bs, (long long)cols);
  }
  for (int64_t b = 0; b < batch; b++) {
    int64_t need = counts[b] ? lengths[b] / bs + (lengths[b] % bs != 0) : 0, past = lengths[b] - counts[b];
    int64_t first = window >= 0 && past > window ? (past - window) / bs : 0; /* what its first new token sees */
    for (int64_t c = first; c < need; c++)
      if (pakv_check_id(&TABLE_READ, pakv_table_at(bt, b, c), nb, b, c, b, err)) return -1;
  }
  return 0;
}

static int by_slot_then_token(const void* a, const void* b) {
  const pakv_slot_pair *x = (const pakv_slot_pair*)a, *y = (const pakv_slot_pair*)b;
  if (x->slot != y->slot) return x->slot < y->slot ? -1 : 1;
  return x->token < y->token ? -1 : x->token > y->token;
}

int64_t pakv_first_repeated_slot(pakv_slot_pair* pairs, int64_t n, int64_t* first) {
  qsort(pairs, (size_t)n, sizeof(pakv_slot_pair), by_slot_then_token);
  /* Sorted by (slot, token): in each run of one slot the first two entries are its earliest token
   * and the first token repeating it; the repeat with the smallest token is the one named. */
  int64_t repeat = -1;
  for (int64_t i = 1; i < n; i++)
    if (pairs[i].slot == pairs[i - 1].slot && (i < 2 || pairs[i - 2].slot != pairs[i].slot) &&
        (repeat < 0 || pairs[i].token < repeat)) {
      repeat = pairs[i].token;
      *first = pairs[i - 1].token;
    }
  return repeat;
}

int pakv_fail_repeated_slot(pakv_err* err, int64_t token, int64_t slot, int64_t first) {
  return pakv_fail(err, "slot_mapping[%lld] = %lld repeats slot_mapping[%lld]: two tokens cannot write one slot",
                   (long long)token, (long long)slot, (long long)first);
}
/* ------------------------------------------------------------------------------------------- */
/* Outputs                                                                                     */
/* ------------------------------------------------------------------------------------------- */
int pakv_same_dtype(const pakv_tensor* t, const char* name, const pakv_tensor* cache, const char* cache_name,
                      pakv_err* err) {
  if (t->elem_type == cache->elem_type) return 0;
  return pakv_fail_type(err, "%s must have %s's dtype %s, got %s", name, cache_name, pakv_type_name(cache->elem_type),
                        pakv_type_name(t->elem_type));
}

int pakv_same_device(const pakv_tensor* t, const char* name, const pakv_tensor* cache, pakv_err* err) {
  if (strncmp(t->device, cache->device, PAKV_DEVICE_LEN) == 0) return 0;
  return pakv_fail(err, "%s must be on the caches' device %.24s, got %.24s", name, cache->device, t->device);
}

/* An output (dense, of its cache's dtype and device) of the given dims. */
int pakv_output_record(const pakv_tensor* t, const char* name, const pakv_tensor* cache, const char* cache_name,
                         const int64_t* dims, int32_t rank, pakv_err* err) {
  char want[160], got[160], strides[160];
  int same = t->ndim == rank;
  for (int32_t d = 0; same && d < rank; d++) same = t->dims[d] == dims[d];
  if (!same)
    return pakv_fail(err, "%s must have shape %s, got %s", name, pakv_format_list(dims, rank, want, sizeof(want)),
                     SHAPE(t, got));
  if (pakv_same_dtype(t, name, cache, cache_name, err) || pakv_same_device(t, name, cache, err)) return -1;
  int64_t expected = 1;
  for (int32_t d = rank - 1; d >= 0 && pakv_has_elements(t); d--) {
    if (t->dims[d] != 1 && t->strides[d] != expected)
      return pakv_fail(err, "%s must be contiguous (row-major); got strides %s for shape %s: pass %s.contiguous()",
                       name, STRIDES(t, strides), SHAPE(t, got), name);
    expected *= t->dims[d];
  }
  return 0;
}

int pakv_overlaps(const pakv_tensor* a, const pakv_tensor* b) {
  uintptr_t a0, a1, b0, b1;
  if (!a->present || !b->present) return 0; /* first, cheaply: most of a fused call's optional records are absent */
  if (!pakv_byte_extent(a, pakv_element_size(a->elem_type), &a0, &a1) || !pakv_byte_extent(b, pakv_element_size(b->elem_type), &b0, &b1))
    return 0;
  return a0 < b1 && b0 < a1 && strncmp(a->device, b->device, PAKV_DEVICE_LEN) == 0;
}

/* A present record's byte extent [first, end), computed once; 0 when it has none (absent, empty, or an
 * extent past int64: such a record shares no bytes, as pakv_overlaps() says). */
static int extent_of(const pakv_tensor* t, uintptr_t* first, uintptr_t* end) {
  return t->present && pakv_byte_extent(t, pakv_element_size(t->elem_type), first, end);
}

/* Output t[which] overlaps none of the inputs t[0 .. inputs), except that it may be exactly input
 * `in_place` (the same buffer: an in-place update; -1: none may). The rule of pakv_overlaps(), with the
 * output's extent computed once rather than once per input. */
int pakv_output_apart(const pakv_tensor* t, const char* const* names, int which, int inputs, int in_place,
                        pakv_err* err) {
  uintptr_t a0, a1, b0, b1;
  if (!extent_of(&t[which], &a0, &a1)) return 0;
  for (int in = 0; in < inputs; in++) {
    if (!extent_of(&t[in], &b0, &b1) || !(a0 < b1 && b0 < a1) ||
        strncmp(t[which].device, t[in].device, PAKV_DEVICE_LEN) != 0)
      continue;
    if (in == in_place) {
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
int pakv_outputs_apart(const pakv_tensor* t, const char* const* names, int inputs, const int* in_place,
                         pakv_err* err) {
  const pakv_tensor *first = &t[inputs], *second = &t[inputs + 1];
  if (first->present && pakv_overlaps(first, second))
    return pakv_fail(err, "%s and %s overlap in memory; pass two separate tensors", names[inputs], names[inputs + 1]);
  for (int which = inputs; which <= inputs + 1; which++)
    if (pakv_output_apart(t, names, which, inputs, in_place ? in_place[which - inputs] : -1, err)) return -1;
  return 0;
}
/* A rank-3 [T, H, D] record whose tokens are each row-major (any token stride >= 0: a slice of a
 * fused QKV projection is fine); the token stride in bytes. */
int pakv_token_layout(const pakv_tensor* t, const char* name, int itemsize, int64_t* token_stride, pakv_err* err) {
  char shape[160], strides[160];
  if (pakv_has_elements(t) && ((t->dims[2] != 1 && t->strides[2] != 1) || (t->dims[1] != 1 && t->strides[1] != t->dims[2])))
    return pakv_fail(err,
                     "%s must be row-major contiguous within each token (only dim 0, the token axis, may be "
                     "strided); got strides %s for shape %s: pass %s.contiguous()",
                     name, STRIDES(t, strides), SHAPE(t, shape), name);
  return pakv_token_stride(t, name, itemsize, token_stride, err);
}

int pakv_token_stride(const pakv_tensor* t, const char* name, int itemsize, int64_t* token_stride, pakv_err* err) {
  if (pakv_mul(t->strides[0], itemsize, token_stride))
    return pakv_fail(err, "%s: a token stride of %lld elements overflows int64 byte offsets", name,
                     (long long)t->strides[0]);
  return 0;
}
/* 0, or the error's kind with its message copied to err_out (the exported entry points). */
PAKV_EXPORT size_t pakv_tensor_size(void) { return sizeof(pakv_tensor); }

/* 0, or the error's kind with its message copied to err_out (the exported entry points). */
int pakv_report(int rc, const pakv_err* err, char* err_out, size_t err_len) {
  if (!rc) return 0;
  if (err_out && err_len) snprintf(err_out, err_len, "%s", err->msg);
  return err->kind == PAKV_ERR_TYPE ? PAKV_ERR_TYPE : PAKV_ERR_VALUE;
}
