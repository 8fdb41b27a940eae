/* What the two units of com.microsoft::PagedAttention's contract share (pakv_contract_fused.c: the
 * attributes and every tensor's form; pakv_contract_fused_values.c: index values, slots, scales, the
 * plan). Internal to them. */
#ifndef PAKV_CONTRACT_FUSED_INTERNAL_H
#define PAKV_CONTRACT_FUSED_INTERNAL_H

#include <stdint.h>

#include "pakv_contract_records.h"
#include "pakv_fused.h"

/* What the form checks found. */
typedef struct {
  int latent, packed;
  int64_t num_tokens, head_dim, value_head_dim, rotary_dim;
  int64_t kv_width; /* kv_num_heads x head_dim: the elements of one token's key (or value) row */
  pakv_cache_geometry key, value; /* value = key for LATENT */
} pakv_fused_shape;

int pakv_fused_quant(const char* value); /* PAKV_QUANT_* of a quant-type attribute, -1 if unknown */
int pakv_fused_is_quantized(int onnx_type); /* int8 or float8e4m3fn */

/* Every form rule of the inputs (attributes first), filling `s`. */
int pakv_fused_inputs(const pakv_tensor* t, const pakv_fused_attributes* a, pakv_fused_shape* s, pakv_err* err);

#endif /* PAKV_CONTRACT_FUSED_INTERNAL_H */
