// Inline helpers shared by the kernel sources of the extension (each source gets its own
// copy: everything here is inline, in an anonymous namespace): the 8-lane horizontal sum,
// the cache-line prefetch of the weight-streaming kernels and the GGUF block sizes.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// Prefetch the cache lines of p .. p + bytes (HINT: _MM_HINT_T0 into L1, T1 into L2). The
// few-row linear layers stream their weights once per step, and on the 2-core Xeon the
// hardware prefetchers alone kept a one-row layer of GGUF blocks at ~13 GB/s, about twice
// its time with the weight in cache (a 1536 x 576 Q4_1 layer 52 against 22 us). The next
// block of 4 weight rows, requested while this one is computed: the decoder's linear
// layers at 1 / 2 / 4 / 8 rows 6.1 / 6.8 / 7.8 / 12.1 -> 4.7 / 5.3 / 6.8 / 11.3 ms a step
// (one process, interleaved), the output layer's one row 2.4 -> 2.0 ms, and with its rows
// 8 blocks ahead into L2 as well (a 49152 x 576 weight; it hurt the decoder's small ones)
// 1.7 ms.
template <int HINT>
inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, static_cast<_mm_hint>(HINT));
}
constexpr int64_t kFarPrefetchMinOut = 16384;  // output features from which the L2 prefetch runs too

constexpr int64_t kQBlock = 32;  // weights per GGUF block (Q4_1, Q8_0), and per step of every format
constexpr int64_t kQ6Block = 16;  // weights per scale of format 2 (Q6_K)

}  // namespace
