// The few-row linear tiles (NW weight rows x NX activation rows, AVX2/FMA and AVX-512F):
// skinny_linear's (linear.cpp), shared with quant_linear (quant_linear.cpp), which multiplies
// de-quantized weight rows with the same tiles, so its output is bit for bit skinny_linear's
// over the de-quantized weight. Everything here is inline, in an anonymous namespace.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernel_simd.h"

namespace {

// NW weight rows (output features o .. o+NW, the first at w) times NX activation rows.
template <int NW, int NX>
inline void block(const float* w, const float* x, float* y, int64_t o, int64_t r0, int64_t I, int64_t O) {
  __m256 acc[NW][NX];
  for (int a = 0; a < NW; ++a)
    for (int b = 0; b < NX; ++b) acc[a][b] = _mm256_setzero_ps();
  const int64_t I8 = I & ~int64_t(7);
  for (int64_t i = 0; i < I8; i += 8) {
    __m256 xv[NX];
    for (int b = 0; b < NX; ++b) xv[b] = _mm256_loadu_ps(x + (r0 + b) * I + i);
    for (int a = 0; a < NW; ++a) {
      const __m256 wv = _mm256_loadu_ps(w + a * I + i);
      for (int b = 0; b < NX; ++b) acc[a][b] = _mm256_fmadd_ps(wv, xv[b], acc[a][b]);
    }
  }
  for (int a = 0; a < NW; ++a) {
    for (int b = 0; b < NX; ++b) {
      float s = hsum(acc[a][b]);
      for (int64_t i = I8; i < I; ++i) s += w[a * I + i] * x[(r0 + b) * I + i];
      y[(r0 + b) * O + o + a] = s;
    }
  }
}

template <int NW>
inline void rows_block(const float* w, const float* x, float* y, int64_t o, int64_t R, int64_t I, int64_t O) {
  int64_t r = 0;
  for (; r + 3 <= R; r += 3) block<NW, 3>(w, x, y, o, r, I, O);
  switch (R - r) {
    case 2: block<NW, 2>(w, x, y, o, r, I, O); break;
    case 1: block<NW, 1>(w, x, y, o, r, I, O); break;
    default: break;
  }
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace {
namespace k512 {

template <int NW, int NX>
inline void block(const float* w, const float* x, float* y, int64_t o, int64_t r0, int64_t I, int64_t O) {
  __m512 a0[NW][NX], a1[NW][NX];
  for (int a = 0; a < NW; ++a)
    for (int b = 0; b < NX; ++b) a0[a][b] = a1[a][b] = _mm512_setzero_ps();
  const int64_t I32 = I & ~int64_t(31);
  for (int64_t i = 0; i < I32; i += 32) {
    __m512 x0[NX], x1[NX];
    for (int b = 0; b < NX; ++b) {
      x0[b] = _mm512_loadu_ps(x + (r0 + b) * I + i);
      x1[b] = _mm512_loadu_ps(x + (r0 + b) * I + i + 16);
    }
    for (int a = 0; a < NW; ++a) {
      const __m512 w0 = _mm512_loadu_ps(w + a * I + i), w1 = _mm512_loadu_ps(w + a * I + i + 16);
      for (int b = 0; b < NX; ++b) {
        a0[a][b] = _mm512_fmadd_ps(w0, x0[b], a0[a][b]);
        a1[a][b] = _mm512_fmadd_ps(w1, x1[b], a1[a][b]);
      }
    }
  }
  int64_t i = I32;
  if (I - i >= 16) {
    for (int a = 0; a < NW; ++a)
      for (int b = 0; b < NX; ++b)
        a0[a][b] = _mm512_fmadd_ps(_mm512_loadu_ps(w + a * I + i), _mm512_loadu_ps(x + (r0 + b) * I + i), a0[a][b]);
    i += 16;
  }
  if (i < I) {
    const __mmask16 mk = static_cast<__mmask16>((1u << (I - i)) - 1u);
    for (int a = 0; a < NW; ++a)
      for (int b = 0; b < NX; ++b)
        a1[a][b] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, w + a * I + i),
                                   _mm512_maskz_loadu_ps(mk, x + (r0 + b) * I + i), a1[a][b]);
  }
  for (int a = 0; a < NW; ++a)
    for (int b = 0; b < NX; ++b) y[(r0 + b) * O + o + a] = _mm512_reduce_add_ps(_mm512_add_ps(a0[a][b], a1[a][b]));
}

template <int NW>
inline void rows_block(const float* w, const float* x, float* y, int64_t o, int64_t R, int64_t I, int64_t O) {
  int64_t r = 0;
  for (; r + 3 <= R; r += 3) block<NW, 3>(w, x, y, o, r, I, O);
  switch (R - r) {
    case 2: block<NW, 2>(w, x, y, o, r, I, O); break;
    case 1: block<NW, 1>(w, x, y, o, r, I, O); break;
    default: break;
  }
}

}  // namespace k512
}  // namespace
#pragma GCC pop_options
