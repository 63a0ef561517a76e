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
#include "kernel_simd.h"

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
#include "kernel_simd512.h"
namespace {
namespace k512attn {


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
