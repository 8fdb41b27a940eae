/* Another thread changing one int64 entry of a tensor while a call reads it: flips *entry between a and
 * b until *stop is set. Called through ctypes from a Python thread, so it runs without the GIL, truly
 * alongside the call (tests/test_ort_paged_attention_attack.py, tests/native/ort_attention_session.py). */
#include <stdint.h>

void pakv_test_flip(volatile int64_t* entry, int64_t a, int64_t b, volatile const int32_t* stop) {
  while (!*stop) {
    *entry = a;
    *entry = b;
  }
}
