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
// Layout (ragspec/backend/cpu/quant.py, GGUFWeight.to_fast): a row's blocks are taken in groups
// of G = 16 blocks (then one each of 8, 4, 2 for the rest; the block count must be even).
// Within a group, 32-bit lane k of the accumulator belongs to block k / L (L = 16 / G lanes a
// block) and step t (of S = G / 2) feeds it the block's weights t * 4L + (k % L) * 4 .. + 3:
// after the S steps each lane holds an integer partial sum of its own block, and one
// conversion and fused multiply-add per group scales all 16 lanes. Format 3 (Q4_1): the
// unsigned 4-bit codes in this order, packed per 128 (64 bytes: code p in the low nibble of
// byte p, code 64 + p in the high one; a 2-block group: 32 bytes, p and 32 + p), scales float32
// [O, 2, I / 32] (d row, then m row): w = d * q + m. Format 4 (Q8_0): the codes + 128 as
// uint8 in this order, scales float32 [O, I / 32]: w = d * (u - 128).
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
