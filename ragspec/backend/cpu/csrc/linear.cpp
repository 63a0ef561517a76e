// Few-row linear layer y = x W^T (+ b) for float32 on AVX2/FMA CPUs (the tiles in
// linear_tiles.h), with AVX-512F variants (namespace k512), chosen at the first call from the
// CPU's flags (current_isa, isa.cpp).
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
#include "kernel_simd.h"
#include "linear_tiles.h"

// ---------------------------------------------------------------------------------------
// AVX-512F variants of the linear kernels (linear_tiles.h), compiled for that ISA function by function (the
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

}  // namespace k512
}  // namespace
#pragma GCC pop_options


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
