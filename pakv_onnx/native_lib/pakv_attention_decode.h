/* Scores of a decode's few query rows (at most half a vector of rows per kv head), read straight
 * from the cache rows: no transposed copy of K (pakv_attention_walk.h includes this after
 * pakv_vec.h, once per vector width).
 *
 * A vector's lanes are RP rows x L consecutive head-dim elements (RP x L = PAKV_W, RP the rows
 * rounded up to a power of two): the query panel holds, per group of L elements, those elements of
 * every row; each key row's L elements are broadcast to all RP row groups, so one multiply-add
 * serves RP rows x L elements. L positions' partial sums are then added lane group by lane group
 * in log2(L) rounds of two-source shuffles (one per L positions, not per key: no horizontal sum per
 * key), leaving lanes [row][position]. Key rows are fp32: in place, or widened into scratch. */

/* The rounds' shuffles: per group of L lanes, a's even (odd) lanes, then b's. */
#if PAKV_W == 16
#define PAKV_EVEN_16 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define PAKV_ODD_16 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#define PAKV_EVEN_8 0, 2, 4, 6, 16, 18, 20, 22, 8, 10, 12, 14, 24, 26, 28, 30
#define PAKV_ODD_8 1, 3, 5, 7, 17, 19, 21, 23, 9, 11, 13, 15, 25, 27, 29, 31
#define PAKV_EVEN_4 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30
#define PAKV_ODD_4 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31
#define PAKV_EVEN_2 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define PAKV_ODD_2 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define PAKV_REPEAT_8 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7
#elif PAKV_W == 8
#define PAKV_EVEN_8 0, 2, 4, 6, 8, 10, 12, 14
#define PAKV_ODD_8 1, 3, 5, 7, 9, 11, 13, 15
#define PAKV_EVEN_4 0, 2, 8, 10, 4, 6, 12, 14
#define PAKV_ODD_4 1, 3, 9, 11, 5, 7, 13, 15
#define PAKV_EVEN_2 0, 8, 2, 10, 4, 12, 6, 14
#define PAKV_ODD_2 1, 9, 3, 11, 5, 13, 7, 15
#endif

/* L floats at p in every group of L lanes (as whole 2L-byte scalars, the forms GCC turns into one
 * broadcast load: a double for 2, an __int128 for 4, a 256-bit vector shuffled for 8). */
HOT vf broadcast_16(const float* p) { return vload(p); }

#if PAKV_W == 16 && defined(__AVX512F__) /* one load uop each (GCC's own forms take two) */
HOT vf broadcast_8(const float* p) { return (vf)_mm512_broadcast_f32x8(_mm256_loadu_ps(p)); }
HOT vf broadcast_4(const float* p) { return (vf)_mm512_broadcast_f32x4(_mm_loadu_ps(p)); }
#else
#if PAKV_W == 16
HOT vf broadcast_8(const float* p) {
  typedef float vf8 __attribute__((vector_size(32)));
  vf8 v;
  memcpy(&v, p, sizeof(v));
  return __builtin_shufflevector(v, v, PAKV_REPEAT_8);
}
#else
HOT vf broadcast_8(const float* p) { return vload(p); }
#endif

HOT vf broadcast_4(const float* p) {
#if defined(__SIZEOF_INT128__)
  typedef __int128 vq __attribute__((vector_size(PAKV_W * 4)));
  __int128 x;
  memcpy(&x, p, sizeof(x));
  return (vf)(x - (vq){0});
#else
  vf v;
  for (int i = 0; i < PAKV_W; i++) v[i] = p[i & 3];
  return v;
#endif
}
#endif

HOT vf broadcast_2(const float* p) {
  typedef double vd __attribute__((vector_size(PAKV_W * 4)));
  double x;
  memcpy(&x, p, sizeof(x));
  return (vf)(x - (vd){0});
}

/* The scores of `rows` (<= RP) query rows (stride d) over fp32 key rows [0, ncp) (ncp a multiple
 * of PAKV_W; rows past the chunk point at zeros) of dq elements (d, or the padded stride of widened
 * rows: the query panel is 0 past d), into scores [row][C]. `panel` holds dq x RP floats. */
#define PAKV_ROWS_SCORES(RP, L)                                                                            \
  HOT void rows_scores_##RP(const float* q, int64_t rows, int64_t d, int64_t dq, const float* const* keys,  \
                            int64_t ncp, float* panel, float* scores) {                                    \
    memset(panel, 0, sizeof(float) * (size_t)(dq * RP));                                                   \
    for (int64_t k = 0; k < d / L + (d % L != 0); k++)                                                     \
      for (int64_t r = 0; r < rows; r++) {                                                                 \
        float* to = panel + k * PAKV_W + r * L;                                                            \
        const float* from = q + r * d + k * L;                                                             \
        if (k * L + L <= d) memcpy(to, from, L * sizeof(float));                                           \
        else for (int64_t e = 0; e < d - k * L; e++) to[e] = from[e];                                      \
      }                                                                                                    \
    enum { SETS = L >= 8 ? 1 : 8 / L }; /* independent sums: 8 or more chains hide the FMA latency */      \
    const int64_t groups = dq / L;                                                                         \
    for (int64_t c = 0; c < ncp; c += L) {                                                                 \
      vf acc[L], more[SETS][L];                                                                            \
      for (int p = 0; p < L; p++) acc[p] = vsplat(0.0f);                                                   \
      for (int t = 0; t < SETS; t++)                                                                       \
        for (int p = 0; p < L; p++) more[t][p] = vsplat(0.0f);                                             \
      int64_t k = 0;                                                                                       \
      for (; k + SETS <= groups; k += SETS)                                                                \
        for (int t = 0; t < SETS; t++) {                                                                   \
          const vf x = vload(panel + (k + t) * PAKV_W);                                                    \
          for (int p = 0; p < L; p++) more[t][p] += x * broadcast_##L(keys[c + p] + (k + t) * L);          \
        }                                                                                                  \
      for (; k < groups; k++) {                                                                            \
        const vf x = vload(panel + k * PAKV_W);                                                            \
        for (int p = 0; p < L; p++) acc[p] += x * broadcast_##L(keys[c + p] + k * L);                      \
      }                                                                                                    \
      for (int t = 0; t < SETS; t++)                                                                       \
        for (int p = 0; p < L; p++) acc[p] += more[t][p];                                                  \
      for (int width = L; width > 1; width /= 2)                                                           \
        for (int i = 0; i < width / 2; i++)                                                                \
          acc[i] = __builtin_shufflevector(acc[2 * i], acc[2 * i + 1], PAKV_EVEN_##L) +                    \
                   __builtin_shufflevector(acc[2 * i], acc[2 * i + 1], PAKV_ODD_##L);                      \
      float lanes[PAKV_W];                                                                                 \
      vstore(lanes, acc[0]);                                                                               \
      for (int64_t r = 0; r < rows; r++) memcpy(scores + r * C + c, lanes + r * L, L * sizeof(float));     \
    }                                                                                                      \
  }

#if PAKV_W == 16
PAKV_ROWS_SCORES(1, 16)
PAKV_ROWS_SCORES(2, 8)
PAKV_ROWS_SCORES(4, 4)
PAKV_ROWS_SCORES(8, 2)
#define PAKV_ROWS_SCORES_MAX 8
#else
PAKV_ROWS_SCORES(1, 8)
PAKV_ROWS_SCORES(2, 4)
PAKV_ROWS_SCORES(4, 2)
#define PAKV_ROWS_SCORES_MAX 4
#endif

/* Decode scores of `rows` (1 .. PAKV_ROWS_SCORES_MAX) rows over fp32 key rows of dq elements. */
HOT void rows_scores(const float* q, int64_t rows, int64_t d, int64_t dq, const float* const* keys, int64_t ncp,
                     float* panel, float* scores) {
  if (rows == 1) rows_scores_1(q, rows, d, dq, keys, ncp, panel, scores);
  else if (rows == 2) rows_scores_2(q, rows, d, dq, keys, ncp, panel, scores);
  else if (rows <= 4) rows_scores_4(q, rows, d, dq, keys, ncp, panel, scores);
#if PAKV_ROWS_SCORES_MAX > 4
  else rows_scores_8(q, rows, d, dq, keys, ncp, panel, scores);
#endif
}
