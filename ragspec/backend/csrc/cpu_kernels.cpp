// Few-row linear layer y = x W^T (+ b) for float32 on AVX2/FMA CPUs, and (below) the
// attention of a few query rows over a KV cache; AVX-512F variants of the linear layers
// further below (namespace k512), chosen at the first call from the CPU's flags (current_isa).
//
// Decoding and draft verification multiply 1-16 activation rows with each weight matrix,
// so the cost is streaming the weight from memory once. BLAS sgemm/sgemv kernels reach
// ~10-13 GB/s on the 2-core AMD CPU these numbers come from (MKL takes its generic path
// on non-Intel CPUs); this kernel streams each weight row once for all activation rows and
// reaches ~20 GB/s. Threads: ATen's intra-op pool (at::parallel_for), split over output
// features. Summation order differs from BLAS (8 lanes, then a horizontal sum), so values
// agree with F.linear to float32 rounding, not bit for bit.
#include "cpu_kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <cmath>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

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
// ---------------------------------------------------------------------------------------
// The same few-row linear layer over weights kept in a GGUF block format (llama.cpp's
// ggml-quants: Q4_1 for the default model's decoder, Q8_0 for its output layer; Q5_0 and
// Q4_K are read into these two, Q6_K into format 2: int8 with a float32 scale per 16
// weights), streamed at 0.75 / 1.125 / 1.25 bytes per weight instead of 4. Each group of 4
// weight rows is de-quantized into a small float32 buffer and multiplied by the code above,
// so the output is bit for bit that of skinny_linear over the de-quantized float32 weight:
// the de-quantization is exact in float32 (a float16 scale times a 4- or 8-bit integer
// needs at most 19 bits; Q4_K's and Q6_K's d * sc, a float16 times a 6- or 8-bit integer,
// at most 18, and times a 4-bit q or 6-bit q - 32 at most 23; Q4_1's `d * q + m` is one
// rounding, as fmadd), the same arithmetic as gguf-py's dequantize, which is how
// transformers loads a GGUF.
namespace {

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

// Q4_1 row: per block 16 bytes (byte j: element j in the low nibble, j + 16 in the high
// one) and float32 (d, m) -> w[i] = d * q[i] + m
inline void dequant_q4_1(const uint8_t* q, const float* dm, float* w, int64_t I) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < I / kQBlock; ++blk) {
    const __m256 d = _mm256_set1_ps(dm[2 * blk]), m = _mm256_set1_ps(dm[2 * blk + 1]);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * blk));
    const __m128i lo = _mm_and_si128(bytes, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    float* o = w + kQBlock * blk;
    _mm256_storeu_ps(o, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m));
    _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m));
    _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m));
    _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m));
  }
}

// int8 row with a float32 d per B weights -> w[i] = d * q[i] (Q8_0: B = 32; format 2, Q6_K's
// values: B = 16)
template <int B>
inline void dequant_int8(const int8_t* q, const float* dscale, float* w, int64_t I) {
  for (int64_t blk = 0; blk < I / B; ++blk) {
    const __m256 d = _mm256_set1_ps(dscale[blk]);
    for (int c = 0; c < B / 8; ++c) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + B * blk + 8 * c));
      _mm256_storeu_ps(w + B * blk + 8 * c, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
    }
  }
}
inline void dequant_q8_0(const int8_t* q, const float* dscale, float* w, int64_t I) { dequant_int8<32>(q, dscale, w, I); }
inline void dequant_q6_k(const int8_t* q, const float* dscale, float* w, int64_t I) { dequant_int8<16>(q, dscale, w, I); }

}  // namespace
// ---------------------------------------------------------------------------------------
// Attention of a few query rows (decoding: 1, verification: up to ~16) over a KV cache.
//
// torch's CPU SDPA (flash attention) splits the work over (head, query block) only: 9
// query heads of one decoding step are 9 small items, and a step's attention over 700
// cached tokens costs ~0.2 ms per layer for 1 query and ~0.45-0.55 ms for 4-9 (measured in
// the default model's forwards on the 2-core CPU), a tenth to a fifth of the step. Here the
// keys are split in blocks (split-K, as in flash-decoding): each work item is (key/value
// head, key block) and serves all query heads of that group and all query rows with one
// read of its keys and values; the per-block softmax statistics are merged afterwards
// (online softmax, Milakov & Gimelshein 2018). Same math as SDPA in float32; the order of
// the sums differs, so values agree to float32 rounding.
namespace {

// exp for 8 floats (Cephes expf polynomial, ~1 ulp on [-87, 88])
inline __m256 exp256(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  e = _mm256_slli_epi32(e, 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

constexpr int64_t kKeyBlock = 64;  // keys per work item: 16 KB of keys + 16 KB of values at d = 64

// [sum(a[0]), ..., sum(a[7])]
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

struct AttnArgs {
  const float* q;
  const float* k;  // float32 keys/values, or null with k16/v16 (float16 bits)
  const float* v;
  const bool* mask;  // [Q, S] or null
  float* stats;      // [Hkv, nb, R, 2]: block max, block sum of exp
  float* part;       // [Hkv, nb, R, d]: block's exp-weighted value sum
  int64_t G, Q, S, nb, qsH, qsQ, ksH, ksS, vsH, vsS;
  float scale;
  int64_t past;             // S - Q: the cached keys before the call's new rows
  const int64_t* chain;     // [Q, S - past]: row i's visible new slots in order (chain_len[i] of them)
  const int64_t* chain_len; // [Q]
  const uint16_t* k16 = nullptr;  // float16 keys/values (a float16 KV cache), else null
  const uint16_t* v16 = nullptr;
};

// A key/value element as float32: T = float, or uint16_t holding float16 bits (widened
// exactly by F16C, so the kernels compute the float32 path's bits over the widened values).
template <class T> inline const T* keys_of(const AttnArgs& a);
template <> inline const float* keys_of<float>(const AttnArgs& a) { return a.k; }
template <> inline const uint16_t* keys_of<uint16_t>(const AttnArgs& a) { return a.k16; }
template <class T> inline const T* values_of(const AttnArgs& a);
template <> inline const float* values_of<float>(const AttnArgs& a) { return a.v; }
template <> inline const uint16_t* values_of<uint16_t>(const AttnArgs& a) { return a.v16; }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// one work item: key/value head h, key block b, every query row of the head's group.
//
// Keys are taken in each row's *logical* order: the cached positions 0 .. past - 1 (past = S
// - Q) at their own slots, then the row's own chain of new slots (those its mask shows:
// for a draft tree, the root and the node's ancestors, in depth order), so key t of a
// row's sequence is at logical position t, the position it would have after the accepted
// path is compacted. Blocks, 8-key groups and lanes follow logical positions, and a key
// absent from a row (masked, or past its chain) adds exact zeros: a row's result has the
// same bits wherever its tree put its ancestors and however many rows the call has, so a
// verification gives each accepted row exactly what a one-row step at its position gives.
// (attend_row: one query row r of the item)
template <int ND, class T>
__attribute__((always_inline)) inline void attend_row(const AttnArgs& a, int64_t h, int64_t b, int64_t r, float* score) {
  constexpr int64_t d = 8 * ND;
  const int64_t R = a.G * a.Q;
  const int64_t j0 = b * kKeyBlock;
  int64_t slot[kKeyBlock];  // physical slot of each logical key of the block, -1: absent
  const T* kh = keys_of<T>(a) + h * a.ksH;
  const T* vh = values_of<T>(a) + h * a.vsH;
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  {
    const int64_t g = r / a.Q, i = r % a.Q;
    float* st = a.stats + ((h * a.nb + b) * R + r) * 2;
    float* pr = a.part + ((h * a.nb + b) * R + r) * d;
    const int64_t n = std::min(a.past + a.chain_len[i], j0 + kKeyBlock) - j0;  // logical keys in this block
    const bool* mrow = a.mask ? a.mask + i * a.S : nullptr;
    bool any = false;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t jl = j0 + t;
      slot[t] = jl < a.past ? ((mrow && !mrow[jl]) ? -1 : jl) : a.chain[i * (a.S - a.past) + (jl - a.past)];
      any = any || slot[t] >= 0;
    }
    if (!any) {  // every key of this block hidden from this row (or none left)
      st[0] = -INFINITY;
      st[1] = 0.f;
      std::fill(pr, pr + d, 0.f);
      return;
    }
    const float* qrow = a.q + (h * a.G + g) * a.qsH + i * a.qsQ;
    __m256 qv[ND];
    for (int c = 0; c < ND; ++c) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(qrow + 8 * c), _mm256_set1_ps(a.scale));
    // scores, 8 logical keys at a time (dimension chunk outer, key inner: 8 independent
    // FMA chains); absent keys -inf
    const int64_t n8 = (n + 7) / 8 * 8;
    for (int64_t j = 0; j < n8; j += 8) {
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) {
        const int64_t sl = j + t < n ? slot[j + t] : -1;
        if (sl < 0) {
          acc[t] = _mm256_setzero_ps();
          continue;
        }
        const T* krow = kh + sl * a.ksS;
        acc[t] = _mm256_mul_ps(qv[0], load8(krow));
        for (int c = 1; c < ND; ++c) acc[t] = _mm256_fmadd_ps(qv[c], load8(krow + 8 * c), acc[t]);
      }
      _mm256_storeu_ps(score + j, hsum8(acc));
      for (int t = 0; t < 8; ++t)
        if (j + t >= n || slot[j + t] < 0) score[j + t] = -INFINITY;
    }
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; ++t) mx = score[t] > mx ? score[t] : mx;
    // p = exp(s - max), absent keys exactly 0
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 lsum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n8; j += 8) {
      const __m256 s = _mm256_loadu_ps(score + j);
      const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(s, ninf, _CMP_EQ_OQ), exp256(_mm256_sub_ps(s, vmx)));
      _mm256_storeu_ps(score + j, e);
      lsum = _mm256_add_ps(lsum, e);
    }
    __m256 acc[ND];
    for (int c = 0; c < ND; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      if (slot[t] < 0) continue;
      const __m256 p = _mm256_set1_ps(score[t]);
      const T* vrow = vh + slot[t] * a.vsS;
      for (int c = 0; c < ND; ++c) acc[c] = _mm256_fmadd_ps(p, load8(vrow + 8 * c), acc[c]);
    }
    st[0] = mx;
    st[1] = hsum(lsum);
    for (int c = 0; c < ND; ++c) _mm256_storeu_ps(pr + 8 * c, acc[c]);
  }
}

// Prefetch into L1 the key and value rows r0 .. r1 - 1 of one head (every cache line),
// at a work item's start, before its first loads, so that the block's keys and values
// stream from memory while its scores are computed. A batched step's attention reads each
// request's keys and values once, from memory (8 requests of ~600 cached tokens: ~220 MB
// of a float32 cache per step), and with the hardware prefetchers alone it ran near half
// the memory bandwidth. One-position calls over 740 cold keys: 0.080 -> 0.064 ms (float16
// keys 0.054 -> 0.043 ms; in one process, interleaved).
template <class T>
inline void prefetch_rows(const T* kh, const T* vh, int64_t ks, int64_t vs, int64_t r0, int64_t r1, int64_t d) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t t = r0; t < r1; ++t) {
    const char* kp = reinterpret_cast<const char*>(kh + t * ks);
    const char* vp = reinterpret_cast<const char*>(vh + t * vs);
    for (int64_t o = 0; o < bytes; o += 64) {
      _mm_prefetch(kp + o, _MM_HINT_T0);
      _mm_prefetch(vp + o, _MM_HINT_T0);
    }
  }
}

template <int ND, class T>
void attend_block(const AttnArgs& a, int64_t h, int64_t b, float* score) {
  const int64_t j0 = b * kKeyBlock;
  prefetch_rows(keys_of<T>(a) + h * a.ksH, values_of<T>(a) + h * a.vsH, a.ksS, a.vsS, j0,
                std::min(a.S, j0 + kKeyBlock), 8 * ND);
  for (int64_t r = 0; r < a.G * a.Q; ++r) attend_row<ND, T>(a, h, b, r, score);
}

template <class T>
inline void attend_row_d(const AttnArgs& a, int64_t d, int64_t h, int64_t b, int64_t r, float* score) {
  if (d == 32) attend_row<4, T>(a, h, b, r, score);
  else if (d == 64) attend_row<8, T>(a, h, b, r, score);
  else if (d == 128) attend_row<16, T>(a, h, b, r, score);
  else attend_row<32, T>(a, h, b, r, score);
}

template <class T>
inline void attend_block_d(const AttnArgs& a, int64_t d, int64_t h, int64_t b, float* score) {
  if (d == 32) attend_block<4, T>(a, h, b, score);
  else if (d == 64) attend_block<8, T>(a, h, b, score);
  else if (d == 128) attend_block<16, T>(a, h, b, score);
  else attend_block<32, T>(a, h, b, score);
}

}  // namespace
// ---------------------------------------------------------------------------------------
// AVX-512F variants of the linear kernels above, compiled for that ISA function by function (the
// pragma below; the library's flags stay -mavx2 -mfma) and chosen at the first call from
// the CPU's flags (see current_isa: RAGSPEC_CPU_ISA=avx2 masks them off).
//
// Linear layers: 16 lanes, and two accumulators per (weight row, activation row): a0 takes
// the elements [32k, 32k + 16), a1 [32k + 16, 32k + 32), y = reduce(a0 + a1); 4 weight rows
// x up to 3 activation rows = 24 accumulators in 32 registers, each one's sequence of sums
// independent of how many rows the call has. quant_linear de-quantizes inside the FMA loop
// (the same values in the same order as skinny_linear over the de-quantized weight: bit for
// bit within this ISA), once per weight row and group of up to 8 activation rows (qrow_rows:
// the weights stream from memory once, no buffer round trip). Values differ from the AVX2
// path by float32 rounding (another summation order).
// No std:: templates in this section: their inline instantiations would be compiled for
// AVX-512 and could be shared (one COMDAT copy) with the AVX2 path.
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

// 4 weight rows x R activation rows: block<4, 1-3> up to 3 rows; above, pairs of weight rows
// x 4 activation rows (16 accumulators: 4 x 3 would spill registers). The grouping changes
// no value: each (weight row, activation row) pair sums in the same order in every block.
inline void rows_block4(const float* w, const float* x, float* y, int64_t o, int64_t R, int64_t I, int64_t O) {
  if (R <= 3) {
    rows_block<4>(w, x, y, o, R, I, O);
    return;
  }
  for (int p = 0; p < 4; p += 2) {
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) block<2, 4>(w + p * I, x, y, o + p, r, I, O);
    switch (R - r) {
      case 3: block<2, 3>(w + p * I, x, y, o + p, r, I, O); break;
      case 2: block<2, 2>(w + p * I, x, y, o + p, r, I, O); break;
      case 1: block<2, 1>(w + p * I, x, y, o + p, r, I, O); break;
      default: break;
    }
  }
}

// skinny_linear's blocks of 4 weight rows b0 .. b1, and one row o
void skinny_blocks(const float* w, const float* x, float* y, int64_t b0, int64_t b1, int64_t R, int64_t I, int64_t O) {
  // from 3 rows on, the next block of weight rows prefetched (prefetch_lines): 1536 x 576
  // float32 layers from memory at 4 / 8 rows 16.5 / 20.1 -> 12.0 / 16.1 ms per 60 (at 1-2
  // rows, where the hardware prefetchers keep up, it cost 0-8%)
  const bool ahead = R >= 3;
  for (int64_t b = b0; b < b1; ++b) {
    if (ahead && b + 1 < b1) prefetch_lines<_MM_HINT_T0>(w + 4 * (b + 1) * I, 4 * I * static_cast<int64_t>(sizeof(float)));
    rows_block4(w + 4 * b * I, x, y, 4 * b, R, I, O);
  }
}
void skinny_row(const float* w, const float* x, float* y, int64_t o, int64_t R, int64_t I, int64_t O) {
  rows_block<1>(w + o * I, x, y, o, R, I, O);
}

// one block of 32 weights (number blk of a row) as two float32 vectors, the values of the
// AVX2 de-quantization above: Q4_1 fmadd(d, q, m), Q8_0 d * q, format 2 d * q per 16
struct Q41 {
  static inline void load(const uint8_t* q, const float* s, int64_t blk, __m512& w0, __m512& w1) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * blk)));
    const __m512 d = _mm512_set1_ps(s[2 * blk]), m = _mm512_set1_ps(s[2 * blk + 1]);
    // the block's 16 possible values fmadd(d, k, m), k = 0 .. 15, then each weight's by its
    // 4-bit code (vpermps reads an index's low 4 bits: the low nibble of v's byte, or the
    // high one shifted down): the same values as fmadd(d, float(q), m) per weight, in 5
    // instructions instead of 7 (no integer-to-float conversions, no mask)
    const __m512 table = _mm512_fmadd_ps(d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), m);
    w0 = _mm512_permutexvar_ps(v, table);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
  }
};
struct Q80 {
  static inline void load(const uint8_t* q, const float* s, int64_t blk, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(s[blk]);
    const __m128i* p = reinterpret_cast<const __m128i*>(q + kQBlock * blk);
    w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))));
    w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))));
  }
};

struct Q6K {
  static inline void load(const uint8_t* q, const float* s, int64_t blk, __m512& w0, __m512& w1) {
    const __m128i* p = reinterpret_cast<const __m128i*>(q + kQBlock * blk);
    w0 = _mm512_mul_ps(_mm512_set1_ps(s[2 * blk]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))));
    w1 = _mm512_mul_ps(_mm512_set1_ps(s[2 * blk + 1]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))));
  }
};

template <class F>
inline void dequant_row(const uint8_t* q, const float* s, float* w, int64_t I) {
  for (int64_t blk = 0; blk < I / kQBlock; ++blk) {
    __m512 w0, w1;
    F::load(q, s, blk, w0, w1);
    _mm512_storeu_ps(w + kQBlock * blk, w0);
    _mm512_storeu_ps(w + kQBlock * blk + 16, w1);
  }
}

// one weight row x NX activation rows (NX <= 8: 16 accumulators), the weight de-quantized in
// registers once per block and the activations read as FMA memory operands. (A tile of 4
// weight rows x 1-3 activation rows, as skinny_linear's, measured slower on the 2-core Zen 4
// at every row count: its de-quantization ran once per 3 rows and the output layer's Q8_0
// one-row call took 3.1 ms against 1.5 ms here.)
template <class F, int NX>
inline void qrow_rows(const uint8_t* q, const float* s, const float* x, float* y, int64_t o, int64_t r0, int64_t I,
                      int64_t O) {
  __m512 a0[NX], a1[NX];
  for (int b = 0; b < NX; ++b) a0[b] = a1[b] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < I / kQBlock; ++blk) {
    const int64_t i = kQBlock * blk;
    __m512 w0, w1;
    F::load(q, s, blk, w0, w1);
    for (int b = 0; b < NX; ++b) {
      a0[b] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + (r0 + b) * I + i), a0[b]);
      a1[b] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + (r0 + b) * I + i + 16), a1[b]);
    }
  }
  for (int b = 0; b < NX; ++b) y[(r0 + b) * O + o] = _mm512_reduce_add_ps(_mm512_add_ps(a0[b], a1[b]));
}

// two weight rows (o, o + 1: codes q, q + qrow; scales s, s + srow) x NX activation rows
// (NX <= 4: 16 accumulators): the same per-pair sums as qrow_rows (a0 over each block's first
// 16 elements, a1 over the last 16, y = reduce(a0 + a1)), bit for bit, but each activation
// vector is loaded into a register once for both weight rows. The 2-core Zen 4 issues about
// one 64-byte load per two FMAs (~2 G loads/s/core against ~3.6 G FMA/s): qrow_rows' one
// load per FMA ran at half the FMA peak, this tile at ~70% (the empty asm keeps the compiler
// from folding each load into both FMAs as a memory operand, which loads it twice).
template <class F, int NX>
inline void qpair_rows(const uint8_t* q, const float* s, int64_t qrow, int64_t srow, const float* x, float* y,
                       int64_t o, int64_t r0, int64_t I, int64_t O) {
  __m512 a0[NX], a1[NX], c0[NX], c1[NX];
  for (int b = 0; b < NX; ++b) a0[b] = a1[b] = c0[b] = c1[b] = _mm512_setzero_ps();
  const uint8_t* q2 = q + qrow;
  const float* s2 = s + srow;
  for (int64_t blk = 0; blk < I / kQBlock; ++blk) {
    const int64_t i = kQBlock * blk;
    __m512 w0, w1, u0, u1;
    F::load(q, s, blk, w0, w1);
    F::load(q2, s2, blk, u0, u1);
    for (int b = 0; b < NX; ++b) {
      __m512 x0 = _mm512_loadu_ps(x + (r0 + b) * I + i), x1 = _mm512_loadu_ps(x + (r0 + b) * I + i + 16);
      __asm__("" : "+v"(x0), "+v"(x1));
      a0[b] = _mm512_fmadd_ps(w0, x0, a0[b]);
      a1[b] = _mm512_fmadd_ps(w1, x1, a1[b]);
      c0[b] = _mm512_fmadd_ps(u0, x0, c0[b]);
      c1[b] = _mm512_fmadd_ps(u1, x1, c1[b]);
    }
  }
  for (int b = 0; b < NX; ++b) {
    y[(r0 + b) * O + o] = _mm512_reduce_add_ps(_mm512_add_ps(a0[b], a1[b]));
    y[(r0 + b) * O + o + 1] = _mm512_reduce_add_ps(_mm512_add_ps(c0[b], c1[b]));
  }
}

// weight rows o, o + 1 x all R activation rows: up to `alone` rows each weight row alone
// (qrow_rows), else one qpair_rows tile of up to 5 rows (20 accumulators; 6 spilled
// registers, 1.45x the time of 5), more in tiles of 4 (5 + 3 rows measured 1.1x 4 + 4), each
// tile de-quantizing the pair once. `alone` is the CPU's (alone_rows()): the 2-core Zen 4
// ran qrow_rows faster up to 4 rows (the output layer's Q8_0 2-row call 1.1 against 2.1 ms
// as pairs); the 2-core Xeon of issue 22 ran pairs faster at every row count (the decoder's
// linears at 1 / 2 / 5 rows 3.0 / 3.8 / 6.0 ms against 3.4 / 5.3 / 8.7, the output layer's 4
// rows 1.39 against 1.72). Every tiling gives each (weight row, activation row) pair the
// same sums, so the choice changes no value.
template <class F>
inline void qpair_all(const uint8_t* q, const float* s, int64_t qrow, int64_t srow, const float* x, float* y,
                      int64_t o, int64_t R, int64_t I, int64_t O, int64_t alone) {
  if (R <= alone) {
    for (int a = 0; a < 2; ++a) {
      const uint8_t* qa = q + a * qrow;
      const float* sa = s + a * srow;
      switch (R) {
        case 4: qrow_rows<F, 4>(qa, sa, x, y, o + a, 0, I, O); break;
        case 3: qrow_rows<F, 3>(qa, sa, x, y, o + a, 0, I, O); break;
        case 2: qrow_rows<F, 2>(qa, sa, x, y, o + a, 0, I, O); break;
        default: qrow_rows<F, 1>(qa, sa, x, y, o + a, 0, I, O); break;
      }
    }
    return;
  }
  // above 8 rows, ceil(R / 5) tiles as even as possible (9 rows: 5 + 4, not 4 + 4 + 1: a
  // third de-quantization of the pair for one row cost a batched step of 8 requests and one
  // draft token 2.3 ms more linear time than 8 rows)
  const int64_t tiles = R <= 5 ? 1 : R <= 8 ? (R + 3) / 4 : (R + 4) / 5;
  const bool even = R > 8;
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int64_t n = even ? R / tiles + (t < R % tiles ? 1 : 0) : std::min<int64_t>(R <= 5 ? 5 : 4, R - r);
    switch (n) {
      case 5: qpair_rows<F, 5>(q, s, qrow, srow, x, y, o, r, I, O); break;
      case 4: qpair_rows<F, 4>(q, s, qrow, srow, x, y, o, r, I, O); break;
      case 3: qpair_rows<F, 3>(q, s, qrow, srow, x, y, o, r, I, O); break;
      case 2: qpair_rows<F, 2>(q, s, qrow, srow, x, y, o, r, I, O); break;
      default: qpair_rows<F, 1>(q, s, qrow, srow, x, y, o, r, I, O); break;
    }
    r += n;
  }
}

template <class F>
inline void qblocks(const uint8_t* q, const float* s, int64_t qrow, int64_t srow, const float* x, float* y, int64_t b0,
                    int64_t b1, int64_t R, int64_t I, int64_t O, int64_t alone) {
  // the next block's codes and scales into L1 while this one is computed (and, for the
  // output layer at few rows, 8 blocks ahead into L2), see prefetch_lines
  const int64_t qbytes = 4 * qrow, sbytes = 4 * srow * static_cast<int64_t>(sizeof(float));
  const bool far = O >= kFarPrefetchMinOut && R <= 4;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t o = 4 * b;
    const uint8_t* qb = q + o * qrow;
    const float* sb = s + o * srow;
    if (b + 1 < b1) {
      prefetch_lines<_MM_HINT_T0>(qb + qbytes, qbytes);
      prefetch_lines<_MM_HINT_T0>(sb + 4 * srow, sbytes);
    }
    if (far && b + 8 < b1) {
      prefetch_lines<_MM_HINT_T1>(qb + 8 * qbytes, qbytes);
      prefetch_lines<_MM_HINT_T1>(sb + 32 * srow, sbytes);
    }
    // pairs of weight rows over tiles of activation rows (the rows stay in L1 between
    // tiles): every (weight row, activation row) pair sums in the same order whatever R
    // and whichever tile computes it
    for (int a = 0; a < 4; a += 2) qpair_all<F>(qb + a * qrow, sb + a * srow, qrow, srow, x, y, o + a, R, I, O, alone);
  }
}

// quant_linear's blocks of 4 weight rows b0 .. b1 (alone: see qpair_all), and one row o (buf: I)
void quant_blocks(int64_t fmt, const uint8_t* q, const float* s, int64_t qrow, int64_t srow, const float* x, float* y,
                  int64_t b0, int64_t b1, int64_t R, int64_t I, int64_t O, int64_t alone) {
  if (fmt == 0) qblocks<Q41>(q, s, qrow, srow, x, y, b0, b1, R, I, O, alone);
  else if (fmt == 1) qblocks<Q80>(q, s, qrow, srow, x, y, b0, b1, R, I, O, alone);
  else qblocks<Q6K>(q, s, qrow, srow, x, y, b0, b1, R, I, O, alone);
}
void quant_row(int64_t fmt, const uint8_t* q, const float* s, int64_t qrow, int64_t srow, const float* x, float* y,
               int64_t o, int64_t R, int64_t I, int64_t O, float* buf) {
  if (fmt == 0) dequant_row<Q41>(q + o * qrow, s + o * srow, buf, I);
  else if (fmt == 1) dequant_row<Q80>(q + o * qrow, s + o * srow, buf, I);
  else dequant_row<Q6K>(q + o * qrow, s + o * srow, buf, I);
  rows_block<1>(buf, x, y, o, R, I, O);
}

}  // namespace k512
}  // namespace
#pragma GCC pop_options


// ---------------------------------------------------------------------------------------
// Which instruction set the kernels use: AVX-512 (F, BW, VL, DQ) where the CPU has it, else
// AVX2/FMA; chosen at the first call from the CPU's flags, RAGSPEC_CPU_ISA=avx2 masks
// AVX-512 off, set_cpu_isa switches it (tests run both paths in one process).
namespace {

constexpr int kIsaAvx2 = 0, kIsaAvx512 = 1;
std::atomic<int> g_isa{-1};

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

int detect_isa() {
  const char* env = std::getenv("RAGSPEC_CPU_ISA");
  const std::string want = env ? env : "";
  if (want == "avx2" || want == "AVX2") return kIsaAvx2;
  return cpu_has_avx512() ? kIsaAvx512 : kIsaAvx2;
}

inline int current_isa() {
  int v = g_isa.load(std::memory_order_relaxed);
  if (v < 0) {
    v = detect_isa();
    g_isa.store(v, std::memory_order_relaxed);
  }
  return v;
}

inline const char* isa_name(int v) { return v == kIsaAvx512 ? "avx512" : "avx2"; }

// AVX-512 quant_linear: activation rows up to which each weight row is multiplied alone
// (qpair_all's `alone`), by what each CPU ran faster: 4 on AMD (Zen 4), 0 elsewhere (the
// Intel Xeon); the same values either way
int64_t alone_rows() {
  static const int64_t rows = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") ? int64_t{4} : int64_t{0};
  }();
  return rows;
}

}  // namespace

// "avx512" or "avx2": the instruction set the kernels use now
std::string cpu_isa() { return isa_name(current_isa()); }

// switch the kernels to "avx2", "avx512" (an error where the CPU lacks it) or "auto" (the
// CPU's best unless RAGSPEC_CPU_ISA=avx2); returns the previous one
std::string set_cpu_isa(const std::string& name) {
  const std::string prev = cpu_isa();
  if (name == "avx2") g_isa.store(kIsaAvx2);
  else if (name == "avx512") {
    TORCH_CHECK(cpu_has_avx512(), "set_cpu_isa: this CPU lacks AVX-512 (F, BW, VL, DQ)");
    g_isa.store(kIsaAvx512);
  } else if (name == "auto") g_isa.store(detect_isa());
  else TORCH_CHECK(false, "set_cpu_isa: expected 'avx2', 'avx512' or 'auto', got '", name, "'");
  return prev;
}


// x: float32 [R, I] contiguous; weight: float32 [O, I] contiguous; bias: float32 [O] or
// empty -> float32 [R, O].
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "skinny_linear: shape mismatch");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "skinny_linear: float32 only");
  x = x.contiguous();
  TORCH_CHECK(weight.is_contiguous(), "skinny_linear: weight must be contiguous");
  const int64_t R = x.size(0), I = x.size(1), O = weight.size(0);
  auto y = torch::empty({R, O}, x.options());
  const float* w = weight.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = O / 4;
  // blocks of 4 weight rows x up to 3 activation rows (12 accumulators in 16 registers)
  if (current_isa() == kIsaAvx512) {
    at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) { k512::skinny_blocks(w, xp, yp, b0, b1, R, I, O); });
    for (int64_t o = 4 * blocks; o < O; ++o) k512::skinny_row(w, xp, yp, o, R, I, O);
  } else {
    at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        rows_block<4>(w + 4 * b * I, xp, yp, 4 * b, R, I, O);
      }
    });
    for (int64_t o = 4 * blocks; o < O; ++o) rows_block<1>(w + o * I, xp, yp, o, R, I, O);
  }
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}


// ---------------------------------------------------------------------------------------
// Fast numerics (``--numerics fast``, opt-in): the linear layers over GGUF blocks with the
// activations quantized to int8, per row and per block of 32 (d = max|x| / 127, q =
// round(x / d)), and integer dot products (AVX-512 VNNI vpdpbusd: unsigned weight bytes x
// signed activation bytes, 4 products summed per 32-bit lane), as llama.cpp computes Q4_1 x
// Q8_1 blocks; but each activation row is quantized alone and every (weight row, activation
// row) pair sums in the same order whatever the call's row count, so a verification forward
// gives each row exactly what a one-row step gives it (speculative == plain, bit for bit, in
// this mode too). Not bit-equal to float32: the activation's rounding is ~0.4% of a block's
// largest value.
//
// Layout (ragspec/backend/quant.py, GGUFWeight.to_fast): a row's blocks are taken in groups
// of G = 16 blocks (then one each of 8, 4, 2 for the rest; the block count must be even).
// Within a group, 32-bit lane k of the accumulator belongs to block k / L (L = 16 / G lanes a
// block) and step t (of S = G / 2) feeds it the block's weights t * 4L + (k % L) * 4 .. + 3:
// after the S steps each lane holds an integer partial sum of its own block, and one
// conversion and fused multiply-add per group scales all 16 lanes. Format 3 (Q4_1): the
// unsigned 4-bit codes in this order, packed per 128 (64 bytes: code p in the low nibble of
// byte p, code 64 + p in the high one; a 2-block group: 32 bytes, p and 32 + p), scales float32
// [O, 2, I / 32] (d row, then m row): w = d * q + m. Format 4 (Q8_0): the codes + 128 as
// uint8 in this order, scales float32 [O, I / 32]: w = d * (u - 128).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")
namespace kvnni {

inline int group_blocks(int64_t left) { return left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : 2; }

// activation rows x float32 [R, I] -> qa int8 [R, I] (the layout above), sa float32 [R, nb]
// (each block's d), ms float32 [R, nb] (d * sum of the block's codes, for the m term)
void quantize_rows(const float* x, int64_t R, int64_t I, int8_t* qa, float* sa, float* ms) {
  const int64_t nb = I / kQBlock;
  alignas(64) int8_t nat[kQBlock];
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * I;
    int8_t* qr = qa + r * I;
    int64_t g0 = 0;
    while (g0 < nb) {
      const int G = group_blocks(nb - g0), L = 16 / G;
      int32_t* words = reinterpret_cast<int32_t*>(qr + kQBlock * g0);
      for (int j = 0; j < G; ++j) {
        const int64_t blk = g0 + j;
        const __m512 v0 = _mm512_loadu_ps(xr + kQBlock * blk), v1 = _mm512_loadu_ps(xr + kQBlock * blk + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
        _mm_store_si128(reinterpret_cast<__m128i*>(nat), _mm512_cvtsepi32_epi8(q0));
        _mm_store_si128(reinterpret_cast<__m128i*>(nat + 16), _mm512_cvtsepi32_epi8(q1));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        sa[r * nb + blk] = d;
        ms[r * nb + blk] = d * static_cast<float>(sum);
        // the block's 8 words of 4 codes to their places: word w = t * L + l goes to lane
        // (j * L + l) of step t
        const int32_t* nw = reinterpret_cast<const int32_t*>(nat);
        for (int w = 0; w < 8; ++w) words[(w / L) * 16 + j * L + (w % L)] = nw[w];
      }
      g0 += G;
    }
  }
}

struct ActRows {
  const int8_t* qa;
  const float* sa;
  const float* ms;
  int64_t I, nb;
};

// one group of G blocks of one weight row (codes at qg, d and m per block at dg / mg) x NX
// activation rows r0 .. r0 + NX - 1, accumulated into acc
template <int FMT, int G, int NX>
inline void vgroup(const uint8_t* qg, const float* dg, const float* mg, const ActRows& a, int64_t r0, int64_t g0,
                   __m512* acc) {
  constexpr int S = G / 2, L = 16 / G;
  __m512i isum[NX];
  for (int b = 0; b < NX; ++b) isum[b] = _mm512_setzero_si512();
  const int64_t off = kQBlock * g0;  // byte offset of the group in an activation row
  if (FMT == 3) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (G == 2) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg));
      const __m256i lo = _mm256_and_si256(v, _mm512_castsi512_si256(m4));
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm512_castsi512_si256(m4));
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      for (int b = 0; b < NX; ++b)
        isum[b] = _mm512_dpbusd_epi32(isum[b], w, _mm512_loadu_si512(a.qa + (r0 + b) * a.I + off));
    } else {
      for (int c = 0; c < S / 2; ++c) {
        const __m512i v = _mm512_loadu_si512(qg + 64 * c);
        const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        for (int b = 0; b < NX; ++b) {
          const int8_t* xa = a.qa + (r0 + b) * a.I + off + 128 * c;
          isum[b] = _mm512_dpbusd_epi32(isum[b], lo, _mm512_loadu_si512(xa));
          isum[b] = _mm512_dpbusd_epi32(isum[b], hi, _mm512_loadu_si512(xa + 64));
        }
      }
    }
  } else {
    for (int t = 0; t < S; ++t) {
      const __m512i w = _mm512_loadu_si512(qg + 64 * t);
      for (int b = 0; b < NX; ++b)
        isum[b] = _mm512_dpbusd_epi32(isum[b], w, _mm512_loadu_si512(a.qa + (r0 + b) * a.I + off + 64 * t));
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << G) - 1);
  const __m512i lanes = _mm512_set_epi32(15 / L, 14 / L, 13 / L, 12 / L, 11 / L, 10 / L, 9 / L, 8 / L, 7 / L, 6 / L,
                                         5 / L, 4 / L, 3 / L, 2 / L, 1 / L, 0);
  const __m512 d = _mm512_maskz_loadu_ps(mask, dg);  // block-indexed
  const __m512 m = FMT == 3 ? _mm512_maskz_loadu_ps(mask, mg) : _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
  const __m512 dl = G == 16 ? d : _mm512_permutexvar_ps(lanes, d);  // lane-indexed
  for (int b = 0; b < NX; ++b) {
    const float* sa = a.sa + (r0 + b) * a.nb + g0;
    const __m512 s = _mm512_maskz_loadu_ps(mask, sa);
    const __m512 sl = G == 16 ? s : _mm512_permutexvar_ps(lanes, s);
    acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[b]), _mm512_mul_ps(dl, sl), acc[b]);
    acc[b] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(mask, a.ms + (r0 + b) * a.nb + g0), acc[b]);
  }
}

// weight row o (codes q, scales s) x activation rows r0 .. r0 + NX - 1 -> y[r, o]
template <int FMT, int NX>
inline void vrow_rows(const uint8_t* q, const float* s, const ActRows& a, float* y, int64_t o, int64_t r0, int64_t O) {
  __m512 acc[NX];
  for (int b = 0; b < NX; ++b) acc[b] = _mm512_setzero_ps();
  const int64_t nb = a.nb;
  const float* d = s;
  const float* m = FMT == 3 ? s + nb : nullptr;
  int64_t g0 = 0;
  while (g0 < nb) {
    const int G = group_blocks(nb - g0);
    const uint8_t* qg = q + (FMT == 3 ? 16 : 32) * g0;
    const float* mg = m ? m + g0 : nullptr;
    switch (G) {
      case 16: vgroup<FMT, 16, NX>(qg, d + g0, mg, a, r0, g0, acc); break;
      case 8: vgroup<FMT, 8, NX>(qg, d + g0, mg, a, r0, g0, acc); break;
      case 4: vgroup<FMT, 4, NX>(qg, d + g0, mg, a, r0, g0, acc); break;
      default: vgroup<FMT, 2, NX>(qg, d + g0, mg, a, r0, g0, acc); break;
    }
    g0 += G;
  }
  for (int b = 0; b < NX; ++b) y[(r0 + b) * O + o] = _mm512_reduce_add_ps(acc[b]);
}

// vgroup for two weight rows at once (codes qg[0], qg[1], scales dg[], mg[]) x NX <= 4
// activation rows: each activation vector is loaded into a register once for both (the
// 2-core Zen 4 issues ~2 G 64-byte loads/s against ~3.6 G vpdpbusd/s per core, and vgroup
// loads once per vpdpbusd); per (weight row, activation row) pair the same integer sums and
// the same float32 operations in the same order as vgroup, so the same bits
template <int FMT, int G, int NX>
inline void vgroup2(const uint8_t* const* qg, const float* const* dg, const float* const* mg, const ActRows& a,
                    int64_t r0, int64_t g0, __m512* acc0, __m512* acc1) {
  constexpr int S = G / 2, L = 16 / G;
  __m512i isum[2][NX];
  for (int w = 0; w < 2; ++w)
    for (int b = 0; b < NX; ++b) isum[w][b] = _mm512_setzero_si512();
  const int64_t off = kQBlock * g0;
  if (FMT == 3) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (G == 2) {
      __m512i wv[2];
      for (int w = 0; w < 2; ++w) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg[w]));
        const __m256i lo = _mm256_and_si256(v, _mm512_castsi512_si256(m4));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm512_castsi512_si256(m4));
        wv[w] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      }
      for (int b = 0; b < NX; ++b) {
        __m512i x = _mm512_loadu_si512(a.qa + (r0 + b) * a.I + off);
        __asm__("" : "+v"(x));
        isum[0][b] = _mm512_dpbusd_epi32(isum[0][b], wv[0], x);
        isum[1][b] = _mm512_dpbusd_epi32(isum[1][b], wv[1], x);
      }
    } else {
      for (int c = 0; c < S / 2; ++c) {
        const __m512i v0 = _mm512_loadu_si512(qg[0] + 64 * c), v1 = _mm512_loadu_si512(qg[1] + 64 * c);
        const __m512i lo0 = _mm512_and_si512(v0, m4), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
        const __m512i lo1 = _mm512_and_si512(v1, m4), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
        for (int b = 0; b < NX; ++b) {
          const int8_t* xa = a.qa + (r0 + b) * a.I + off + 128 * c;
          __m512i x0 = _mm512_loadu_si512(xa), x1 = _mm512_loadu_si512(xa + 64);
          __asm__("" : "+v"(x0), "+v"(x1));
          isum[0][b] = _mm512_dpbusd_epi32(isum[0][b], lo0, x0);
          isum[0][b] = _mm512_dpbusd_epi32(isum[0][b], hi0, x1);
          isum[1][b] = _mm512_dpbusd_epi32(isum[1][b], lo1, x0);
          isum[1][b] = _mm512_dpbusd_epi32(isum[1][b], hi1, x1);
        }
      }
    }
  } else {
    for (int t = 0; t < S; ++t) {
      const __m512i w0 = _mm512_loadu_si512(qg[0] + 64 * t), w1 = _mm512_loadu_si512(qg[1] + 64 * t);
      for (int b = 0; b < NX; ++b) {
        __m512i x = _mm512_loadu_si512(a.qa + (r0 + b) * a.I + off + 64 * t);
        __asm__("" : "+v"(x));
        isum[0][b] = _mm512_dpbusd_epi32(isum[0][b], w0, x);
        isum[1][b] = _mm512_dpbusd_epi32(isum[1][b], w1, x);
      }
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << G) - 1);
  const __m512i lanes = _mm512_set_epi32(15 / L, 14 / L, 13 / L, 12 / L, 11 / L, 10 / L, 9 / L, 8 / L, 7 / L, 6 / L,
                                         5 / L, 4 / L, 3 / L, 2 / L, 1 / L, 0);
  __m512 dl[2], m[2];
  for (int w = 0; w < 2; ++w) {
    const __m512 d = _mm512_maskz_loadu_ps(mask, dg[w]);
    m[w] = FMT == 3 ? _mm512_maskz_loadu_ps(mask, mg[w]) : _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
    dl[w] = G == 16 ? d : _mm512_permutexvar_ps(lanes, d);
  }
  for (int b = 0; b < NX; ++b) {
    const float* sa = a.sa + (r0 + b) * a.nb + g0;
    const __m512 sv = _mm512_maskz_loadu_ps(mask, sa);
    const __m512 sl = G == 16 ? sv : _mm512_permutexvar_ps(lanes, sv);
    const __m512 ms = _mm512_maskz_loadu_ps(mask, a.ms + (r0 + b) * a.nb + g0);
    acc0[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[0][b]), _mm512_mul_ps(dl[0], sl), acc0[b]);
    acc0[b] = _mm512_fmadd_ps(m[0], ms, acc0[b]);
    acc1[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[1][b]), _mm512_mul_ps(dl[1], sl), acc1[b]);
    acc1[b] = _mm512_fmadd_ps(m[1], ms, acc1[b]);
  }
}

// weight rows o, o + 1 x activation rows r0 .. r0 + NX - 1 -> y (vrow_rows' bits)
template <int FMT, int NX>
inline void vpair_rows(const uint8_t* q, const float* s, int64_t qrow, int64_t srow, const ActRows& a, float* y,
                       int64_t o, int64_t r0, int64_t O) {
  __m512 acc0[NX], acc1[NX];
  for (int b = 0; b < NX; ++b) acc0[b] = acc1[b] = _mm512_setzero_ps();
  const int64_t nb = a.nb;
  const float* s2 = s + srow;
  int64_t g0 = 0;
  while (g0 < nb) {
    const int G = group_blocks(nb - g0);
    const int64_t qo = (FMT == 3 ? 16 : 32) * g0;
    const uint8_t* qg[2] = {q + qo, q + qrow + qo};
    const float* dg[2] = {s + g0, s2 + g0};
    const float* mg[2] = {FMT == 3 ? s + nb + g0 : nullptr, FMT == 3 ? s2 + nb + g0 : nullptr};
    switch (G) {
      case 16: vgroup2<FMT, 16, NX>(qg, dg, mg, a, r0, g0, acc0, acc1); break;
      case 8: vgroup2<FMT, 8, NX>(qg, dg, mg, a, r0, g0, acc0, acc1); break;
      case 4: vgroup2<FMT, 4, NX>(qg, dg, mg, a, r0, g0, acc0, acc1); break;
      default: vgroup2<FMT, 2, NX>(qg, dg, mg, a, r0, g0, acc0, acc1); break;
    }
    g0 += G;
  }
  for (int b = 0; b < NX; ++b) {
    y[(r0 + b) * O + o] = _mm512_reduce_add_ps(acc0[b]);
    y[(r0 + b) * O + o + 1] = _mm512_reduce_add_ps(acc1[b]);
  }
}

template <int FMT>
void vrows(const uint8_t* q, const float* s, int64_t qrow, int64_t srow, const ActRows& a, float* y, int64_t o0,
           int64_t o1, int64_t R, int64_t O) {
  int64_t o = o0;
  // pairs of weight rows x tiles of 4 activation rows (vrow_rows' bits): 1.2-1.4x at 2-16
  // rows, except the Q8_0 output layer at 3-4 rows (0.7x as pairs, measured; alone there)
  if (R >= 2 && (FMT == 3 || R == 2 || R >= 5))
    for (; o + 2 <= o1; o += 2) {
      const uint8_t* qo = q + o * qrow;
      const float* so = s + o * srow;
      if (o + 6 <= o1) {  // rows o + 4, o + 5 (see prefetch_lines)
        prefetch_lines<_MM_HINT_T0>(qo + 4 * qrow, 2 * qrow);
        prefetch_lines<_MM_HINT_T0>(so + 4 * srow, 2 * srow * static_cast<int64_t>(sizeof(float)));
      }
      int64_t r = 0;
      for (; r + 4 <= R; r += 4) vpair_rows<FMT, 4>(qo, so, qrow, srow, a, y, o, r, O);
      switch (R - r) {
        case 3: vpair_rows<FMT, 3>(qo, so, qrow, srow, a, y, o, r, O); break;
        case 2: vpair_rows<FMT, 2>(qo, so, qrow, srow, a, y, o, r, O); break;
        case 1: vpair_rows<FMT, 1>(qo, so, qrow, srow, a, y, o, r, O); break;
        default: break;
      }
    }
  for (; o < o1; ++o) {
    const uint8_t* qo = q + o * qrow;
    const float* so = s + o * srow;
    if (o + 4 < o1) {
      prefetch_lines<_MM_HINT_T0>(qo + 4 * qrow, qrow);
      prefetch_lines<_MM_HINT_T0>(so + 4 * srow, srow * static_cast<int64_t>(sizeof(float)));
    }
    int64_t r = 0;
    for (; r + 8 <= R; r += 8) vrow_rows<FMT, 8>(qo, so, a, y, o, r, O);
    switch (R - r) {
      case 7: vrow_rows<FMT, 7>(qo, so, a, y, o, r, O); break;
      case 6: vrow_rows<FMT, 6>(qo, so, a, y, o, r, O); break;
      case 5: vrow_rows<FMT, 5>(qo, so, a, y, o, r, O); break;
      case 4: vrow_rows<FMT, 4>(qo, so, a, y, o, r, O); break;
      case 3: vrow_rows<FMT, 3>(qo, so, a, y, o, r, O); break;
      case 2: vrow_rows<FMT, 2>(qo, so, a, y, o, r, O); break;
      case 1: vrow_rows<FMT, 1>(qo, so, a, y, o, r, O); break;
      default: break;
    }
  }
}

}  // namespace kvnni
#pragma GCC pop_options

namespace {
bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && cpu_has_avx512();
}
}  // namespace

// whether this CPU runs the fast-numerics formats (3, 4): AVX-512 F/BW/VL/DQ and VNNI, and
// AVX-512 not masked off (RAGSPEC_CPU_ISA=avx2 / set_cpu_isa("avx2"))
bool fast_numerics_supported() { return cpu_has_vnni() && current_isa() == kIsaAvx512; }

namespace {
torch::Tensor quant_linear_fast(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales,
                                int64_t fmt, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(fast_numerics_supported(),
              "quant_linear: formats 3 and 4 (fast numerics) need AVX-512 VNNI, which this CPU lacks or is masked off");
  const int64_t R = x.size(0), I = x.size(1), O = qs.size(0), nb = I / kQBlock;
  TORCH_CHECK(nb % 2 == 0, "quant_linear: fast numerics need an even number of 32-weight blocks per row");
  const int64_t qrow = fmt == 3 ? I / 2 : I, srow = fmt == 3 ? 2 * nb : nb;
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.size(1) == qrow && qs.scalar_type() == at::kByte,
              "quant_linear: qs shape or dtype (fast formats: uint8)");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == O * srow,
              "quant_linear: scales shape or dtype");
  auto xc = x.contiguous();
  auto y = torch::empty({R, O}, xc.options());
  std::vector<int8_t> qa(R * I);
  std::vector<float> sa(R * nb), ms(R * nb);
  kvnni::quantize_rows(xc.data_ptr<float>(), R, I, qa.data(), sa.data(), ms.data());
  const kvnni::ActRows a{qa.data(), sa.data(), ms.data(), I, nb};
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, O, 64, [&](int64_t o0, int64_t o1) {
    if (fmt == 3) kvnni::vrows<3>(qp, sp, qrow, srow, a, yp, o0, o1, R, O);
    else kvnni::vrows<4>(qp, sp, qrow, srow, a, yp, o0, o1, R, O);
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}
}  // namespace


// x: float32 [R, I] (I a multiple of 32); qs: uint8 [O, I / 2] (fmt 0, Q4_1) or int8 [O, I]
// (fmt 1, Q8_0; fmt 2, Q6_K's values); scales: float32 [O, I / 32, 2] (Q4_1: d, m), [O, I / 32]
// (Q8_0: d) or [O, I / 16] (fmt 2: d per 16 weights); bias float32 [O] or empty -> float32
// [R, O], equal to skinny_linear(x, dequantized, bias).
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, int64_t fmt,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(fmt >= 0 && fmt <= 4,
              "quant_linear: fmt must be 0 (Q4_1), 1 (Q8_0), 2 (Q6_K), 3 or 4 (Q4_1 / Q8_0 for fast numerics)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quant_linear: x must be float32 [R, I]");
  const int64_t R = x.size(0), I = x.size(1), O = qs.size(0);
  TORCH_CHECK(I % kQBlock == 0, "quant_linear: in-features must be a multiple of 32");
  if (fmt >= 3) return quant_linear_fast(x, qs, scales, fmt, bias);
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.size(1) == (fmt == 0 ? I / 2 : I) &&
                  qs.scalar_type() == (fmt == 0 ? at::kByte : at::kChar), "quant_linear: qs shape or dtype");
  const int64_t srow = fmt == 0 ? 2 * (I / kQBlock) : fmt == 1 ? I / kQBlock : I / kQ6Block;  // scales per row
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == O * srow,
              "quant_linear: scales shape or dtype");
  x = x.contiguous();
  auto y = torch::empty({R, O}, x.options());
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t qrow = fmt == 0 ? I / 2 : I;
  auto dequant = [&](int64_t o, float* w) {
    if (fmt == 0) dequant_q4_1(qp + o * qrow, sp + o * srow, w, I);
    else if (fmt == 1) dequant_q8_0(reinterpret_cast<const int8_t*>(qp + o * qrow), sp + o * srow, w, I);
    else dequant_q6_k(reinterpret_cast<const int8_t*>(qp + o * qrow), sp + o * srow, w, I);
  };
  const int64_t blocks = O / 4;
  if (current_isa() == kIsaAvx512) {
    const int64_t alone = alone_rows();
    at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
      k512::quant_blocks(fmt, qp, sp, qrow, srow, xp, yp, b0, b1, R, I, O, alone);
    });
    std::vector<float> row(I);
    for (int64_t o = 4 * blocks; o < O; ++o) k512::quant_row(fmt, qp, sp, qrow, srow, xp, yp, o, R, I, O, row.data());
    if (bias.has_value() && bias->defined()) y.add_(*bias);
    return y;
  }
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(4 * I);
    for (int64_t b = b0; b < b1; ++b) {
      for (int a = 0; a < 4; ++a) dequant(4 * b + a, buf.data() + a * I);
      rows_block<4>(buf.data(), xp, yp, 4 * b, R, I, O);
    }
  });
  std::vector<float> row(I);
  for (int64_t o = 4 * blocks; o < O; ++o) {
    dequant(o, row.data());
    rows_block<1>(row.data(), xp, yp, o, R, I, O);
  }
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}



// ---------------------------------------------------------------------------------------
// AVX-512 attention work item (the same split-K items, blocks and logical key order as
// attend_block above, chosen where the kernels run AVX-512). attend_block computes each
// query row alone and loads every key and value once per row: one 32-byte load per FMA,
// and the 2-core Zen 4 issues ~4.5 G such loads/s against ~7 G FMA/s per core, so at 8
// query rows and 512 keys a step's attention cost ~5.6 ms, 4x the 1-row cost. Here the
// rows of a key block that see the same keys (the G query heads of one position; every
// position where the block is all cached keys) share the block's keys and values:
//
// * the block's keys are gathered in logical order and transposed once per such class of
//   rows (kt: float32 [d, 64], absent keys zero), and the scores of 4 rows x 64 keys
//   accumulate over the d dimensions with the row's scaled query broadcast (16 zmm
//   accumulators: 2 FMAs per load);
// * p = exp(s - max) in 16 lanes (the Cephes polynomial above), absent keys exactly 0;
// * the values are read once per tile of 4 rows: out[row] += p[row, t] * v[t] over the
//   present keys in logical order.
//
// Each row's arithmetic (its score's sum over d in order, its max, its exp, its lane-wise
// sums over the keys) depends only on its own query and keys, never on which rows share its
// tile or class: a row gets the same bits in a 1-row step as in any verification. Classes
// of fewer than kMinTiled rows (a one-position step: the G query heads of one position)
// take position_rows: attend_row's arithmetic without the transpose. Every item first
// prefetches its block's keys and values (prefetch_rows).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace {
namespace k512attn {

inline __m512 exp512(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-88.3762626647949f);
  x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127));
  e = _mm512_slli_epi32(e, 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

constexpr int kTile = 4;  // query rows per tile
// classes of fewer rows take position_rows below (attend_row's bits): the default model's
// one-position step (3 rows) ran 1.1x faster tiled with its keys in cache but 0.75x in the
// model's step, its keys read from memory (1.75 against 1.3 ms per step at 512 keys);
// gemma3's (4 rows at d = 256, where attend_row's query no longer fits in registers) is tiled
constexpr int64_t kMinTiled = 4;

// out[c][t] = key slots[t] (c0 + c), c, t < 16 (zero where slots[t] < 0): key rows at kh,
// stride ks; out's rows kKeyBlock apart
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <class T>
inline void transpose16(const T* kh, int64_t ks, const int64_t* slots, int64_t c0, float* out) {
  __m512 r[16];
  for (int t = 0; t < 16; ++t) r[t] = slots[t] >= 0 ? load16(kh + slots[t] * ks + c0) : _mm512_setzero_ps();
  __m512 u[16];
  for (int t = 0; t < 16; t += 2) {
    u[t] = _mm512_unpacklo_ps(r[t], r[t + 1]);
    u[t + 1] = _mm512_unpackhi_ps(r[t], r[t + 1]);
  }
  for (int t = 0; t < 16; t += 4) {
    r[t] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u[t]), _mm512_castps_pd(u[t + 2])));
    r[t + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u[t]), _mm512_castps_pd(u[t + 2])));
    r[t + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u[t + 1]), _mm512_castps_pd(u[t + 3])));
    r[t + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u[t + 1]), _mm512_castps_pd(u[t + 3])));
  }
  // r[4g + j] holds, in each 128-bit lane L, column 4L + j' of rows 4g .. 4g + 3 (j' the
  // column order of the two unpack stages: 0, 1, 2, 3 for j = 0, 1, 2, 3)
  for (int g = 0; g < 4; ++g)
    for (int j = 0; j < 4; ++j) u[4 * j + g] = r[4 * g + j];
  // u[4j + g]: lane L = column 4L + j, rows 4g..4g+3; gather the four g's per column
  for (int j = 0; j < 4; ++j) {
    const __m512 a0 = _mm512_shuffle_f32x4(u[4 * j], u[4 * j + 1], 0x88);  // lanes 0,2 of g0 | 0,2 of g1
    const __m512 a1 = _mm512_shuffle_f32x4(u[4 * j], u[4 * j + 1], 0xDD);  // lanes 1,3 of g0 | 1,3 of g1
    const __m512 b0 = _mm512_shuffle_f32x4(u[4 * j + 2], u[4 * j + 3], 0x88);
    const __m512 b1 = _mm512_shuffle_f32x4(u[4 * j + 2], u[4 * j + 3], 0xDD);
    // column 4L + j for L = 0..3: [g0 g1 g2 g3] lanes L
    _mm512_storeu_ps(out + (0 + j) * kKeyBlock, _mm512_shuffle_f32x4(a0, b0, 0x88));
    _mm512_storeu_ps(out + (8 + j) * kKeyBlock, _mm512_shuffle_f32x4(a0, b0, 0xDD));
    _mm512_storeu_ps(out + (4 + j) * kKeyBlock, _mm512_shuffle_f32x4(a1, b1, 0x88));
    _mm512_storeu_ps(out + (12 + j) * kKeyBlock, _mm512_shuffle_f32x4(a1, b1, 0xDD));
  }
}

// scores, softmax and value sums of NR rows (query pointers qp[], scaled by a.scale) over
// one block's present keys: kt float32 [d, 64] (transposed, absent keys 0), present: one
// bit per logical key, slot: physical slot per logical key (-1 absent); results to st[r]
// (max, sum of exp) and pr[r] (float32 [d])
template <int NR, class T>
void tile_rows(const AttnArgs& a, int64_t d, const float* kt, __mmask16 present[4], const int64_t* slot, int64_t n,
               const T* vh, const float* const* qp, float* const* st, float* const* pr, float* pbuf) {
  alignas(64) float qs[NR][256];
  const __m512 sc = _mm512_set1_ps(a.scale);
  for (int r = 0; r < NR; ++r)
    for (int64_t c = 0; c < d; c += 16) _mm512_store_ps(qs[r] + c, _mm512_mul_ps(_mm512_loadu_ps(qp[r] + c), sc));
  // the score's sum over d as attend_block's: 8 partial sums (partial l: the dimensions
  // l, l + 8, l + 16, ... in order), then ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)),
  // its 8 lanes and hsum8, so the scores are bit for bit the AVX2 item's
  __m512 acc[NR][4], part[8][NR][4];
  for (int l = 0; l < 8; ++l) {
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_setzero_ps();
    for (int64_t c = l; c < d; c += 8) {
      const float* kc = kt + c * kKeyBlock;
      __m512 k0 = _mm512_load_ps(kc), k1 = _mm512_load_ps(kc + 16), k2 = _mm512_load_ps(kc + 32),
             k3 = _mm512_load_ps(kc + 48);
      __asm__("" : "+v"(k0), "+v"(k1), "+v"(k2), "+v"(k3));
      for (int r = 0; r < NR; ++r) {
        const __m512 qb = _mm512_set1_ps(qs[r][c]);
        acc[r][0] = _mm512_fmadd_ps(qb, k0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(qb, k1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(qb, k2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(qb, k3, acc[r][3]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < 4; ++k) part[l][r][k] = acc[r][k];
  }
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < 4; ++k) {
      const __m512 a01 = _mm512_add_ps(part[0][r][k], part[1][r][k]), a23 = _mm512_add_ps(part[2][r][k], part[3][r][k]);
      const __m512 a45 = _mm512_add_ps(part[4][r][k], part[5][r][k]), a67 = _mm512_add_ps(part[6][r][k], part[7][r][k]);
      acc[r][k] = _mm512_add_ps(_mm512_add_ps(a01, a23), _mm512_add_ps(a45, a67));
    }
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (int r = 0; r < NR; ++r) {
    __m512 s[4];
    for (int k = 0; k < 4; ++k) s[k] = _mm512_mask_blend_ps(present[k], ninf, acc[r][k]);
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3])));
    const __m512 vmx = _mm512_set1_ps(mx);
    __m256 lsum = _mm256_setzero_ps();  // attend_block's order: lane l sums keys l, l + 8, ...
    for (int k = 0; k < 4; ++k) {
      const __m512 e = _mm512_maskz_mov_ps(present[k], exp512(_mm512_sub_ps(s[k], vmx)));
      _mm512_store_ps(pbuf + r * kKeyBlock + 16 * k, e);
      lsum = _mm256_add_ps(lsum, _mm512_castps512_ps256(e));
      lsum = _mm256_add_ps(lsum, _mm512_extractf32x8_ps(e, 1));
    }
    st[r][0] = mx;
    st[r][1] = hsum(lsum);
  }
  for (int64_t d0 = 0; d0 < d; d0 += 64) {
    const int nc = static_cast<int>(std::min<int64_t>(4, (d - d0) / 16));
    __m512 o[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < 4; ++k) o[r][k] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      if (slot[t] < 0) continue;
      const T* vrow = vh + slot[t] * a.vsS + d0;
      __m512 v[4];
      for (int k = 0; k < 4; ++k) v[k] = k < nc ? load16(vrow + 16 * k) : _mm512_setzero_ps();
      __asm__("" : "+v"(v[0]), "+v"(v[1]), "+v"(v[2]), "+v"(v[3]));
      for (int r = 0; r < NR; ++r) {
        const __m512 pb = _mm512_set1_ps(pbuf[r * kKeyBlock + t]);
        for (int k = 0; k < 4; ++k) o[r][k] = _mm512_fmadd_ps(pb, v[k], o[r][k]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < nc; ++k) _mm512_storeu_ps(pr[r] + d0 + 16 * k, o[r][k]);
  }
}

// The NR (<= 3) rows that see the same keys of one block (the G query heads of one
// position), with attend_row's arithmetic and so its bits: each row's score sums over d
// in 8 lanes in the same order and hsum8, the same max, exp and lane order of the sum of
// exps, and its value sums over the present keys in logical order (lane-wise fused
// multiply-adds: 16 lanes give each lane what 8 give it). What differs is the work around
// that arithmetic: the keys' slots are found once for all the rows (slot null: the block's
// n keys are all present, at slots j0 .. j0 + n - 1, the common case of cached keys in
// order) instead of per row, -inf and the max are 8-lane vector operations instead of
// per-key scalar loops, and each key and value row is loaded once for all NR rows (the
// queries are FMA memory operands). attend_row spent more on that work than on its fused
// multiply-adds: a one-position call over 740 cached keys (9 query heads, 3 key/value
// heads, d = 64, keys in cache) took 45.7 -> 27.0 us on one thread of the 2-core Xeon,
// 27.2 -> 18.1 us on two.
template <int ND, int NR, class T>
void position_rows(const AttnArgs& a, int64_t d, const T* kh, const T* vh, const int64_t* slot, int64_t j0, int64_t n,
                   const float* const* qp, float* const* st, float* const* pr, float* pbuf) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  const int64_t n8 = (n + 7) / 8 * 8;
  // the rows' scaled queries (attend_row's qv), read as FMA memory operands
  alignas(32) float qs[NR][8 * ND];
  for (int z = 0; z < NR; ++z)
    for (int c = 0; c < ND; ++c)
      _mm256_store_ps(qs[z] + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(qp[z] + 8 * c), _mm256_set1_ps(a.scale)));
  // scores: each key row loaded once for all NR rows (8 keys x NR rows of accumulators,
  // each the chain attend_row builds: q[0] k[0], then + q[c] k[c] for c = 1 ..)
  __m256 vmax[NR];
  for (int z = 0; z < NR; ++z) vmax[z] = ninf;
  for (int64_t j = 0; j < n8; j += 8) {
    __m256 acc[NR][8];
    unsigned bits = 0;
    int64_t sls[8];
    for (int t = 0; t < 8; ++t) {
      sls[t] = j + t < n ? (slot ? slot[j + t] : j0 + j + t) : -1;
      bits |= (sls[t] >= 0 ? 1u : 0u) << t;
    }
    for (int t = 0; t < 8; ++t) {
      if (sls[t] < 0) {
        for (int z = 0; z < NR; ++z) acc[z][t] = _mm256_setzero_ps();
        continue;
      }
      const T* krow = kh + sls[t] * a.ksS;
      const __m256 k0 = load8(krow);
      for (int z = 0; z < NR; ++z) acc[z][t] = _mm256_mul_ps(_mm256_load_ps(qs[z]), k0);
      for (int c = 1; c < ND; ++c) {
        const __m256 kc = load8(krow + 8 * c);
        for (int z = 0; z < NR; ++z) acc[z][t] = _mm256_fmadd_ps(_mm256_load_ps(qs[z] + 8 * c), kc, acc[z][t]);
      }
    }
    for (int z = 0; z < NR; ++z) {
      const __m256 sv = _mm256_mask_blend_ps(static_cast<__mmask8>(bits), ninf, hsum8(acc[z]));
      vmax[z] = _mm256_max_ps(vmax[z], sv);
      _mm256_store_ps(pbuf + z * kKeyBlock + j, sv);
    }
  }
  for (int z = 0; z < NR; ++z) {
    float* sc = pbuf + z * kKeyBlock;
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax[z]), _mm256_extractf128_ps(vmax[z], 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float mx = _mm_cvtss_f32(m4);
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 lsum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n8; j += 8) {
      const __m256 sv = _mm256_load_ps(sc + j);
      const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(sv, ninf, _CMP_EQ_OQ), exp256(_mm256_sub_ps(sv, vmx)));
      _mm256_store_ps(sc + j, e);
      lsum = _mm256_add_ps(lsum, e);
    }
    st[z][0] = mx;
    st[z][1] = hsum(lsum);
  }
  for (int64_t d0 = 0; d0 < d; d0 += 64) {
    const int nc = static_cast<int>(std::min<int64_t>(4, (d - d0) / 16));
    __m512 o[NR][4];
    for (int z = 0; z < NR; ++z)
      for (int k = 0; k < 4; ++k) o[z][k] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const int64_t sl = slot ? slot[t] : j0 + t;
      if (sl < 0) continue;
      const T* vrow = vh + sl * a.vsS + d0;
      __m512 v[4];
      for (int k = 0; k < 4; ++k) v[k] = k < nc ? load16(vrow + 16 * k) : _mm512_setzero_ps();
      for (int z = 0; z < NR; ++z) {
        const __m512 pb = _mm512_set1_ps(pbuf[z * kKeyBlock + t]);
        for (int k = 0; k < 4; ++k) o[z][k] = _mm512_fmadd_ps(pb, v[k], o[z][k]);
      }
    }
    for (int z = 0; z < NR; ++z)
      for (int k = 0; k < nc; ++k) _mm512_storeu_ps(pr[z] + d0 + 16 * k, o[z][k]);
  }
}

template <int NR, class T>
inline void position_rows_d(const AttnArgs& a, int64_t d, const T* kh, const T* vh, const int64_t* slot, int64_t j0,
                            int64_t n, const float* const* qp, float* const* st, float* const* pr, float* pbuf) {
  if (d == 32) position_rows<4, NR, T>(a, d, kh, vh, slot, j0, n, qp, st, pr, pbuf);
  else if (d == 64) position_rows<8, NR, T>(a, d, kh, vh, slot, j0, n, qp, st, pr, pbuf);
  else position_rows<16, NR, T>(a, d, kh, vh, slot, j0, n, qp, st, pr, pbuf);
}

// the query, statistics and partial-output pointers of rows[0 .. nr) in item (h, b)
inline void row_pointers(const AttnArgs& a, int64_t h, int64_t b, int64_t d, const int64_t* rows, int nr,
                         const float** qp, float** st, float** pr) {
  const int64_t R = a.G * a.Q, Q = a.Q;
  for (int z = 0; z < nr; ++z) {
    const int64_t r = rows[z], g = r / Q, u = r % Q;
    qp[z] = a.q + (h * a.G + g) * a.qsH + u * a.qsQ;
    st[z] = a.stats + ((h * a.nb + b) * R + r) * 2;
    pr[z] = a.part + ((h * a.nb + b) * R + r) * d;
  }
}

// rows (all seeing keys sl[0 .. 64) of block b, or, with sl null, keys j0 .. j0 + n - 1)
// through position_rows, 3 rows a call; d = 256 (whose query does not fit in
// registers) through attend_row, the same bits
template <class T>
__attribute__((noinline)) void small_class(const AttnArgs& a, int64_t h, int64_t b, int64_t d, const int64_t* rows, int64_t nrows,
                 const int64_t* sl, int64_t n, float* pbuf, float* score) {
  const int64_t j0 = b * kKeyBlock;
  if (d > 128) {
    for (int64_t z = 0; z < nrows; ++z) attend_row_d<T>(a, d, h, b, rows[z], score);
    return;
  }
  const T* kh = keys_of<T>(a) + h * a.ksH;
  const T* vh = values_of<T>(a) + h * a.vsH;
  constexpr int64_t kRows = 3;  // rows per position_rows call: 3 x 8 score accumulators
  for (int64_t r0 = 0; r0 < nrows; r0 += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, nrows - r0));
    const float* qp[kRows];
    float* st[kRows];
    float* pr[kRows];
    row_pointers(a, h, b, d, rows + r0, nr, qp, st, pr);
    switch (nr) {
      case 3: position_rows_d<3, T>(a, d, kh, vh, sl, j0, n, qp, st, pr, pbuf); break;
      case 2: position_rows_d<2, T>(a, d, kh, vh, sl, j0, n, qp, st, pr, pbuf); break;
      default: position_rows_d<1, T>(a, d, kh, vh, sl, j0, n, qp, st, pr, pbuf); break;
    }
  }
}

// one work item: key/value head h, key block b, every query row of the head's group (the
// same item and outputs as attend_block)
template <class T>
void attend_block(const AttnArgs& a, int64_t h, int64_t b, int64_t d, float* kt, float* pbuf, float* score) {
  const int64_t R = a.G * a.Q, Q = a.Q;
  int64_t kt_slots[kKeyBlock];  // the slots kt holds now
  bool kt_slots_valid = false;
  const int64_t j0 = b * kKeyBlock;
  const T* kh = keys_of<T>(a) + h * a.ksH;
  const T* vh = values_of<T>(a) + h * a.vsH;
  prefetch_rows(kh, vh, a.ksS, a.vsS, j0, std::min(a.S, j0 + kKeyBlock), d);
  if (!a.mask && R < kMinTiled) {  // every row sees every key (no mask): keys j0 .. in order, one class
    int64_t rr[kMinTiled];
    for (int64_t r = 0; r < R; ++r) rr[r] = r;
    const int64_t nk = std::min(a.S, j0 + kKeyBlock) - j0;
    small_class<T>(a, h, b, d, rr, R, nullptr, nk, pbuf, score);
    return;
  }
  // each position's logical keys in this block: n[i] and slot[i][t] (-1 absent)
  std::vector<int64_t> slots(Q * kKeyBlock), n(Q), cls(Q, -1);
  std::vector<char> any(Q, 0);
  for (int64_t i = 0; i < Q; ++i) {
    n[i] = std::max<int64_t>(0, std::min(a.past + a.chain_len[i], j0 + kKeyBlock) - j0);
    const bool* mrow = a.mask ? a.mask + i * a.S : nullptr;
    int64_t* sl = slots.data() + i * kKeyBlock;
    for (int64_t t = 0; t < kKeyBlock; ++t) {
      const int64_t jl = j0 + t;
      sl[t] = t >= n[i] ? -1 : jl < a.past ? ((mrow && !mrow[jl]) ? -1 : jl) : a.chain[i * (a.S - a.past) + (jl - a.past)];
      any[i] = any[i] || sl[t] >= 0;
    }
  }
  // classes of positions with the same keys in this block
  for (int64_t i = 0; i < Q; ++i) {
    if (cls[i] >= 0) continue;
    cls[i] = i;
    for (int64_t u = i + 1; u < Q; ++u)
      if (cls[u] < 0 && n[u] == n[i] &&
          std::memcmp(slots.data() + u * kKeyBlock, slots.data() + i * kKeyBlock, kKeyBlock * sizeof(int64_t)) == 0)
        cls[u] = i;
  }
  std::vector<int64_t> rows;
  rows.reserve(R);
  for (int64_t i = 0; i < Q; ++i) {
    if (cls[i] != i) continue;
    rows.clear();
    for (int64_t u = i; u < Q; ++u)
      if (cls[u] == i)
        for (int64_t g = 0; g < a.G; ++g) rows.push_back(g * Q + u);
    if (!any[i]) {  // every key of this block hidden from these rows (or none left)
      for (const int64_t r : rows) {
        float* st = a.stats + ((h * a.nb + b) * R + r) * 2;
        st[0] = -INFINITY;
        st[1] = 0.f;
        float* pr = a.part + ((h * a.nb + b) * R + r) * d;
        std::fill(pr, pr + d, 0.f);
      }
      continue;
    }
    if (static_cast<int64_t>(rows.size()) < kMinTiled) {  // attend_row's arithmetic (same bits)
      const int64_t* sl = slots.data() + i * kKeyBlock;
      bool in_order = true;  // all n[i] keys present at slots j0 .. j0 + n[i] - 1
      for (int64_t t = 0; t < n[i] && in_order; ++t) in_order = sl[t] == j0 + t;
      small_class<T>(a, h, b, d, rows.data(), static_cast<int64_t>(rows.size()), in_order ? nullptr : sl, n[i], pbuf,
                     score);
      continue;
    }
    const int64_t* sl = slots.data() + i * kKeyBlock;
    __mmask16 present[4];
    for (int k = 0; k < 4; ++k) {
      unsigned bits = 0;
      for (int l = 0; l < 16; ++l) bits |= (sl[16 * k + l] >= 0 ? 1u : 0u) << l;
      present[k] = static_cast<__mmask16>(bits);
    }
    // kt[c][t] = key slot[t], dimension c (zero where absent): 16 x 16 tiles, each kept
    // from the previous class where its 16 slots are the same
    for (int t0 = 0; t0 < kKeyBlock; t0 += 16) {
      if (kt_slots_valid && std::memcmp(kt_slots + t0, sl + t0, 16 * sizeof(int64_t)) == 0) continue;
      for (int64_t c0 = 0; c0 < d; c0 += 16) transpose16(kh, a.ksS, sl + t0, c0, kt + c0 * kKeyBlock + t0);
      std::memcpy(kt_slots + t0, sl + t0, 16 * sizeof(int64_t));
    }
    kt_slots_valid = true;
    for (size_t r0 = 0; r0 < rows.size(); r0 += kTile) {
      const int nr = static_cast<int>(std::min<size_t>(kTile, rows.size() - r0));
      const float* qp[kTile];
      float* st[kTile];
      float* pr[kTile];
      row_pointers(a, h, b, d, rows.data() + r0, nr, qp, st, pr);
      switch (nr) {
        case 4: tile_rows<4, T>(a, d, kt, present, sl, n[i], vh, qp, st, pr, pbuf); break;
        case 3: tile_rows<3, T>(a, d, kt, present, sl, n[i], vh, qp, st, pr, pbuf); break;
        case 2: tile_rows<2, T>(a, d, kt, present, sl, n[i], vh, qp, st, pr, pbuf); break;
        default: tile_rows<1, T>(a, d, kt, present, sl, n[i], vh, qp, st, pr, pbuf); break;
      }
    }
  }
}

}  // namespace k512attn
}  // namespace
#pragma GCC pop_options


namespace {

// One request's part of a few_query_attention call: its checked inputs, its key/value
// arguments (AttnArgs, pointing into the members: a job is never moved once made) and
// its outputs.
struct AttnJob {
  torch::Tensor query, key, value, m2, out;
  std::vector<float> stats, part;  // [Hkv, nb, R, 2], [Hkv, nb, R, d]
  float* out_p = nullptr;          // [Q, Hq, d] contiguous: out's data, or the caller's buffer
  std::vector<int64_t> chain, chain_len;
  AttnArgs a{};
  int64_t Hq = 0, Hkv = 0, d = 0, R = 0, nb = 0;
  bool half = false, tiled = false;

  // from raw pointers (AttnRequest: the native step's views of its buffers, no tensors)
  AttnJob(const AttnRequest& r, int64_t hq, int64_t hkv, int64_t dim, double scale) { init(r, hq, hkv, dim, scale); }

  // the job's arguments, statistics buffers and chains for request r (both constructors)
  void init(const AttnRequest& r, int64_t hq, int64_t hkv, int64_t dim, double scale) {
    Hq = hq;
    Hkv = hkv;
    d = dim;
    half = r.half;
    const int64_t Q = r.Q, S = r.S, G = Hq / Hkv;
    R = G * Q;
    nb = (S + kKeyBlock - 1) / kKeyBlock;
    stats.resize(Hkv * nb * R * 2);
    part.resize(Hkv * nb * R * d);
    out_p = r.out;
    init_chain(Q, S, r.mask);
    a = AttnArgs{r.q, half ? nullptr : static_cast<const float*>(r.k), half ? nullptr : static_cast<const float*>(r.v),
                 r.mask, stats.data(), part.data(), G, Q, S, nb, r.qsH, r.qsQ, r.ksH, r.ksS, r.vsH, r.vsS,
                 static_cast<float>(scale), std::max<int64_t>(0, S - Q), chain.data(), chain_len.data()};
    // float16 keys/values (a float16 KV cache): the same kernels loading them widened to
    // float32 (exact), so a row's result is bit for bit the float32 call's over key.float()
    if (half) {
      a.k16 = static_cast<const uint16_t*>(r.k);
      a.v16 = static_cast<const uint16_t*>(r.v);
    }
    tiled = current_isa() == kIsaAvx512;  // k512attn: tiles, and position_rows below kMinTiled rows
  }

  // each row's new slots (the last Q, or all S keys when fewer) that it attends, in order:
  // its logical keys past .. past + chain_len - 1
  void init_chain(int64_t Q, int64_t S, const bool* mp) {
    const int64_t past = std::max<int64_t>(0, S - Q), fresh = S - past;
    chain.assign(Q * fresh, 0);
    chain_len.assign(Q, 0);
    for (int64_t i = 0; i < Q; ++i) {
      int64_t c = 0;
      for (int64_t u = 0; u < fresh; ++u)
        if (!mp || mp[i * S + past + u]) chain[i * fresh + c++] = past + u;
      chain_len[i] = c;
    }
  }

  AttnJob(torch::Tensor q, torch::Tensor k, torch::Tensor v, const c10::optional<torch::Tensor>& mask, double scale) {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1 && k.size(0) == 1,
                "few_query_attention: expects [1, H, L, d] tensors");
    half = k.scalar_type() == at::kHalf;
    TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == v.scalar_type() &&
                    (half || k.scalar_type() == at::kFloat),
                "few_query_attention: float32 queries, float32 or float16 keys and values");
    Hq = q.size(1);
    const int64_t Q = q.size(2);
    d = q.size(3);
    Hkv = k.size(1);
    const int64_t S = k.size(2);
    TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && (d == 32 || d == 64 || d == 128 || d == 256) && k.size(3) == d &&
                    v.sizes() == k.sizes(), "few_query_attention: shape mismatch");
    query = q.stride(3) != 1 ? q.contiguous() : q;
    key = k.stride(3) != 1 ? k.contiguous() : k;
    value = v.stride(3) != 1 ? v.contiguous() : v;
    if (mask.has_value() && mask->defined()) {
      TORCH_CHECK(mask->scalar_type() == at::kBool && mask->size(-1) == S && mask->numel() == Q * S,
                  "few_query_attention: mask must be bool [1, 1, Q, S]");
      m2 = mask->reshape({Q, S}).contiguous();
    }
    out = torch::empty({1, Q, Hq, d}, query.options());
    AttnRequest r{query.data_ptr<float>(), query.stride(1), query.stride(2), key.data_ptr(), value.data_ptr(), half,
                  key.stride(1), key.stride(2), value.stride(1), value.stride(2),
                  m2.defined() ? m2.data_ptr<bool>() : nullptr, Q, S, out.data_ptr<float>()};
    init(r, Hq, Hkv, d, scale);
  }
  AttnJob(const AttnJob&) = delete;
  AttnJob& operator=(const AttnJob&) = delete;

  int64_t items() const { return Hkv * nb; }

  // work item (key/value head h, key block b); kt, pbuf: the tiled path's per-thread buffers
  void run_item(int64_t item, float* kt, float* pbuf, float* score) const {
    const int64_t h = item / nb, b = item % nb;
    if (tiled && half) k512attn::attend_block<uint16_t>(a, h, b, d, kt, pbuf, score);
    else if (tiled) k512attn::attend_block<float>(a, h, b, d, kt, pbuf, score);
    else if (half) attend_block_d<uint16_t>(a, d, h, b, score);
    else attend_block_d<float>(a, d, h, b, score);
  }

  // merge the key blocks of (kv head, query row) hr = h * R + r:
  // out = sum_b e^(m_b - M) part_b / sum_b e^(m_b - M) l_b
  void merge(int64_t hr) const {
    const float* sp = stats.data();
    const float* pp = part.data();
    float* op = out_p;
    const int64_t Q = a.Q, G = a.G;
    const int64_t h = hr / R, r = hr % R;
    const int64_t g = r / Q, i = r % Q;
    float M = -INFINITY;
    for (int64_t b = 0; b < nb; ++b) M = std::max(M, sp[((h * nb + b) * R + r) * 2]);
    float* orow = op + (i * Hq + h * G + g) * d;
    std::fill(orow, orow + d, 0.f);
    if (M == -INFINITY) return;
    float L = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const float* st = sp + ((h * nb + b) * R + r) * 2;
      if (st[0] == -INFINITY) continue;
      const float w = std::exp(st[0] - M);
      L += w * st[1];
      const float* pr = pp + ((h * nb + b) * R + r) * d;
      for (int64_t c = 0; c < d; ++c) orow[c] += w * pr[c];
    }
    const float inv = 1.f / L;
    for (int64_t c = 0; c < d; ++c) orow[c] *= inv;
  }
};

// Every job's work items in one parallel region, then every job's merge: one pool wake-up
// per phase for all requests of a step instead of two per request (~12 us each on the
// 2-core CPU: 30 layers x 8 requests of a batched step paid ~3 ms). Each item and each
// merged row computes what it computes alone, so the bits do not depend on the batch.
void run_jobs(const std::vector<std::unique_ptr<AttnJob>>& jobs) {
  std::vector<int64_t> first(jobs.size() + 1, 0), rows(jobs.size() + 1, 0);
  int64_t merged = 0;  // values the merge phase writes (its parallel threshold)
  int64_t dmax = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    first[j + 1] = first[j] + jobs[j]->items();
    rows[j + 1] = rows[j] + jobs[j]->Hkv * jobs[j]->R;
    merged += jobs[j]->Hkv * jobs[j]->R * jobs[j]->nb * jobs[j]->d;
    dmax = std::max(dmax, jobs[j]->d);
  }
  auto job_of = [](const std::vector<int64_t>& offsets, int64_t x) {
    return static_cast<size_t>(std::upper_bound(offsets.begin(), offsets.end(), x) - offsets.begin() - 1);
  };
  at::parallel_for(0, first.back(), 1, [&](int64_t i0, int64_t i1) {
    // the transposed keys and the tile's probabilities: a buffer per thread, kept between
    // calls (a fresh 16-64 KB allocation per call cost its page faults every step)
    thread_local std::vector<float> scratch;
    const size_t need = static_cast<size_t>(dmax * kKeyBlock + k512attn::kTile * kKeyBlock) + 16;
    if (scratch.size() < need) scratch.assign(need, 0.f);
    float* kt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
    float* pbuf = kt + dmax * kKeyBlock;
    alignas(32) float score[kKeyBlock];
    size_t j = job_of(first, i0);
    for (int64_t item = i0; item < i1; ++item) {
      while (item >= first[j + 1]) ++j;
      jobs[j]->run_item(item - first[j], kt, pbuf, score);
    }
  });
  auto merge = [&](int64_t r0, int64_t r1) {
    size_t j = job_of(rows, r0);
    for (int64_t hr = r0; hr < r1; ++hr) {
      while (hr >= rows[j + 1]) ++j;
      jobs[j]->merge(hr - rows[j]);
    }
  };
  // (one thread below ~16k merged values, a 1-position step's ~4.6k at 512 keys: waking the
  // pool cost more than the work, 0.88x on the whole call)
  if (merged >= 16384) at::parallel_for(0, rows.back(), 1, merge);
  else merge(0, rows.back());
}

}  // namespace

// query: float32 [1, Hq, Q, d]; key, value: float32 or float16 [1, Hkv, S, d] (Hq a multiple
// of Hkv; d = 32, 64, 128 or 256 (gemma3); any strides with a contiguous last dimension, e.g.
// views of a larger cache buffer); mask: bool [1, 1, Q, S] (True = attend) or empty (every
// key attended); scale multiplies q.k -> float32 [1, Q, Hq, d] contiguous.
torch::Tensor few_query_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                                  c10::optional<torch::Tensor> mask, double scale) {
  std::vector<std::unique_ptr<AttnJob>> jobs;
  jobs.push_back(std::make_unique<AttnJob>(query, key, value, mask, scale));
  run_jobs(jobs);
  return jobs[0]->out;
}

std::vector<torch::Tensor> few_query_attention_many(const std::vector<torch::Tensor>& queries,
                                                    const std::vector<torch::Tensor>& keys,
                                                    const std::vector<torch::Tensor>& values,
                                                    const std::vector<c10::optional<torch::Tensor>>& masks,
                                                    double scale) {
  TORCH_CHECK(keys.size() == queries.size() && values.size() == queries.size() && masks.size() == queries.size(),
              "few_query_attention_many: one key, value and mask per query");
  std::vector<std::unique_ptr<AttnJob>> jobs;
  jobs.reserve(queries.size());
  for (size_t i = 0; i < queries.size(); ++i)
    jobs.push_back(std::make_unique<AttnJob>(queries[i], keys[i], values[i], masks[i], scale));
  run_jobs(jobs);
  std::vector<torch::Tensor> outs;
  outs.reserve(jobs.size());
  for (const auto& job : jobs) outs.push_back(job->out);
  return outs;
}

void few_query_attention_into(const std::vector<AttnRequest>& requests, int64_t heads, int64_t kv_heads,
                              int64_t head_dim, double scale) {
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && (head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256),
              "few_query_attention_into: shape mismatch");
  std::vector<std::unique_ptr<AttnJob>> jobs;
  jobs.reserve(requests.size());
  for (const auto& r : requests) {
    TORCH_CHECK(r.Q > 0 && r.S >= r.Q, "few_query_attention_into: every request needs rows and their keys");
    jobs.push_back(std::make_unique<AttnJob>(r, heads, kv_heads, head_dim, scale));
  }
  run_jobs(jobs);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "few-row float32 linear layer (AVX-512 or AVX2/FMA)");
  m.def("quant_linear", &quant_linear, "few-row linear layer over Q4_1 / Q8_0 / Q6_K GGUF weights (AVX-512 or AVX2/FMA)");
  m.def("fast_numerics_supported", &fast_numerics_supported,
        "whether quant_linear's fast-numerics formats (3, 4: int8 activations, AVX-512 VNNI) run on this CPU now");
  m.def("cpu_isa", &cpu_isa, "the instruction set the kernels use now: 'avx512' or 'avx2'");
  m.def("set_cpu_isa", &set_cpu_isa, "switch the kernels to 'avx2', 'avx512' or 'auto'; returns the previous one");
  m.def("few_query_attention_many", &few_query_attention_many,
        "few_query_attention of several requests (each over its own KV) in one parallel region");
  m.def("few_query_attention", &few_query_attention, "attention of a few float32 query rows over a KV cache (AVX-512 or AVX2/FMA)");
  register_decoder_step(m);  // decoder_step.cpp
}
