/* Element types the attention reads and writes, as fp32 in registers: bfloat16, float16, int8 and
 * float8e4m3fn widened exactly (a quantized cache's stored element; its scale is applied apart),
 * fp32 narrowed with round-to-nearest-even as torch's .to() does. Header-only (static inline):
 * every unit that needs a conversion inlines it. No libm. */
#ifndef PAKV_FLOAT_H
#define PAKV_FLOAT_H

#include <stdint.h>
#include <string.h>

#define ONNX_FLOAT 1
#define ONNX_FLOAT16 10
#define ONNX_BFLOAT16 16
#define ONNX_INT8 3
#define ONNX_FLOAT8E4M3FN 17

static inline float bits_to_float(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

static inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof(bits));
  return bits;
}

static inline float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

/* Round to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN (quiet). */
static inline uint16_t float_to_bf16(float f) {
  uint32_t bits = float_to_bits(f);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40u);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

static inline float f16_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (mantissa << 13)); /* inf, NaN */
  if (exponent) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  float tiny = (float)mantissa * 5.9604644775390625e-8f; /* subnormal (or zero): mantissa x 2^-24 */
  return sign ? -tiny : tiny;
}

/* Round to nearest even, as torch's .to(torch.float16): overflow to inf, NaN stays NaN. */
static inline uint16_t float_to_f16(float f) {
  uint32_t bits = float_to_bits(f), sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);
  if (magnitude >= 0x47800000u) return (uint16_t)(sign | 0x7C00u); /* >= 65536 (and inf) */
  if (magnitude < 0x38800000u) {
    /* Below the smallest normal half (2^-14): adding 0.5 (exponent 126) lines the value's bits up
     * with the half subnormal's units of 2^-24, and the float addition rounds to nearest even. */
    float aligned = bits_to_float(magnitude) + 0.5f;
    return (uint16_t)(sign | (float_to_bits(aligned) - 0x3F000000u));
  }
  /* Normal: rebias the exponent and round the 13 dropped mantissa bits to nearest even (a carry
   * into the exponent is right, up to inf for values >= 65520). */
  uint32_t odd = (magnitude >> 13) & 1u;
  magnitude += ((uint32_t)(15 - 127) << 23) + 0xFFFu + odd;
  return (uint16_t)(sign | (magnitude >> 13));
}

/* float8e4m3fn (ONNX 17): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinity, S.1111.111
 * (0x7F / 0xFF) is NaN, exponent 0 is subnormal (mantissa x 2^-9); the largest value is 448. Exact,
 * branch-free (vectorizes), and independent of the CPU's denormal modes (every result is a normal
 * fp32 or zero). */
static inline float fp8e4m3fn_to_float(uint8_t x) {
  uint32_t sign = (uint32_t)(x & 0x80u) << 24, magnitude = x & 0x7Fu, mantissa = x & 7u;
  uint32_t normal = ((magnitude >> 3) + 120u) << 23 | mantissa << 20; /* rebias 7 -> 127 */
  uint32_t subnormal = float_to_bits((float)mantissa * 0.001953125f);   /* 2^-9 */
  uint32_t bits = magnitude == 0x7Fu ? 0x7FC00000u : magnitude < 8u ? subnormal : normal;
  return bits_to_float(sign | bits);
}

static inline int64_t item_size(int32_t elem_type) {
  return elem_type == ONNX_FLOAT ? 4 : elem_type == ONNX_INT8 || elem_type == ONNX_FLOAT8E4M3FN ? 1 : 2;
}

/* n elements of `elem_type` at src, widened to fp32 (a quantized type's stored value, unscaled). */
static inline void widen(float* dst, const void* src, int64_t n, int32_t elem_type) {
  if (elem_type == ONNX_FLOAT) {
    memcpy(dst, src, (size_t)n * sizeof(float));
  } else if (elem_type == ONNX_BFLOAT16) {
    const uint16_t* s = (const uint16_t*)src;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(s[i]);
  } else if (elem_type == ONNX_FLOAT16) {
    const uint16_t* s = (const uint16_t*)src;
    for (int64_t i = 0; i < n; i++) dst[i] = f16_to_float(s[i]);
  } else if (elem_type == ONNX_INT8) {
    const int8_t* s = (const int8_t*)src;
    for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
  } else {
    const uint8_t* s = (const uint8_t*)src;
    for (int64_t i = 0; i < n; i++) dst[i] = fp8e4m3fn_to_float(s[i]);
  }
}

static inline void narrow(void* dst, const float* src, int64_t n, int32_t elem_type) {
  if (elem_type == ONNX_FLOAT) {
    memcpy(dst, src, (size_t)n * sizeof(float));
  } else if (elem_type == ONNX_BFLOAT16) {
    uint16_t* d = (uint16_t*)dst;
    for (int64_t i = 0; i < n; i++) d[i] = float_to_bf16(src[i]);
  } else {
    uint16_t* d = (uint16_t*)dst;
    for (int64_t i = 0; i < n; i++) d[i] = float_to_f16(src[i]);
  }
}

#endif /* PAKV_FLOAT_H */
