/* The prologue core of com.microsoft::PagedAttention (pakv_fused.h): each new token's key and value
 * written into its slot, the query rows prepared, then the attention core (pakv_attention.c) over the
 * updated caches. No ONNX Runtime, no Python, no libm.
 *
 * The bytes written are those of ORT's CUDA kernel (paged_attention_impl.cu: QkNormRotaryTNH, then
 * ReshapeAndCache / QuantizeToCache), operation for operation as onnxruntime-gpu 1.31.1 compiles them
 * for sm_90a (read from its SASS; docs/ort-paged-attention.md "Cache bytes"). A key or query head:
 *   RMSNorm   fp32 squares x_c x_c, summed by a tree over the smallest power of two >= max(32, D)
 *             lanes (lane c adds lane c + stride, stride halving), mean = sum / D, + eps, inverse
 *             square root (the GPU's is approximate: see inverse_sqrt), then fp32 (x_c x inv) x w_c,
 *             rounded to T
 *   rotary    pairs (a, b) with cos c, sin s of the token's position, sign -1 for the pair's first:
 *             float16 (half arithmetic): T(a c + T(sign b s)), one fused multiply-add
 *             bfloat16 (through fp32, rounded to T after every operation): T(T(a c) + T(T(sign b) s))
 *             float32 (not ORT's; the float16 form in fp32): fp32(a c + fp32(sign b s))
 *             channels outside [rotary_offset, rotary_offset + rotary_dim) pass
 *   store     T rows as they are; quantized caches q = (scale != 0 ? x / scale : 0) in fp32, then
 *             int8: max(q, -128) (NaN -> -128), min(., 127), round half to even;
 *             float8e4m3fn: min(q, 448) (NaN -> 448), max(., -448), rounded to nearest even.
 * Products of two T values are exact in double, so every fp32 / T rounding here is computed as one
 * rounding of an exact double value (contraction by the compiler cannot change it). Values are read
 * from the rows the plan names and never from the caches, so a token's rows may be written in any
 * order (slots are distinct: the validator checked). */
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "pakv_float.h"
#include "pakv_fused.h"

/* Tokens of a call below this many written elements (N x (Hq + 2 Hk) x D) run on the calling thread. */
#define PAKV_FUSED_PARALLEL_MIN (1 << 16)
/* The largest head size whose scratch (2 D + lanes floats) is computed without overflow. */
#define PAKV_FUSED_MAX_SCRATCH_HEAD ((int64_t)1 << 40)
/* Head sizes up to this take their prologue scratch (2 D + reduction_lanes(D) floats) on the stack. */
#define PAKV_FUSED_STACK_HEAD 256
/* Elements per part of a parallel prologue. */
#define PAKV_FUSED_PART_ELEMENTS (1 << 14)

/* ------------------------------------------------------------------------------------------- */
/* Elements                                                                                    */
/* ------------------------------------------------------------------------------------------- */
/* f rounded to the query type T (fp32: itself). */
static inline float round_to(float f, int32_t type) {
  if (type == ONNX_BFLOAT16) return bf16_to_float(float_to_bf16(f));
  if (type == ONNX_FLOAT16) return f16_to_float(float_to_f16(f));
  return f;
}

static inline float element_at(const void* base, int64_t i, int32_t type) {
  if (type == ONNX_FLOAT) {
    float f;
    memcpy(&f, (const char*)base + i * 4, 4);
    return f;
  }
  uint16_t h;
  memcpy(&h, (const char*)base + i * 2, 2);
  return type == ONNX_BFLOAT16 ? bf16_to_float(h) : f16_to_float(h);
}

/* Round half to even of |v| < 2^22 (fp32 addition rounds to nearest even). */
static inline float round_half_even(float v) {
  const float magic = 12582912.0f; /* 1.5 x 2^23 */
  return v >= 0.0f ? (v + magic) - magic : -((-v + magic) - magic);
}

/* q clamped as ORT's kernel clamps it (fmaxf(q, -128), then fminf(., 127): NaN -> -128), rounded half to even. */
static inline int8_t quantize_int8(float q) {
  q = q > -128.0f ? q : -128.0f;
  q = q < 127.0f ? q : 127.0f;
  return (int8_t)(int)round_half_even(q);
}

/* A finite |v| <= 448 as float8e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits, no inf),
 * rounded to nearest even; subnormals are m x 2^-9. */
static inline uint8_t to_e4m3fn(float v) {
  uint32_t bits = float_to_bits(v), sign = (bits >> 24) & 0x80u, magnitude = bits & 0x7FFFFFFFu;
  int exponent = (int)(magnitude >> 23) - 127;
  if (magnitude == 0) return (uint8_t)sign;
  if (exponent < -6) { /* below 2^-6: m = |v| x 2^9, rounded to an integer 0 .. 8 (8 is 2^-6 itself) */
    uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
    int shift = 14 - exponent; /* |v| x 2^9 = mantissa x 2^(exponent + 9 - 23) */
    if (shift >= 32) return (uint8_t)sign;
    uint32_t q = mantissa >> shift, rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1);
    q += rest > half || (rest == half && (q & 1u));
    return (uint8_t)(sign | q);
  }
  magnitude += 0x7FFFFu + ((magnitude >> 20) & 1u); /* round the 20 dropped mantissa bits to nearest even */
  uint32_t e = (magnitude >> 23) - 127 + 7, m = (magnitude >> 20) & 7u;
  return (uint8_t)(sign | (e << 3) | m);
}

static inline uint8_t quantize_e4m3fn(float v) {
  v = v < 448.0f ? v : 448.0f;    /* fminf(448, v): NaN -> 448 */
  v = v > -448.0f ? v : -448.0f;  /* fmaxf(-448, v) */
  return to_e4m3fn(v);
}

/* Store n values (exactly representable in T) at dst as the cache's type: T itself, or quantized
 * with scale[c] (PER_CHANNEL: scale + the head's first channel) / scale[0] (PER_TENSOR). */
static void store_row(void* dst, const float* values, int64_t n, int32_t cache_type, int32_t quant, const float* scale) {
  if (cache_type != PAKV_ONNX_INT8 && cache_type != PAKV_ONNX_FLOAT8E4M3FN) {
    narrow(dst, values, n, cache_type);
    return;
  }
  for (int64_t c = 0; c < n; c++) {
    float s = quant == PAKV_QUANT_PER_CHANNEL ? scale[c] : scale[0];
    float q = s != 0.0f ? values[c] / s : 0.0f; /* a division, as the CUDA kernel's (not x times 1 / s) */
    if (cache_type == PAKV_ONNX_INT8) ((int8_t*)dst)[c] = quantize_int8(q);
    else ((uint8_t*)dst)[c] = quantize_e4m3fn(q);
  }
}

/* ------------------------------------------------------------------------------------------- */
/* One head: norm, rotary                                                                      */
/* ------------------------------------------------------------------------------------------- */
/* 2^k as a double, -1022 <= k <= 1023. */
static inline double power_of_two(int k) {
  uint64_t bits = (uint64_t)(k + 1023) << 52;
  double d;
  memcpy(&d, &bits, sizeof(d));
  return d;
}

/* hi + lo (|lo| <= half an ulp of hi, hi a normal double or zero) rounded once, to nearest even, to
 * a binary format of `bits` significand bits whose smallest step is 2^min_step (float16: 11, -24;
 * float32: 24, -149). The result is exactly representable there (or beyond its largest value, which
 * the caller's conversion turns into infinity, as the rounding would). */
static double round_once(double hi, double lo, int bits, int min_step) {
  if (hi == 0.0 || hi != hi || hi - hi != 0.0) return hi; /* zero, NaN, infinity */
  uint64_t b;
  memcpy(&b, &hi, sizeof(b));
  int step = (int)((b >> 52) & 0x7FF) - 1023 - (bits - 1);
  if (step < min_step) step = min_step;
  double m = hi * power_of_two(-step); /* exact: a power of two */
  const double magic = 6755399441055744.0; /* 1.5 x 2^52: adding it rounds |m| < 2^51 to an integer, ties even */
  double r = (m + magic) - magic;
  /* hi exactly halfway: the exact value is on lo's side of it. */
  if (m - r == 0.5 && lo > 0.0) r += 1.0;
  if (m - r == -0.5 && lo < 0.0) r -= 1.0;
  if (r == 0.0) return hi < 0.0 ? -0.0 : 0.0; /* a value too small for T keeps its sign, as IEEE's rounding does */
  return r * power_of_two(step);
}

/* hi + lo (as round_once's) rounded once to fp32, the same value as round_once(hi, lo, 24, -149), in a few
 * instructions: hi is first rounded to odd (when lo != 0 and hi's last bit is even, hi steps one double ulp
 * toward lo: the exact sum lies strictly between hi and that neighbour), and a value rounded to odd with 53
 * bits is rounded to nearest even with 24 (or fewer, subnormal) bits as the exact value is, since 53 >= 24 + 2
 * (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to
 * odd", IEEE TC 2008). */
static inline float round_once_to_float(double hi, double lo) {
  if (lo != 0.0 && hi - hi == 0.0) { /* inexact, hi finite (lo != 0 rules out hi == 0) */
    uint64_t b;
    memcpy(&b, &hi, sizeof(b));
    if (!(b & 1u)) b += (lo > 0.0) == (hi > 0.0) ? 1 : (uint64_t)-1; /* one ulp away from / toward zero */
    memcpy(&hi, &b, sizeof(b));
  }
  return (float)hi;
}

/* a c + t (a, c T values: the product is exact in double; t a T value) rounded once to T, as one
 * fused multiply-add in T's arithmetic. */
static inline float fused_multiply_add(double a, double c, double t, int32_t type) {
  double p = a * c, hi = p + t, back = hi - p;
  double lo = (p - (hi - back)) + (t - back); /* hi + lo == p + t exactly (two-sum) */
  return type == ONNX_FLOAT16 ? (float)round_once(hi, lo, 11, -24) : round_once_to_float(hi, lo);
}

/* One output channel of the rotation: a c + sign b s at T's operations (see the header). */
static inline float rotate(float a, float b, float c, float s, float sign, int32_t type) {
  if (type == ONNX_BFLOAT16) {
    float ac = round_to((float)((double)a * c), type);           /* T(a c) */
    float bs = round_to((float)((double)(sign * b) * s), type);  /* T(T(sign b) s): sign b is exact */
    return round_to((float)((double)ac + (double)bs), type);     /* T(fp32(ac + bs)) */
  }
  float bs = type == ONNX_FLOAT16 ? (float)round_once((double)(sign * b) * s, 0.0, 11, -24)
                                  : (float)((double)(sign * b) * s);
  return fused_multiply_add(a, c, bs, type);
}

/* 1 / sqrt(m) rounded to fp32. ORT's kernel calls rsqrtf, one MUFU.RSQ instruction, whose result is
 * within 2 units in the last place but not specified to the bit; this is the correctly rounded
 * value, which it matches where the hardware's rounds the same (docs/ort-paged-attention.md). */
static inline float inverse_sqrt(float m) { return (float)(1.0 / __builtin_sqrt((double)m)); }

/* Lanes of ORT's norm reduction for head size d: the smallest power of two >= max(32, d). */
static int64_t reduction_lanes(int64_t d) {
  int64_t lanes = 32;
  while (lanes < d && lanes < PAKV_FUSED_MAX_SCRATCH_HEAD) lanes <<= 1;
  return lanes;
}

/* The fp32 sum of x_c^2 in ORT's tree order (lanes: reduction_lanes(d) floats of scratch). */
static float sum_of_squares(const float* x, int64_t d, float* lanes) {
  int64_t width = reduction_lanes(d);
  for (int64_t c = 0; c < width; c++) lanes[c] = c < d ? (float)((double)x[c] * x[c]) : 0.0f;
  for (int64_t stride = width >> 1; stride > 0; stride >>= 1)
    for (int64_t c = 0; c < stride; c++) lanes[c] = lanes[c] + lanes[c + stride];
  return lanes[0];
}

/* An fp32 head at src (D floats, any alignment) rotated at `position` into out: prepare_head's values for
 * T = float32 without a norm weight (pairs as there; each channel fp32(a c + fp32(sign b s)), one rounding). */
static void rotate_f32_head(const pakv_fused_plan* p, const float* src, int64_t position, float* out) {
  memcpy(out, src, (size_t)p->head_dim * sizeof(float));
  if (p->rotary_dim == 0) return;
  const int64_t half = p->rotary_dim / 2, step = p->rotary_interleaved ? 2 : 1, apart = p->rotary_interleaved ? 1 : half;
  const float *cos = (const float*)p->cos_cache + position * half, *sin = (const float*)p->sin_cache + position * half;
  float* rotated = out + p->rotary_offset;
  for (int64_t i = 0; i < half; i++) {
    const int64_t first = i * step, second = first + apart;
    const float a = rotated[first], b = rotated[second], c = cos[i], s = sin[i];
    rotated[first] = fused_multiply_add(a, c, (float)((double)-b * s), ONNX_FLOAT);
    rotated[second] = fused_multiply_add(b, c, (float)((double)a * s), ONNX_FLOAT);
  }
}

/* The head at src (D elements of T) through the norm (weight may be NULL) and rotary at `position`,
 * into out (D floats, each a T value); `normed` is D floats and `lanes` reduction_lanes(D) floats of
 * scratch. */
static void prepare_head(const pakv_fused_plan* p, const void* src, const void* weight, int64_t position, float* normed,
                         float* lanes, float* out) {
  const int64_t d = p->head_dim;
  const int32_t type = p->query_type;
  if (type == ONNX_FLOAT && !weight) { /* fp32, no norm (a decoder's usual head): the same values, no conversions */
    rotate_f32_head(p, (const float*)src, position, out);
    return;
  }
  for (int64_t c = 0; c < d; c++) normed[c] = element_at(src, c, type);
  if (weight) {
    float mean = sum_of_squares(normed, d, lanes) / (float)d;
    float inverse = inverse_sqrt(mean + p->epsilon);
    for (int64_t c = 0; c < d; c++) {
      float scaled = (float)((double)normed[c] * inverse);                              /* fp32 x inv */
      normed[c] = round_to((float)((double)scaled * element_at(weight, c, type)), type); /* fp32 . w, T */
    }
  }
  memcpy(out, normed, (size_t)d * sizeof(float));
  if (p->rotary_dim == 0) return;
  const int64_t half = p->rotary_dim / 2, offset = p->rotary_offset;
  const int64_t row = position * half; /* cos / sin row of this position */
  /* Pair i (angle i): channels (2i, 2i + 1) interleaved or (i, i + half); the first of a pair takes
   * a c - b s, the second b c + a s. */
  const int64_t step = p->rotary_interleaved ? 2 : 1, apart = p->rotary_interleaved ? 1 : half;
  const float* in = normed + offset;
  float* rotated = out + offset;
  for (int64_t i = 0; i < half; i++) {
    float c = element_at(p->cos_cache, row + i, type), s = element_at(p->sin_cache, row + i, type);
    int64_t first = i * step, second = first + apart;
    float a = in[first], b = in[second];
    rotated[first] = rotate(a, b, c, s, -1.0f, type);
    rotated[second] = rotate(b, a, c, s, 1.0f, type);
  }
}

/* ------------------------------------------------------------------------------------------- */
/* Tokens                                                                                      */
/* ------------------------------------------------------------------------------------------- */
/* The scales of kv head g: PER_CHANNEL its D channels' (scale + g x D), PER_TENSOR the one scale. */
static const float* head_scale(const float* scale, int32_t quant, int64_t g, int64_t d) {
  return quant == PAKV_QUANT_PER_CHANNEL ? scale + g * d : scale;
}

/* Tokens [t0, t1): their query rows (when prepared) and their key / value rows (when they have a slot). */
static void prologue_tokens(const pakv_fused_plan* p, int64_t t0, int64_t t1, float* scratch) {
  const int64_t d = p->head_dim, item = p->query_type == ONNX_FLOAT ? 4 : 2;
  const int64_t cache_item = p->cache_type == PAKV_ONNX_INT8 || p->cache_type == PAKV_ONNX_FLOAT8E4M3FN ? 1 : item;
  float *normed = scratch, *row = scratch + d, *lanes = scratch + 2 * d;
  for (int64_t t = t0; t < t1; t++) {
    int64_t position = p->positions[t], slot = p->slots[t];
    if (p->prepare_query)
      for (int64_t h = 0; h < p->num_heads; h++) {
        prepare_head(p, (const char*)p->query + t * p->query_token_stride + h * d * item, p->q_norm_weight, position,
                     normed, lanes, row);
        narrow((char*)p->query_rows + (t * p->num_heads + h) * d * item, row, d, p->query_type);
      }
    if (slot < 0) continue;
    int64_t block = slot / p->block_size, at = slot % p->block_size;
    char* key_row = (char*)p->key_cache + block * p->key_block_stride + at * p->key_row_bytes;
    char* value_row = p->latent ? NULL : (char*)p->value_cache + block * p->value_block_stride + at * p->value_row_bytes;
    for (int64_t g = 0; g < p->num_kv_heads; g++) {
      prepare_head(p, (const char*)p->key + t * p->key_token_stride + g * d * item, p->k_norm_weight, position, normed,
                   lanes, row);
      store_row(key_row + g * d * cache_item, row, d, p->cache_type, p->key_quant, head_scale(p->key_scale, p->key_quant, g, d));
      if (p->latent) continue;
      for (int64_t c = 0; c < d; c++) row[c] = element_at((const char*)p->value + t * p->value_token_stride + g * d * item, c, p->query_type);
      store_row(value_row + g * d * cache_item, row, d, p->cache_type, p->value_quant,
                head_scale(p->value_scale, p->value_quant, g, d));
    }
  }
}

typedef struct {
  const pakv_fused_plan* plan;
  int64_t tokens_per_part;
  int no_memory;
} prologue_run;

static void run_part(void* data, size_t index) {
  prologue_run* run = (prologue_run*)data;
  const pakv_fused_plan* p = run->plan;
  int64_t t0 = (int64_t)index * run->tokens_per_part, t1 = t0 + run->tokens_per_part;
  float stack[2 * PAKV_FUSED_STACK_HEAD + PAKV_FUSED_STACK_HEAD]; /* lanes: reduction_lanes(<= 256) = 256 */
  float* scratch = p->head_dim <= PAKV_FUSED_STACK_HEAD ? stack
                   : p->head_dim <= PAKV_FUSED_MAX_SCRATCH_HEAD
                       ? (float*)malloc((size_t)(2 * p->head_dim + reduction_lanes(p->head_dim)) * sizeof(float))
                       : NULL; /* no memory holds such a head: out of memory, never an overflowing size */
  if (!scratch) {
    __atomic_store_n(&run->no_memory, 1, __ATOMIC_RELAXED);
    return;
  }
  prologue_tokens(p, t0, t1 < p->num_tokens ? t1 : p->num_tokens, scratch);
  if (scratch != stack) free(scratch);
}

/* ------------------------------------------------------------------------------------------- */
/* Checks and the run                                                                          */
/* ------------------------------------------------------------------------------------------- */
/* Elements one token's rows hold ((Hq + 2 Hk) x D) and the whole call's; -1 when they overflow int64. */
static int prologue_elements(const pakv_fused_plan* p, int64_t* per_token, int64_t* elements) {
  int64_t heads;
  if (pakv_mul(p->num_kv_heads, 2, &heads) || pakv_add(heads, p->num_heads, &heads) ||
      pakv_mul(heads, p->head_dim, per_token) || pakv_mul(*per_token, p->num_tokens, elements))
    return -1;
  return 0;
}

static int is_float(int32_t t) { return t == ONNX_FLOAT || t == ONNX_FLOAT16 || t == ONNX_BFLOAT16; }

int pakv_check_fused_plan(const pakv_fused_plan* p, pakv_err* err) {
  if (!p) return pakv_fail(err, "NULL fused attention plan");
  if (p->abi_version != PAKV_ABI_VERSION || p->struct_size != sizeof(pakv_fused_plan))
    return pakv_fail(err, "fused attention plan ABI mismatch: caller has version %u / %u bytes, library has %d / %zu bytes",
                     p->abi_version, p->struct_size, PAKV_ABI_VERSION, sizeof(pakv_fused_plan));
  int quantized = p->cache_type == PAKV_ONNX_INT8 || p->cache_type == PAKV_ONNX_FLOAT8E4M3FN;
  if (!is_float(p->query_type) || (p->cache_type != p->query_type && !quantized) ||
      (quantized && (p->key_quant == PAKV_QUANT_NONE || !p->key_scale ||
                     (!p->latent && (p->value_quant == PAKV_QUANT_NONE || !p->value_scale)))))
    return pakv_fail(err, "fused attention plan: types %d / %d and quantization %d / %d do not go together",
                     p->query_type, p->cache_type, p->key_quant, p->value_quant);
  if (p->num_tokens < 0 || p->num_heads < 1 || p->num_kv_heads < 1 || p->num_heads % p->num_kv_heads ||
      p->head_dim < 1 || p->block_size < 1 || p->num_blocks < 0 || p->rotary_dim < 0 || p->rotary_dim % 2 ||
      p->rotary_offset < 0 || p->rotary_offset > p->head_dim - p->rotary_dim || p->rotary_rows < 0)
    return pakv_fail(err, "fused attention plan: sizes out of range (tokens %lld, heads %lld / %lld, head_dim %lld, "
                     "rotary %lld + %lld)", (long long)p->num_tokens, (long long)p->num_heads, (long long)p->num_kv_heads,
                     (long long)p->head_dim, (long long)p->rotary_offset, (long long)p->rotary_dim);
  if (p->num_tokens && (!p->slots || !p->positions || !p->query || !p->key || (!p->latent && !p->value) ||
                        (p->normalize && (!p->q_norm_weight || !p->k_norm_weight)) ||
                        (p->rotary_dim && (!p->cos_cache || !p->sin_cache))))
    return pakv_fail(err, "fused attention plan: a NULL input pointer for %lld tokens", (long long)p->num_tokens);
  int64_t capacity, per_token, elements;
  if (pakv_mul(p->num_blocks, p->block_size, &capacity)) return pakv_fail(err, "fused attention plan: capacity overflows");
  if (prologue_elements(p, &per_token, &elements))
    return pakv_fail(err, "fused attention plan: %lld tokens x (%lld + 2 x %lld heads) x %lld channels overflow int64",
                     (long long)p->num_tokens, (long long)p->num_heads, (long long)p->num_kv_heads, (long long)p->head_dim);
  for (int64_t t = 0; t < p->num_tokens; t++) {
    if (p->slots[t] >= capacity || p->slots[t] < -1 || p->positions[t] < 0 ||
        (p->rotary_dim && p->positions[t] >= p->rotary_rows))
      return pakv_fail(err, "fused attention plan: token %lld has slot %lld of %lld and position %lld of %lld",
                       (long long)t, (long long)p->slots[t], (long long)capacity, (long long)p->positions[t],
                       (long long)p->rotary_rows);
  }
  pakv_attention_plan attention = p->attention; /* checked as it will run: the query rows bound later */
  if (p->prepare_query && !attention.query) attention.query = p->query;
  return pakv_check_attention_plan(&attention, err);
}

/* [lo, hi]: the lowest and highest byte the prologue writes in one cache (Norm rows at each token's slot);
 * lo NULL when it writes none there. */
static void written_span(const pakv_fused_plan* p, char* cache, int64_t stride, int64_t row, char** lo, char** hi) {
  *lo = *hi = NULL;
  for (int64_t t = 0; cache && row > 0 && t < p->num_tokens; t++) {
    if (p->slots[t] < 0) continue;
    char* first = cache + (p->slots[t] / p->block_size) * stride + (p->slots[t] % p->block_size) * row;
    if (!*lo || first < *lo) *lo = first;
    if (!*hi || first + row - 1 > *hi) *hi = first + row - 1;
  }
}

/* A read-only or unmapped cache is an error before anything is written (pakv_writable.c), never a signal. */
static int check_caches_writable(const pakv_fused_plan* p, pakv_err* err) {
  char *lo[2], *hi[2];
  const char* names[2] = {"key_cache", "value_cache"};
  written_span(p, (char*)p->key_cache, p->key_block_stride, p->key_row_bytes, &lo[0], &hi[0]);
  written_span(p, p->latent ? NULL : (char*)p->value_cache, p->value_block_stride, p->value_row_bytes, &lo[1], &hi[1]);
  return pakv_check_spans_writable(lo, hi, names, 2, err);
}

int pakv_run_fused_on(const pakv_fused_plan* p, const pakv_parallel* par, pakv_err* err) {
  if (pakv_check_fused_plan(p, err)) return -1;
  if (p->num_tokens && (!p->key_cache || (!p->latent && !p->value_cache) ||
                        (p->prepare_query && (!p->query_rows || p->attention.query != p->query_rows))))
    return pakv_fail(err, "fused attention: the plan is not bound to its caches and query rows (pakv_fused_bind)");
  if (check_caches_writable(p, err)) return -1;
  int64_t per_token = 1, elements = 0;
  prologue_elements(p, &per_token, &elements); /* fits: pakv_check_fused_plan */
  prologue_run run = {p, p->num_tokens, 0};
  run.tokens_per_part = PAKV_FUSED_PART_ELEMENTS / per_token > 0 ? PAKV_FUSED_PART_ELEMENTS / per_token : 1;
  int64_t parts = p->num_tokens / run.tokens_per_part + (p->num_tokens % run.tokens_per_part != 0);
  if (par && parts >= 2 && elements >= PAKV_FUSED_PARALLEL_MIN) {
    if (par->run(par->host, run_part, (size_t)parts, &run))
      for (int64_t i = 0; i < parts; i++) run_part(&run, (size_t)i); /* the pool ran none: here */
  } else if (p->num_tokens) {
    run.tokens_per_part = p->num_tokens;
    run_part(&run, 0);
  }
  if (run.no_memory)
    return pakv_fail(err, "fused attention: out of memory for a scratch of %lld floats",
                     (long long)(2 * p->head_dim + reduction_lanes(p->head_dim)));
  return pakv_run_attention_on(&p->attention, par, err);
}

/* Exported: whether a checked plan's caches can be written where its prologue writes (what a Python backend
 * asks before it writes host caches; the C run asks itself). 0, or nonzero with the message at err_out. */
PAKV_EXPORT int pakv_fused_writable(const pakv_fused_plan* plan, char* err_out, size_t err_len) {
  pakv_err err;
  err.msg[0] = 0;
  int rc = pakv_check_fused_plan(plan, &err) || check_caches_writable(plan, &err);
  if (rc && err_out && err_len) snprintf(err_out, err_len, "%s", err.msg);
  return rc;
}

/* Exported entry point (the native Python backend): check and run on the calling thread. */
PAKV_EXPORT int pakv_fused_attention(const pakv_fused_plan* plan, char* err_out, size_t err_len) {
  pakv_err err;
  err.msg[0] = 0;
  int rc = pakv_run_fused_on(plan, NULL, &err);
  if (rc && err_out && err_len) {
    size_t n = strlen(err.msg);
    if (n >= err_len) n = err_len - 1;
    memcpy(err_out, err.msg, n);
    err_out[n] = 0;
  }
  return rc;
}
