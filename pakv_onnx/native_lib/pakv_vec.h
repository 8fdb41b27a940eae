/* Vector pieces of the attention core: GCC/clang vector extensions, 8 floats (one AVX register where
 * the CPU has it, two SSE / NEON registers otherwise), so accumulators stay in registers. Header-only
 * (static inline), so the core's target clones compile them for each instruction set. */
#ifndef PAKV_VEC_H
#define PAKV_VEC_H

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi" /* 32-byte vectors by value between inlined helpers: no ABI crosses */
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float* p) {
  v8f v;
  memcpy(&v, p, sizeof(v));
  return v;
}

static inline void store8(float* p, const v8f* v) { memcpy(p, v, sizeof(*v)); }

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

static inline float hsum8(const v8f* v) {
  return (((*v)[0] + (*v)[4]) + ((*v)[1] + (*v)[5])) + (((*v)[2] + (*v)[6]) + ((*v)[3] + (*v)[7]));
}

/* a . b over n floats. */
static inline float dot(const float* a, const float* b, int64_t n) {
  v8f s0 = splat8(0.0f), s1 = splat8(0.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 += load8(a + i) * load8(b + i);
    s1 += load8(a + i + 8) * load8(b + i + 8);
  }
  if (i + 8 <= n) {
    s0 += load8(a + i) * load8(b + i);
    i += 8;
  }
  float rest = 0.0f;
  for (; i < n; i++) rest += a[i] * b[i];
  s0 += s1;
  return hsum8(&s0) + rest;
}

/* a0 . b and a1 . b over n floats: b (a key row) is read once for two queries (GQA heads). */
static inline void dot2(const float* a0, const float* a1, const float* b, int64_t n, float* out0, float* out1) {
  v8f s0 = splat8(0.0f), s1 = splat8(0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8f x = load8(b + i);
    s0 += load8(a0 + i) * x;
    s1 += load8(a1 + i) * x;
  }
  float r0 = 0.0f, r1 = 0.0f;
  for (; i < n; i++) {
    r0 += a0[i] * b[i];
    r1 += a1[i] * b[i];
  }
  *out0 = hsum8(&s0) + r0;
  *out1 = hsum8(&s1) + r1;
}

/* y[0..n) += sum over rows r < count of w[r] * rows[r][0..n): the accumulators stay in registers
 * (blocks of 32 floats, then 8, then singles) while the value rows stream past. */
static inline void weighted_rows(float* y, const float* w, const float* const* rows, int64_t count, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    v8f y0 = load8(y + i), y1 = load8(y + i + 8), y2 = load8(y + i + 16), y3 = load8(y + i + 24);
    for (int64_t r = 0; r < count; r++) {
      const float* x = rows[r] + i;
      v8f a = splat8(w[r]);
      y0 += a * load8(x);
      y1 += a * load8(x + 8);
      y2 += a * load8(x + 16);
      y3 += a * load8(x + 24);
    }
    store8(y + i, &y0);
    store8(y + i + 8, &y1);
    store8(y + i + 16, &y2);
    store8(y + i + 24, &y3);
  }
  for (; i + 8 <= n; i += 8) {
    v8f y0 = load8(y + i);
    for (int64_t r = 0; r < count; r++) y0 += splat8(w[r]) * load8(rows[r] + i);
    store8(y + i, &y0);
  }
  for (; i < n; i++) {
    float sum = y[i];
    for (int64_t r = 0; r < count; r++) sum += w[r] * rows[r][i];
    y[i] = sum;
  }
}

static inline void scale_row(float* y, float a, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] *= a;
}

/* e^x for x <= 0 (a score minus the running max), 8 at a time, relative error ~2e-7: x = k ln2 + r
 * with |r| <= ln2 / 2 (ln2 split in two for precision), e^r by its degree-6 polynomial, 2^k through
 * the exponent bits. Below -87 the result is ~1e-38 instead of its true tinier value. */
static inline v8f exp8_nonpositive(const v8f* arg) {
  const v8f floor_x = splat8(-87.0f);
  v8f x = *arg;
  v8i low = x < floor_x; /* all ones where x is below (or NaN: never here) */
  x = (v8f)((low & (v8i)floor_x) | (~low & (v8i)x));
  v8f t = x * splat8(1.44269504088896341f) - splat8(0.5f);
  v8i k = __builtin_convertvector(t, v8i); /* t <= -0.5: truncation rounds x / ln2 to nearest */
  v8f kf = __builtin_convertvector(k, v8f);
  v8f r = (x - kf * splat8(0.693359375f)) + kf * splat8(2.12194440e-4f);
  v8f p = splat8(1.9875691500e-4f);
  p = p * r + splat8(1.3981999507e-3f);
  p = p * r + splat8(8.3334519073e-3f);
  p = p * r + splat8(4.1665795894e-2f);
  p = p * r + splat8(1.6666665459e-1f);
  p = p * r + splat8(5.0000001201e-1f);
  p = p * r * r + r + splat8(1.0f);
  return p * (v8f)((k + 127) << 23);
}

/* weights[0..count) = e^(scores - top), count rounded up to 8 (both arrays hold that many); a score
 * of -inf gets weight exactly 0 (the exponential alone would give its floor, ~1e-38). */
static inline void exp_rows(float* weights, const float* scores, float top, int64_t count) {
  const v8f minus_inf = splat8(-__builtin_inff());
  for (int64_t i = 0; i < count; i += 8) {
    v8f x = load8(scores + i) - splat8(top);
    v8i masked = x == minus_inf;
    v8f e = exp8_nonpositive(&x);
    e = (v8f)(~masked & (v8i)e);
    store8(weights + i, &e);
  }
}

/* tanh(x), 8 at a time, relative error ~3e-7 (no libm): an odd Taylor polynomial to x^15 below
 * |x| = 0.4 (where 1 - e^(-2|x|) would cancel), else (1 - e^(-2|x|)) / (1 + e^(-2|x|)) with x's sign;
 * tanh(+-inf) = +-1, NaN stays NaN. */
static inline v8f tanh8(const v8f* arg) {
  const v8i sign_bit = (v8i){0, 0, 0, 0, 0, 0, 0, 0} | (int32_t)0x80000000;
  v8f x = *arg, x2 = x * x;
  v8i sign = (v8i)x & sign_bit;
  v8f magnitude = (v8f)((v8i)x & ~sign_bit);
  v8f p = splat8(-1.4558343870513183e-3f);
  p = p * x2 + splat8(3.5921280365724810e-3f);
  p = p * x2 + splat8(-8.8632355299021966e-3f);
  p = p * x2 + splat8(2.1869488536155203e-2f);
  p = p * x2 + splat8(-5.3968253968253968e-2f);
  p = p * x2 + splat8(1.3333333333333333e-1f);
  p = p * x2 + splat8(-3.3333333333333333e-1f);
  v8f small = x + x * x2 * p;
  v8f negative = magnitude * splat8(-2.0f);
  v8i nan = magnitude != magnitude;
  negative = (v8f)(~nan & (v8i)negative); /* NaN lanes: exp of 0 (the select below keeps x) */
  v8f t = exp8_nonpositive(&negative);
  v8f large = (v8f)((v8i)((splat8(1.0f) - t) / (splat8(1.0f) + t)) | sign);
  v8i use_small = magnitude < splat8(0.4f);
  v8f result = (v8f)((use_small & (v8i)small) | (~use_small & (v8i)large));
  return (v8f)((nan & (v8i)x) | (~nan & (v8i)result));
}

/* scores[0..count) = cap * tanh(scores / cap), count rounded up to 8 (the array holds that many). */
static inline void softcap_rows(float* scores, float cap, int64_t count) {
  const v8f inverse = splat8(1.0f / cap), times = splat8(cap);
  for (int64_t i = 0; i < count; i += 8) {
    v8f x = load8(scores + i) * inverse;
    v8f t = tanh8(&x) * times;
    store8(scores + i, &t);
  }
}

#endif /* PAKV_VEC_H */
