// The same few-row linear layer over weights kept in a GGUF block format (llama.cpp's
// ggml-quants: Q4_1 for the default model's decoder, Q8_0 for its output layer; Q5_0 and
// Q4_K are read into these two, Q6_K into format 2: int8 with a float32 scale per 16
// weights), streamed at 0.75 / 1.125 / 1.25 bytes per weight instead of 4. Each group of 4
// weight rows is de-quantized into a small float32 buffer and multiplied by skinny_linear's
// tiles (linear_tiles.h),
// so the output is bit for bit that of skinny_linear over the de-quantized float32 weight:
// the de-quantization is exact in float32 (a float16 scale times a 4- or 8-bit integer
// needs at most 19 bits; Q4_K's and Q6_K's d * sc, a float16 times a 6- or 8-bit integer,
// at most 18, and times a 4-bit q or 6-bit q - 32 at most 23; Q4_1's `d * q + m` is one
// rounding, as fmadd), the same arithmetic as gguf-py's dequantize, which is how
// transformers loads a GGUF.
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
#include "linear_tiles.h"

namespace {

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

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace {
namespace k512 {

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
