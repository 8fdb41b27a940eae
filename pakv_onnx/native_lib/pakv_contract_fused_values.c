/* com.microsoft::PagedAttention's contract, part two: the values a call brings (sequence lengths,
 * positions, the block ids read, the slots written, scales, sinks, metadata bounds) and the plan made
 * of them, with their messages, once. Part one (attributes, every tensor's form) is
 * pakv_contract_fused.c. Every index entry is read once, here: the cores run on the snapshot. */
#include <stdlib.h>
#include <string.h>

#include "pakv_contract_fused_internal.h"
#include "pakv_float.h"

/* Where each part of the scratch starts (int64 words): the attention's 3 x B per-sequence entries,
 * slots [N], positions [N], (slot, token) pairs [2N] for the repeat check, then fp32 copies of
 * k_scale, v_scale and head_sink. */
typedef struct {
  int64_t batch, tokens, scale_floats[2], sink_floats, words;
} scratch_layout;

static int layout_of(const pakv_tensor* t, scratch_layout* l) {
  const pakv_tensor *cu = &t[PAKV_FUSED_CU_SEQLENS], *q = &t[PAKV_FUSED_QUERY];
  int64_t floats, words;
  memset(l, 0, sizeof(*l));
  l->batch = cu->present && cu->ndim == 1 && cu->dims[0] > 0 ? cu->dims[0] - 1 : 0;
  l->tokens = q->present && q->ndim >= 1 && q->ndim <= PAKV_MAX_RANK && q->dims[0] > 0 ? q->dims[0] : 0;
  l->scale_floats[0] = t[PAKV_FUSED_K_SCALE].present ? pakv_element_count(&t[PAKV_FUSED_K_SCALE]) : 0;
  l->scale_floats[1] = t[PAKV_FUSED_V_SCALE].present ? pakv_element_count(&t[PAKV_FUSED_V_SCALE]) : 0;
  l->sink_floats = t[PAKV_FUSED_HEAD_SINK].present ? pakv_element_count(&t[PAKV_FUSED_HEAD_SINK]) : 0;
  if (pakv_mul(l->batch, 3, &words) || pakv_mul(l->tokens, 4, &floats) || pakv_add(words, floats, &words) ||
      pakv_add(l->scale_floats[0], l->scale_floats[1], &floats) || pakv_add(floats, l->sink_floats, &floats) ||
      pakv_add(floats, 1, &floats) || pakv_add(words, floats / 2, &l->words))
    return -1;
  return 0;
}

int64_t pakv_fused_scratch_len(const pakv_tensor t[PAKV_FUSED_RECORDS]) {
  scratch_layout l;
  return layout_of(t, &l) ? -1 : l.words;
}

/* Per sequence: query start, new tokens, context; per token its position; the lengths' rules and
 * the table entries each sequence with new tokens reads (positions 0 .. context - 1). */
static int fused_sequences(const pakv_tensor* t, const pakv_fused_attributes* a, const pakv_fused_shape* s,
                           int64_t* starts, int64_t* counts, int64_t* lengths, int64_t* positions, pakv_err* err) {
  const pakv_tensor *cu = &t[PAKV_FUSED_CU_SEQLENS], *past = &t[PAKV_FUSED_PAST_SEQLENS], *bt = &t[PAKV_FUSED_BLOCK_TABLE];
  int64_t batch = cu->dims[0] - 1, bs = s->key.block_size, total = 0;
  if (pakv_cumulative_counts(cu, "cumulative_sequence_length", "cumulative_sequence_length", batch, starts, counts,
                             &total, err))
    return -1;
  if (total != s->num_tokens) /* before any position is written: the positions below stay inside [0, num_tokens) */
    return pakv_fail(err, "cumulative_sequence_length must end at num_tokens = %lld (query's rows), got "
                     "cumulative_sequence_length[%lld] = %lld", (long long)s->num_tokens, (long long)batch, (long long)total);
  for (int64_t b = 0; b < batch; b++) { /* each entry read once: a snapshot */
    int64_t before = pakv_vector_at(past, b);
    if (before < 0)
      return pakv_fail(err, "past_seqlens must be non-negative, got past_seqlens[%lld] = %lld", (long long)b, (long long)before);
    if (pakv_add(before, counts[b], &lengths[b]))
      return pakv_fail(err, "past_seqlens[%lld] = %lld plus its %lld new tokens overflows int64", (long long)b,
                       (long long)before, (long long)counts[b]);
    for (int64_t j = 0; j < counts[b]; j++) positions[starts[b] + j] = before + j;
  }
  int64_t window = a->local_window_size > 0 ? a->local_window_size - 1 : -1;
  if (pakv_check_table_reads(bt, counts, lengths, bs, s->key.num_blocks, window, err)) return -1;
  for (int64_t b = 0; b < batch; b++) {
    if (s->rotary_dim && counts[b] && lengths[b] > t[PAKV_FUSED_COS_CACHE].dims[0])
      return pakv_fail(err, "cos_cache has %lld positions but sequence %lld's new tokens sit at positions up to %lld "
                       "(past_seqlens + j)", (long long)t[PAKV_FUSED_COS_CACHE].dims[0], (long long)b,
                       (long long)(lengths[b] - 1));
  }
  return 0;
}

static const pakv_id_rule SLOT = {"slot_mapping", "num_blocks x block_size of key_cache; -1 skips the token's write",
                                  "", 1};
/* A block a derived slot writes into (checked again here: another thread may have changed the table). */
static const pakv_id_rule WRITTEN_BLOCK = {"block_table", "num_blocks of key_cache",
                                           "; the sequence's new token writes there (block_tables changed while "
                                           "the call ran?)",
                                           0};
/* Slot of position p of sequence b through block_table: its entry read once, and that value checked
 * (another thread may change the table after pakv_check_table_reads read it: the slot written is
 * derived only from the value checked here). */
static int table_slot(const pakv_tensor* bt, int64_t b, int64_t p, const pakv_fused_shape* s, int64_t* slot,
                      pakv_err* err) {
  int64_t bs = s->key.block_size, column = p / bs, block = pakv_table_at(bt, b, column);
  if (pakv_check_id(&WRITTEN_BLOCK, block, s->key.num_blocks, b, column, -1, err)) return -1;
  if (pakv_mul(block, bs, slot) || pakv_add(*slot, p % bs, slot))
    return pakv_fail(err, "block_table[%lld, %lld] = %lld x block_size %lld overflows int64", (long long)b,
                     (long long)column, (long long)block, (long long)bs);
  return 0;
}

/* Each token's slot: slot_mapping's (a negative one: not written), or derived from its position
 * through block_table; every slot inside the caches, no slot twice (the token repeating an earlier
 * token's slot is named). */
static int fused_slots(const pakv_tensor* t, const pakv_fused_shape* s, const int64_t* starts, const int64_t* counts,
                       const int64_t* positions, int64_t* slots, pakv_slot_pair* pairs, pakv_err* err) {
  const pakv_tensor *sm = &t[PAKV_FUSED_SLOT_MAPPING], *bt = &t[PAKV_FUSED_BLOCK_TABLE];
  int64_t bs = s->key.block_size, batch = bt->dims[0], capacity, n = 0;
  /* Fits: the cache's extent fits int64 and its blocks are apart (pakv_caches_apart), so each takes >= bs bytes. */
  if (pakv_mul(s->key.num_blocks, bs, &capacity)) capacity = INT64_MAX;
  for (int64_t b = 0; b < batch; b++)
    for (int64_t token = starts[b]; token < starts[b] + counts[b]; token++) {
      int64_t p = positions[token];
      if (!sm->present && table_slot(bt, b, p, s, &slots[token], err)) return -1;
      if (sm->present) slots[token] = pakv_vector_at(sm, token);
      if (pakv_check_id(&SLOT, slots[token], capacity, token, -1, -1, err)) return -1;
      if (slots[token] < 0) slots[token] = -1;
      else pairs[n++] = (pakv_slot_pair){slots[token], token};
    }
  int64_t first = -1, repeat = pakv_first_repeated_slot(pairs, n, &first);
  if (repeat < 0) return 0;
  if (sm->present) return pakv_fail_repeated_slot(err, repeat, slots[repeat], first);
  return pakv_fail(err, "tokens %lld and %lld would both write slot %lld (slots derived from block_table: two sequences "
                   "share that block at the positions they write)", (long long)first, (long long)repeat,
                   (long long)slots[repeat]);
}

/* fp32 copies of the scales (each finite) and of head_sink (widened from query's dtype). */
static int fused_floats(const pakv_tensor* t, const scratch_layout* l, float* floats, const float** scales,
                        const float** sink, pakv_err* err) {
  for (int side = 0; side < 2; side++) {
    const pakv_tensor* scale = &t[side ? PAKV_FUSED_V_SCALE : PAKV_FUSED_K_SCALE];
    scales[side] = NULL;
    if (!scale->present) continue;
    int64_t count = l->scale_floats[side], at = 0;
    int64_t dims_left[PAKV_MAX_RANK] = {0};
    for (int64_t i = 0; i < count; i++) { /* any strides: walk the dims */
      memcpy(&floats[i], (const float*)scale->host_data + at, sizeof(float));
      if ((float_to_bits(floats[i]) & 0x7F800000u) == 0x7F800000u) /* inf or NaN */
        return pakv_fail(err, "%s[%lld] = %.9g is not finite (flat index)", side ? "v_scale" : "k_scale", (long long)i,
                         (double)floats[i]);
      for (int d = scale->ndim - 1; d >= 0; d--) {
        at += scale->strides[d];
        if (++dims_left[d] < scale->dims[d]) break;
        at -= scale->strides[d] * scale->dims[d];
        dims_left[d] = 0;
      }
    }
    scales[side] = floats;
    floats += count;
  }
  const pakv_tensor* hs = &t[PAKV_FUSED_HEAD_SINK];
  *sink = hs->present ? floats : NULL;
  if (hs->present) widen(floats, hs->host_data, l->sink_floats, hs->elem_type);
  return 0;
}

static int fused_metadata(const pakv_tensor* meta, pakv_err* err) {
  for (int64_t i = 0; meta->present && i < meta->dims[0]; i++)
    if (pakv_vector_at(meta, i) < 0)
      return pakv_fail(err, "attention_metadata entries must be non-negative (0: unknown), got attention_metadata[%lld] "
                       "= %lld", (long long)i, (long long)pakv_vector_at(meta, i));
  return 0;
}

/* 1 / sqrt(d), correctly rounded to double first (a square root instruction; no libm). */
static float inverse_sqrt(int64_t d) { return (float)(1.0 / __builtin_sqrt((double)d)); }

static void fill_attention(const pakv_tensor* t, const pakv_fused_attributes* a, const pakv_fused_shape* s,
                           pakv_fused_plan* p, const int64_t* scratch, const float* const* scales, const float* sink) {
  const pakv_tensor* bt = &t[PAKV_FUSED_BLOCK_TABLE];
  pakv_attention_plan* at = &p->attention;
  int itemsize = pakv_element_size(p->query_type), cache_item = s->key.itemsize;
  at->abi_version = PAKV_ABI_VERSION;
  at->struct_size = sizeof(pakv_attention_plan);
  at->query_type = at->out_type = p->query_type;
  at->key_type = at->value_type = p->cache_type;
  at->key_quant = p->key_quant;
  at->value_quant = p->value_quant;
  at->key_scale = scales[0];
  at->value_scale = s->latent ? scales[0] : scales[1];
  at->tables64 = bt->elem_type == PAKV_ONNX_INT64;
  at->causal = (int32_t)a->is_causal;
  at->num_blocks = s->key.num_blocks;
  at->block_size = s->key.block_size;
  at->key_cache = p->key_cache;
  at->value_cache = s->latent ? p->key_cache : p->value_cache;
  at->key_block_stride = s->key.block_stride;
  at->value_block_stride = s->value.block_stride;
  at->key_row_stride = s->key.row_bytes;
  at->value_row_stride = s->value.row_bytes;
  at->key_head_stride = at->value_head_stride = s->head_dim * cache_item;
  at->num_heads = a->num_heads;
  at->num_kv_heads = a->kv_num_heads;
  at->head_dim = s->head_dim;
  at->value_head_dim = s->value_head_dim;
  at->query = p->prepare_query ? NULL : p->query;
  at->query_token_stride = p->prepare_query ? a->num_heads * s->head_dim * itemsize : p->query_token_stride;
  at->query_head_stride = s->head_dim * itemsize;
  at->num_tokens = s->num_tokens;
  at->num_seqs = bt->dims[0];
  at->table_cols = bt->dims[1];
  at->block_tables = bt->host_data;
  at->table_row_stride = bt->strides[0] * pakv_index_itemsize(bt->elem_type);
  at->table_col_stride = bt->strides[1] * pakv_index_itemsize(bt->elem_type);
  at->query_starts = scratch;
  at->query_counts = scratch + at->num_seqs;
  at->context_lens = scratch + 2 * at->num_seqs;
  at->scale = a->scale != 0.0f ? a->scale : inverse_sqrt(s->head_dim);
  at->softcap = a->softcap;
  at->window = a->local_window_size > 0 ? a->local_window_size - 1 : -1;
  at->head_sink = sink;
  /* ORT's CUDA kernel rounds each dequantized cache element to T before attention (float16 / bfloat16;
   * docs/ort-paged-attention.md, "Cache bytes"); float32 keeps them exact. */
  at->dequantized_type = p->query_type == ONNX_FLOAT16 || p->query_type == ONNX_BFLOAT16 ? p->query_type : 0;
}

/* query's, key's and value's token strides in bytes fit int64 (a one-token view may carry any stride). */
static int token_strides_fit(const pakv_tensor* t, pakv_err* err) {
  int64_t bytes;
  for (int i = PAKV_FUSED_QUERY; i <= PAKV_FUSED_VALUE; i++)
    if (t[i].present && pakv_token_stride(&t[i], PAKV_FUSED_NAMES[i], pakv_element_size(t[i].elem_type), &bytes, err))
      return -1;
  return 0;
}

static void fill_prologue(const pakv_tensor* t, const pakv_fused_attributes* a, const pakv_fused_shape* s,
                          pakv_fused_plan* p) {
  const pakv_tensor *q = &t[PAKV_FUSED_QUERY], *k = &t[PAKV_FUSED_KEY], *v = &t[PAKV_FUSED_VALUE];
  int itemsize = pakv_element_size(q->elem_type);
  int64_t q_width = a->num_heads * s->head_dim * itemsize, kv_width = a->kv_num_heads * s->head_dim * itemsize;
  p->abi_version = PAKV_ABI_VERSION;
  p->struct_size = sizeof(pakv_fused_plan);
  p->query_type = q->elem_type;
  p->cache_type = t[PAKV_FUSED_KEY_CACHE].elem_type;
  p->key_quant = pakv_fused_quant(a->k_quant_type);
  p->value_quant = s->latent ? p->key_quant : pakv_fused_quant(a->v_quant_type);
  p->latent = s->latent;
  p->normalize = t[PAKV_FUSED_Q_NORM_WEIGHT].present;
  p->rotary_interleaved = (int32_t)a->rotary_interleaved;
  p->prepare_query = p->normalize || s->rotary_dim > 0;
  p->num_tokens = s->num_tokens;
  p->num_heads = a->num_heads;
  p->num_kv_heads = a->kv_num_heads;
  p->head_dim = s->head_dim;
  p->query = q->data;
  p->query_token_stride = q->strides[0] * itemsize;
  /* Packed QKV: key and value are columns of query's rows. */
  p->key = s->packed ? (const char*)q->data + q_width : k->data;
  p->key_token_stride = s->packed ? p->query_token_stride : k->strides[0] * itemsize;
  p->value = s->packed ? (const char*)q->data + q_width + kv_width : s->latent ? NULL : v->data;
  p->value_token_stride = s->packed ? p->query_token_stride : s->latent ? 0 : v->strides[0] * itemsize;
  p->q_norm_weight = p->normalize ? t[PAKV_FUSED_Q_NORM_WEIGHT].host_data : NULL;
  p->k_norm_weight = p->normalize ? t[PAKV_FUSED_K_NORM_WEIGHT].host_data : NULL;
  p->epsilon = a->qk_norm_epsilon;
  p->rotary_dim = s->rotary_dim;
  p->rotary_offset = s->rotary_dim ? a->rotary_offset : 0;
  p->cos_cache = s->rotary_dim ? t[PAKV_FUSED_COS_CACHE].host_data : NULL;
  p->sin_cache = s->rotary_dim ? t[PAKV_FUSED_SIN_CACHE].host_data : NULL;
  p->rotary_rows = s->rotary_dim ? t[PAKV_FUSED_COS_CACHE].dims[0] : 0;
  p->key_cache = (void*)t[PAKV_FUSED_KEY_CACHE].data;
  p->value_cache = s->latent ? NULL : (void*)t[PAKV_FUSED_VALUE_CACHE].data;
  p->num_blocks = s->key.num_blocks;
  p->block_size = s->key.block_size;
  p->key_block_stride = s->key.block_stride;
  p->value_block_stride = s->value.block_stride;
  p->key_row_bytes = s->key.row_bytes;
  p->value_row_bytes = s->value.row_bytes;
}

int pakv_validate_fused(const pakv_tensor t[PAKV_FUSED_RECORDS], const pakv_fused_attributes* a, pakv_fused_plan* plan,
                        int64_t* scratch, int64_t scratch_len, pakv_err* err) {
  pakv_fused_shape s;
  scratch_layout l;
  if (pakv_fused_inputs(t, a, &s, err)) return -1;
  if (layout_of(t, &l) || scratch_len < l.words || (l.words > 0 && !scratch))
    return pakv_fail(err, "no memory for the plan's %lld scratch entries (batch_size %lld, num_tokens %lld)",
                     (long long)l.words, (long long)l.batch, (long long)l.tokens);
  int64_t *starts = scratch, *counts = starts + l.batch, *lengths = counts + l.batch, *slots = lengths + l.batch;
  int64_t *positions = slots + l.tokens, *pairs = positions + l.tokens;
  float* floats = (float*)(pairs + 2 * l.tokens);
  const float* scales[2] = {NULL, NULL};
  const float* sink = NULL;
  int64_t out_bytes;
  if (fused_sequences(t, a, &s, starts, counts, lengths, positions, err) ||
      fused_slots(t, &s, starts, counts, positions, slots, (pakv_slot_pair*)pairs, err) ||
      fused_floats(t, &l, floats, scales, &sink, err) || fused_metadata(&t[PAKV_FUSED_ATTENTION_METADATA], err))
    return -1;
  if (pakv_mul(a->num_heads, s.head_dim, &out_bytes) || pakv_mul(out_bytes, 4, &out_bytes) ||
      pakv_mul(out_bytes, s.num_tokens > 0 ? s.num_tokens : 1, &out_bytes))
    return pakv_fail(err, "%lld tokens x %lld heads x %lld channels overflow int64 byte offsets", (long long)s.num_tokens,
                     (long long)a->num_heads, (long long)s.head_dim);
  if (token_strides_fit(t, err)) return -1;
  memset(plan, 0, sizeof(*plan));
  fill_prologue(t, a, &s, plan);
  plan->slots = slots;
  plan->positions = positions;
  plan->key_scale = scales[0];
  plan->value_scale = s.latent ? scales[0] : scales[1];
  fill_attention(t, a, &s, plan, scratch, scales, sink);
  if (pakv_validate_fused_outputs(t, plan, err)) return -1;
  plan->attention.out = t[PAKV_FUSED_OUTPUT].present ? (void*)t[PAKV_FUSED_OUTPUT].data : NULL;
  return pakv_check_fused_plan(plan, err); /* the cores' memory-safety view of the same plan */
}

int64_t pakv_fused_query_rows_bytes(const pakv_fused_plan* plan) {
  if (!plan->prepare_query) return 0;
  return plan->num_tokens * plan->num_heads * plan->head_dim * pakv_element_size(plan->query_type); /* checked above */
}

void pakv_fused_bind(pakv_fused_plan* plan, void* out, void* query_rows, void* key_cache, void* value_cache) {
  plan->attention.out = out;
  if (plan->prepare_query) {
    plan->query_rows = query_rows;
    plan->attention.query = query_rows;
  }
  plan->key_cache = key_cache;
  plan->attention.key_cache = key_cache;
  plan->value_cache = plan->latent ? NULL : value_cache;
  plan->attention.value_cache = plan->latent ? key_cache : value_cache;
}

/* Exported entry points (pakv_onnx/validator.py). */
PAKV_EXPORT int pakv_plan_fused(pakv_fused_call* call) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  if (!call) return PAKV_ERR_VALUE;
  int rc = pakv_validate_fused(call->records, &call->attributes, &call->plan, call->scratch, call->scratch_len, &err);
  return pakv_report(rc, &err, call->error, call->error ? PAKV_ERR_LEN : 0);
}

PAKV_EXPORT int pakv_check_fused_outputs(const pakv_fused_call* call) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  if (!call) return PAKV_ERR_VALUE;
  return pakv_report(pakv_validate_fused_outputs(call->records, &call->plan, &err), &err, call->error,
                     call->error ? PAKV_ERR_LEN : 0);
}

PAKV_EXPORT int64_t pakv_fused_scratch_needed(const pakv_fused_call* call) {
  return call ? pakv_fused_scratch_len(call->records) : -1;
}

PAKV_EXPORT void pakv_fused_bind_plan(pakv_fused_plan* plan, void* out, void* query_rows, void* key_cache,
                                      void* value_cache) {
  pakv_fused_bind(plan, out, query_rows, key_cache, value_cache);
}

PAKV_EXPORT void pakv_fused_defaults(pakv_fused_attributes* a) { pakv_fused_default_attributes(a); }
PAKV_EXPORT size_t pakv_fused_call_size(void) { return sizeof(pakv_fused_call); }
PAKV_EXPORT size_t pakv_fused_plan_size(void) { return sizeof(pakv_fused_plan); }
