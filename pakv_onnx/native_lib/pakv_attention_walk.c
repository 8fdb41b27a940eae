/* The attention core's walk in 8-float vectors (pakv_attention_walk.h): on x86-64 with glibc compiled
 * twice, for AVX2 + FMA (x86-64-v3) and for the baseline, the loader picking one per machine (an
 * ifunc); elsewhere (NEON, SSE) as the compiler's default target. Tiles: 4 query rows x 16 keys of
 * scores, 4 rows x 16 values of output (8 accumulators: half of AVX2's registers). */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__gnu_linux__) && !defined(PAKV_NO_TARGET_CLONES)
#define PAKV_WALK_ATTRIBUTES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PAKV_WALK_ATTRIBUTES
#endif
#define PAKV_W 8
#define PAKV_WALK pakv_attention_walk8
#define PAKV_QK_ROWS 4
#define PAKV_PV_VECS 2
#include "pakv_attention_walk.h"
