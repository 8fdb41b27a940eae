/* pakv::ScatterPaKvCache's contract: every rule of the write (pakv_contract.h, at
 * pakv_validate_scatter), with its message, once. Shared pieces: pakv_contract_records.c. */
#include <stdlib.h>
#include <string.h>

#include "pakv_contract_records.h"

static const char* const SCATTER_NAMES[PAKV_SCATTER_RECORDS] = {
    "key", "value", "key_cache", "value_cache", "slot_mapping", "key_cache_out", "value_cache_out"};

/* key / value: [T, H, D] of its cache's dtype and device, rows matching the cache's token row,
 * each token row-major (any token stride >= 0: a slice of a fused QKV projection is fine). */
static int scatter_source(const pakv_tensor* t, const char* name, const pakv_tensor* cache, const char* cache_name,
                          const pakv_cache_geometry* g, int nz, int64_t* token_stride, pakv_err* err) {
  char shape[160], cache_shape[160];
  if (pakv_require_present(t, name, err) || pakv_same_dtype(t, name, cache, cache_name, err) ||
      pakv_same_device(t, name, cache, err) || pakv_require_rank(t, name, 3, "[T, heads, head_dim]", err))
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
  return pakv_token_layout(t, name, g->itemsize, token_stride, err);
}

/* Blocks of a cache a scatter writes never overlap each other (a stride below one block would
 * make two slots one), the two caches share no bytes (pool views side by side in one pool are
 * fine), and the rows read overlap neither cache. */
static int scatter_targets_apart(const pakv_tensor* t, const pakv_cache_geometry* k, const pakv_cache_geometry* v,
                                 pakv_err* err) {
  const pakv_tensor *kc = &t[PAKV_SCATTER_KEY_CACHE], *vc = &t[PAKV_SCATTER_VALUE_CACHE];
  const pakv_cache_geometry* g[2] = {k, v};
  for (int i = 0; i < 2; i++)
    if (g[i]->num_blocks > 1 && g[i]->block_stride < g[i]->block_bytes && g[i]->block_bytes > 0)
      return pakv_fail(err,
                       "%s: block stride %lld bytes is less than one block (%lld bytes): its blocks overlap, and a "
                       "scatter would write one slot's bytes for another",
                       SCATTER_NAMES[PAKV_SCATTER_KEY_CACHE + i], (long long)g[i]->block_stride,
                       (long long)g[i]->block_bytes);
  int apart = !pakv_overlaps(kc, vc);
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
      if (pakv_overlaps(&t[src], &t[cache]))
        return pakv_fail(err, "%s overlaps %s in memory: the rows a scatter reads must not share bytes with a cache",
                         SCATTER_NAMES[src], SCATTER_NAMES[cache]);
  return 0;
}

static const pakv_id_rule SLOT = {"slot_mapping", "num_blocks x block_size of key_cache; a negative slot is padding",
                                  "", 1};

/* Every slot < capacity (negative: padding), no slot twice: the first token (in token order) that
 * repeats an earlier token's slot is named. `pairs` holds T entries. */
static int check_slots(const pakv_tensor* sm, int64_t T, int64_t capacity, pakv_slot_pair* pairs, pakv_err* err) {
  int64_t n = 0;
  for (int64_t t = 0; t < T; t++) {
    int64_t s = pakv_vector_at(sm, t);
    if (pakv_check_id(&SLOT, s, capacity, t, -1, -1, err)) return -1;
    if (s >= 0) pairs[n++] = (pakv_slot_pair){s, t};
  }
  int64_t first = -1, repeat = pakv_first_repeated_slot(pairs, n, &first);
  return repeat >= 0 ? pakv_fail_repeated_slot(err, repeat, pakv_vector_at(sm, repeat), first) : 0;
}

int pakv_validate_scatter_outputs(const pakv_tensor t[PAKV_SCATTER_RECORDS], pakv_err* err) {
  static const int in_place[2] = {PAKV_SCATTER_KEY_CACHE, PAKV_SCATTER_VALUE_CACHE};
  for (int i = 0; i < 2; i++) {
    const pakv_tensor *out = &t[PAKV_SCATTER_KEY_CACHE_OUT + i], *cache = &t[in_place[i]];
    if (!out->present) continue;
    if (pakv_record_ok(out, SCATTER_NAMES[PAKV_SCATTER_KEY_CACHE_OUT + i], err) ||
        pakv_output_record(out, SCATTER_NAMES[PAKV_SCATTER_KEY_CACHE_OUT + i], cache, SCATTER_NAMES[in_place[i]],
                      cache->dims, 4, err))
      return -1;
  }
  return pakv_outputs_apart(t, SCATTER_NAMES, PAKV_SCATTER_INPUTS, in_place, err);
}

int64_t pakv_scatter_scratch_len(const pakv_tensor t[PAKV_SCATTER_RECORDS]) {
  const pakv_tensor* key = &t[PAKV_SCATTER_KEY];
  int64_t len;
  if (!key->present || key->ndim < 1 || key->ndim > PAKV_MAX_RANK || key->dims[0] < 0) return 0;
  return pakv_mul(key->dims[0], 2, &len) ? -1 : len;
}

int pakv_validate_scatter(const pakv_tensor t[PAKV_SCATTER_RECORDS], int nz, pakv_scatter_plan* plan,
                          int64_t* scratch, int64_t scratch_len, pakv_err* err) {
  pakv_cache_geometry k, v;
  char shape[160];
  for (int i = 0; i < PAKV_SCATTER_RECORDS; i++)
    if (t[i].present && pakv_record_ok(&t[i], SCATTER_NAMES[i], err)) return -1;
  const pakv_tensor *kc = &t[PAKV_SCATTER_KEY_CACHE], *vc = &t[PAKV_SCATTER_VALUE_CACHE];
  if (pakv_check_caches(kc, vc, nz, &k, &v, err)) return -1;
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
  if (pakv_index_record(sm, "slot_mapping", 1, "a vector", err)) return -1;
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
  if (check_slots(sm, T, capacity, (pakv_slot_pair*)scratch, err)) return -1;
  if (pakv_validate_scatter_outputs(t, err)) return -1;

  memset(plan, 0, sizeof(*plan));
  plan->abi_version = PAKV_ABI_VERSION;
  plan->struct_size = sizeof(pakv_scatter_plan);
  plan->layout = nz ? PAKV_LAYOUT_NZ : PAKV_LAYOUT_NORM;
  plan->slots64 = sm->elem_type == PAKV_ONNX_INT64;
  PAKV_PLAN_CACHES(plan, k, v, pakv_plan_address(kc), pakv_plan_address(vc));
  plan->key_row_bytes = k.row_bytes;
  plan->value_row_bytes = v.row_bytes;
  plan->key = pakv_plan_address(&t[PAKV_SCATTER_KEY]);
  plan->value = pakv_plan_address(&t[PAKV_SCATTER_VALUE]);
  plan->key_token_stride = key_stride;
  plan->value_token_stride = value_stride;
  plan->num_tokens = T;
  plan->slot_mapping = sm->host_data;
  plan->slot_stride = sm->strides[0] * pakv_index_itemsize(sm->elem_type);
  return pakv_check_scatter_plan(plan, err);
}

/* Exported entry point (pakv_onnx/validator.py). */
PAKV_EXPORT int pakv_plan_scatter(pakv_scatter_call* call) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  if (!call) return PAKV_ERR_VALUE;
  int rc = pakv_validate_scatter(call->records, call->nz != 0, &call->plan, call->scratch, call->scratch_len, &err);
  return pakv_report(rc, &err, call->error, call->error ? PAKV_ERR_LEN : 0);
}

PAKV_EXPORT size_t pakv_scatter_call_size(void) { return sizeof(pakv_scatter_call); }
