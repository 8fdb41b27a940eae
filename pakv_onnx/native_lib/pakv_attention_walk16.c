/* The attention core's walk in 16-float vectors (pakv_attention_walk.h) for x86-64 CPUs with
 * AVX-512 (x86-64-v4: F, VL, BW, DQ), picked at run time when the CPU has them (and
 * PAKV_ONNX_ATTENTION_WIDTH is not 8). Tiles: 8 query rows x 32 keys of scores, 4 rows x 64 values
 * of output (16 accumulators of the 32 registers). Other builds have no 16-float walk. */
#include "pakv_attention_core.h"
#include "pakv_float.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(PAKV_NO_AVX512)
#include <immintrin.h> /* a few broadcasts the vector extensions do not express in one instruction */

int pakv_attention_walk16_usable(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
}

/* Only what follows is compiled for AVX-512 (the check above runs on any CPU). */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#endif
#define PAKV_WALK_ATTRIBUTES
#define PAKV_W 16
#define PAKV_WALK pakv_attention_walk16
#define PAKV_QK_ROWS 8
#define PAKV_PV_VECS 4
#include "pakv_attention_walk.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
int pakv_attention_walk16_usable(void) { return 0; }

int pakv_attention_walk16(const pakv_attention_plan* p, const pakv_attention_part* part, pakv_part_state* s) {
  return pakv_attention_walk8(p, part, s); /* never chosen: walk16_usable is 0 */
}
#endif
