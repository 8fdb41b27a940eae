/* The fp32 rotary's one rounding (pakv_fused.c): round_once_to_float(hi, lo), the round-to-odd form,
 * against round_once(hi, lo, 24, -149), the exact form it replaced, on a c + t as fused_multiply_add forms
 * them. Compiled by tests/test_fused_rounding.py with pakv_fused.c included, so the file's own static
 * functions are the ones compared (loaded lazily: the library functions it calls are never reached). */
#include "pakv_fused.c"

static uint64_t g_state;
static uint64_t next_random(void) { /* xorshift64* */
  g_state ^= g_state >> 12, g_state ^= g_state << 25, g_state ^= g_state >> 27;
  return g_state * 2685821657736338717ull;
}

/* A float of random sign and mantissa, its exponent uniform in [lo, hi] (below -126: subnormal or zero). */
static float random_float(int lo, int hi) {
  uint64_t r = next_random();
  int e = lo + (int)(r % (uint64_t)(hi - lo + 1));
  double m = 1.0 + (double)((r >> 20) & 0x7FFFFF) / 8388608.0;
  float f = (float)(m * (e >= -1022 ? power_of_two(e) : 0.0));
  return (r >> 63) ? -f : f;
}

/* a c + t both ways; 1 when the two roundings differ (bitwise). */
static int differs(float a, float c, float t) {
  double p = (double)a * c, hi = p + t, back = hi - p;
  double lo = (p - (hi - back)) + (t - back);
  float fast = round_once_to_float(hi, lo), exact = (float)round_once(hi, lo, 24, -149);
  return float_to_bits(fast) != float_to_bits(exact);
}

/* Mismatches over n random triples from `seed` (exponents wide enough for products far below and above t,
 * subnormal results, overflow to infinity). */
int64_t pakv_test_rounding_mismatches(uint64_t seed, int64_t n) {
  int64_t bad = 0;
  g_state = seed | 1;
  for (int64_t i = 0; i < n; i++) {
    float a = random_float(-80, 70), c = random_float(-80, 70), t = random_float(-150, 127);
    bad += differs(a, c, t);
    bad += differs(a, c, -(float)((double)a * c)); /* cancellation: hi + lo is the product's rounding error */
  }
  return bad;
}

/* a c + t whose double sum hi lands exactly halfway between two floats, the exact sum just below it:
 * t = 1 + 2^-23, a c = 2^-24 - 2^-70 (a = 2^-24 (1 + 2^-23), c = 1 - 2^-23). The result (its bits) of
 * round_once_to_float; `naive` gets (float)hi, the double rounding the round-to-odd step avoids. */
uint32_t pakv_test_rounding_halfway(int naive) {
  float a = (float)(power_of_two(-24) * (1.0 + power_of_two(-23))), c = (float)(1.0 - power_of_two(-23));
  float t = (float)(1.0 + power_of_two(-23));
  double p = (double)a * c, hi = p + t, back = hi - p;
  double lo = (p - (hi - back)) + (t - back);
  return float_to_bits(naive ? (float)hi : round_once_to_float(hi, lo));
}

/* round_once of -2^-160 (far below float32's smallest step, 2^-149) and of -2^-30 (below float16's, 2^-24),
 * as float32 bits: a negative value rounded to zero stays negative (-0). */
uint32_t pakv_test_round_once_tiny_negative(int half) {
  return float_to_bits((float)(half ? round_once(-power_of_two(-30), 0.0, 11, -24) : round_once(-power_of_two(-160), 0.0, 24, -149)));
}
