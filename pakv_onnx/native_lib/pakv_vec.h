/* Vector pieces of the attention core: GCC/clang vector extensions of PAKV_W floats (define it before
 * including: 8 is one AVX register, or two SSE / NEON ones; 16 one AVX-512 register), so a unit
 * compiled for an instruction set keeps its accumulators in that set's registers. Header-only
 * (static inline): each unit that includes it compiles them for its own target. No libm. */
#ifndef PAKV_VEC_H
#define PAKV_VEC_H

#include <stdint.h>
#include <string.h>

#ifndef PAKV_W
#define PAKV_W 8
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi" /* vectors by value between inlined helpers: no ABI crosses */
#endif

typedef float vf __attribute__((vector_size(PAKV_W * 4)));
typedef int32_t vi __attribute__((vector_size(PAKV_W * 4)));

#define PAKV_VINLINE static inline __attribute__((always_inline))

PAKV_VINLINE vf vload(const float* p) {
  vf v;
  memcpy(&v, p, sizeof(v));
  return v;
}

PAKV_VINLINE void vstore(float* p, vf v) { memcpy(p, &v, sizeof(v)); }

/* PAKV_W bfloat16 at p, widened exactly (the upper half of each fp32): one zero-extension and a
 * shift (with AVX-512 the intrinsic: GCC splits the generic conversion in 256-bit halves). */
typedef uint16_t vh __attribute__((vector_size(PAKV_W * 2)));
PAKV_VINLINE vf vload_bf16(const void* p) {
#if PAKV_W == 16 && defined(__AVX512F__)
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
#else
  vh h;
  memcpy(&h, p, sizeof(h));
  return (vf)(__builtin_convertvector(h, vi) << 16);
#endif
}

PAKV_VINLINE vf vsplat(float x) { return x - (vf){0}; }

PAKV_VINLINE vf vselect(vi mask, vf yes, vf no) { return (vf)((mask & (vi)yes) | (~mask & (vi)no)); }

/* fp32 lanes rounded to the nearest float16 / bfloat16 (ties to even), kept as fp32: the bits of
 * f16_to_float(float_to_f16(x)) / bf16_to_float(float_to_bf16(x)) (pakv_float.h) for every non-NaN x,
 * overflow to +-inf included; a NaN stays a NaN (tests/test_vector_rounding.py). float16 with AVX-512:
 * the conversion instructions there and back (round to nearest even by their immediate, whatever
 * MXCSR's rounding mode; a third of the integer steps' time in a quantized decode). Elsewhere integer
 * steps on the bits (no rounding-mode or denormal-mode dependence but the fp32 add of float16's
 * subnormal range, which rounds to nearest even as every fp32 operation here does); unsigned lanes: a
 * carry never overflows a signed int. */
typedef uint32_t vu __attribute__((vector_size(PAKV_W * 4)));
PAKV_VINLINE vf vround_f16(vf x) {
#if PAKV_W == 16 && defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  const vu bits = (vu)x, magnitude = bits & 0x7FFFFFFFu;
  /* Normal halves: the 13 dropped mantissa bits rounded to even (a carry into the exponent is right);
   * 65520 and above round to 2^16, past the largest half: infinity. */
  const vu normal = (magnitude + 0xFFFu + ((magnitude >> 13) & 1u)) & ~0x1FFFu;
  vf rounded = vselect((vi)(normal >= 0x47800000u), vsplat(__builtin_inff()), (vf)normal);
  /* Below 2^-14 (the smallest normal half): multiples of 2^-24, by adding 0.5 (whose ulp is 2^-24) and
   * taking it away again (exact). */
  rounded = vselect((vi)(magnitude < 0x38800000u), ((vf)magnitude + vsplat(0.5f)) - vsplat(0.5f), rounded);
  return vselect((vi)(magnitude > 0x7F800000u), x, (vf)((vu)rounded | (bits & 0x80000000u)));
#endif
}

PAKV_VINLINE vf vround_bf16(vf x) {
  const vu bits = (vu)x;
  const vu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & ~0xFFFFu;
  return vselect((vi)((bits & 0x7FFFFFFFu) > 0x7F800000u), x, (vf)rounded);
}

/* The high half of a vector onto its low half, op'd: log2(PAKV_W) steps to one lane. */
#if PAKV_W == 16
#define PAKV_FOLD(v, op)                                                                                   \
  do {                                                                                                     \
    v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));      \
    v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));      \
    v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));      \
    v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));      \
  } while (0)
#elif PAKV_W == 8
#define PAKV_FOLD(v, op)                                                                                   \
  do {                                                                                                     \
    v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));                                      \
    v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));                                      \
    v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));                                      \
  } while (0)
#else
#define PAKV_FOLD(v, op)                                                                                   \
  do {                                                                                                     \
    v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1));                                                  \
    v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2));                                                  \
  } while (0)
#endif

PAKV_VINLINE vf vmax2(vf a, vf b) { return vselect(b > a, b, a); }
PAKV_VINLINE vf vadd2(vf a, vf b) { return a + b; }
PAKV_VINLINE vi vor2(vi a, vi b) { return a | b; }

/* The largest lane (NaN lanes lose), the sum of the lanes, whether any lane is nonzero. */
PAKV_VINLINE float vmax_all(vf v) {
  PAKV_FOLD(v, vmax2);
  return v[0];
}

PAKV_VINLINE float vsum_all(vf v) {
  PAKV_FOLD(v, vadd2);
  return v[0];
}

PAKV_VINLINE int vany(vi v) {
  PAKV_FOLD(v, vor2);
  return v[0] != 0;
}

/* e^x for x <= 0 (a score minus a running max), relative error ~2e-7: x = k ln2 + r with |r| <=
 * ln2 / 2 (ln2 split in two for precision), e^r by its degree-6 polynomial, 2^k through the
 * exponent bits. Below -87 (-inf included) the result is e^-87 ~ 1.6e-38 instead of its true tinier
 * value; NaN lanes must be masked by the caller. */
PAKV_VINLINE vf vexp_nonpositive(vf x) {
  const vf floor_x = vsplat(-87.0f);
  x = vselect(x < floor_x, floor_x, x);
  vf t = x * vsplat(1.44269504088896341f) - vsplat(0.5f);
  vi k = __builtin_convertvector(t, vi); /* t <= -0.5: truncation rounds x / ln2 to nearest */
  vf kf = __builtin_convertvector(k, vf);
  vf r = (x - kf * vsplat(0.693359375f)) + kf * vsplat(2.12194440e-4f);
  vf p = vsplat(1.9875691500e-4f);
  p = p * r + vsplat(1.3981999507e-3f);
  p = p * r + vsplat(8.3334519073e-3f);
  p = p * r + vsplat(4.1665795894e-2f);
  p = p * r + vsplat(1.6666665459e-1f);
  p = p * r + vsplat(5.0000001201e-1f);
  p = p * r * r + r + vsplat(1.0f);
  return p * (vf)((k + 127) << 23);
}

PAKV_VINLINE float exp_nonpositive(float x) { return vexp_nonpositive(vsplat(x))[0]; }

/* tanh(x), relative error ~3e-7 (no libm): an odd Taylor polynomial to x^15 below |x| = 0.4 (where
 * 1 - e^(-2|x|) would cancel), else (1 - e^(-2|x|)) / (1 + e^(-2|x|)) with x's sign; tanh(+-inf) =
 * +-1, NaN stays NaN. */
PAKV_VINLINE vf vtanh(vf x) {
  const vi sign_bit = (vi){0} | (int32_t)0x80000000;
  const vf x2 = x * x;
  const vi sign = (vi)x & sign_bit, nan = x != x;
  const vf magnitude = (vf)((vi)x & ~sign_bit);
  vf p = vsplat(-1.4558343870513183e-3f);
  p = p * x2 + vsplat(3.5921280365724810e-3f);
  p = p * x2 + vsplat(-8.8632355299021966e-3f);
  p = p * x2 + vsplat(2.1869488536155203e-2f);
  p = p * x2 + vsplat(-5.3968253968253968e-2f);
  p = p * x2 + vsplat(1.3333333333333333e-1f);
  p = p * x2 + vsplat(-3.3333333333333333e-1f);
  const vf small = x + x * x2 * p;
  const vf t = vexp_nonpositive(vselect(nan, vsplat(0.0f), magnitude * vsplat(-2.0f)));
  const vf large = (vf)((vi)((vsplat(1.0f) - t) / (vsplat(1.0f) + t)) | sign);
  return vselect(nan, x, vselect(magnitude < vsplat(0.4f), small, large));
}

/* In-register transpose of PAKV_W rows of PAKV_W floats: 8 x 8 with the in-lane unpack / shuffle /
 * 128-bit permute sequence AVX has as single instructions (24 shuffles); 16 x 16 by four rounds of
 * full-width interleaves (AVX-512's two-source permute, 64 shuffles); 4 x 4 by two. */
#if PAKV_W == 8
PAKV_VINLINE void vtranspose(vf* r) {
  vf t[8], u[8];
  for (int i = 0; i < 4; i++) {
    t[2 * i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[2 * i + 1] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 2; j++) {
      u[4 * i + 2 * j] = __builtin_shufflevector(t[4 * i + j], t[4 * i + j + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      u[4 * i + 2 * j + 1] = __builtin_shufflevector(t[4 * i + j], t[4 * i + j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  for (int i = 0; i < 4; i++) {
    r[i] = __builtin_shufflevector(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[i + 4] = __builtin_shufflevector(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}
#elif PAKV_W == 16
PAKV_VINLINE void vtranspose(vf* r) {
  for (int round = 0; round < 4; round++) {
    vf next[16];
    for (int i = 0; i < 8; i++) {
      next[2 * i] = __builtin_shufflevector(r[i], r[i + 8], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      next[2 * i + 1] =
          __builtin_shufflevector(r[i], r[i + 8], 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    }
    memcpy(r, next, sizeof(next));
  }
}
#elif PAKV_W == 4
PAKV_VINLINE void vtranspose(vf* r) {
  for (int round = 0; round < 2; round++) {
    vf next[4];
    for (int i = 0; i < 2; i++) {
      next[2 * i] = __builtin_shufflevector(r[i], r[i + 2], 0, 4, 1, 5);
      next[2 * i + 1] = __builtin_shufflevector(r[i], r[i + 2], 2, 6, 3, 7);
    }
    memcpy(r, next, sizeof(next));
  }
}
#else
#error "PAKV_W must be 4, 8 or 16"
#endif

#endif /* PAKV_VEC_H */
