/* The attention walk's vector rounding to float16 / bfloat16 (pakv_vec.h: vround_f16, vround_bf16, as the
 * walk dequantizes ORT's way) against the scalar conversions of pakv_float.h (the cache write's, torch's
 * round to nearest even): the same bits for every non-NaN float, NaN for NaN. Compiled by
 * tests/test_vector_rounding.py at each walk width (-DPAKV_W=8 / 16), 16 also for AVX-512 as the
 * 16-float walk is. */
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h> /* -march=x86-64-v4: float16's rounding by the conversion instructions */
#endif

#include "pakv_float.h"
#include "pakv_vec.h"

/* 1 when the vector form's lane differs from the scalar one (both NaN counts as equal). */
static int differs(float got, float want) {
  if (want != want) return got == got;
  return float_to_bits(got) != float_to_bits(want);
}

/* Mismatches over `n` floats of bit patterns first + i * step (i < n, wrapping), in vectors of PAKV_W:
 * which = 0 float16, 1 bfloat16. */
int64_t pakv_test_vround_mismatches(uint32_t first, uint32_t step, int64_t n, int which) {
  int64_t bad = 0;
  uint32_t bits = first;
  for (int64_t i = 0; i < n; i += PAKV_W) {
    float lanes[PAKV_W], out[PAKV_W];
    for (int l = 0; l < PAKV_W; l++, bits += step) lanes[l] = bits_to_float(bits);
    vstore(out, which ? vround_bf16(vload(lanes)) : vround_f16(vload(lanes)));
    for (int l = 0; l < PAKV_W && i + l < n; l++) {
      const float x = lanes[l];
      bad += differs(out[l], which ? bf16_to_float(float_to_bf16(x)) : f16_to_float(float_to_f16(x)));
    }
  }
  return bad;
}
