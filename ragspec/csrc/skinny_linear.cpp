// Few-row linear layer y = x W^T (+ b) for float32 on AVX2/FMA CPUs.
//
// Decoding and draft verification multiply 1-16 activation rows with each weight matrix,
// so the cost is streaming the weight from memory once. BLAS sgemm/sgemv kernels reach
// ~10-13 GB/s on the 2-core AMD CPU these numbers come from (MKL takes its generic path
// on non-Intel CPUs); this kernel streams each weight row once for all activation rows and
// reaches ~20 GB/s. Threads: ATen's intra-op pool (at::parallel_for), split over output
// features. Summation order differs from BLAS (8 lanes, then a horizontal sum), so values
// agree with F.linear to float32 rounding, not bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// NW weight rows (output features o .. o+NW) times NX activation rows.
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
      const __m256 wv = _mm256_loadu_ps(w + (o + a) * I + i);
      for (int b = 0; b < NX; ++b) acc[a][b] = _mm256_fmadd_ps(wv, xv[b], acc[a][b]);
    }
  }
  for (int a = 0; a < NW; ++a) {
    for (int b = 0; b < NX; ++b) {
      float s = hsum(acc[a][b]);
      for (int64_t i = I8; i < I; ++i) s += w[(o + a) * I + i] * x[(r0 + b) * I + i];
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
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      rows_block<4>(w, xp, yp, 4 * b, R, I, O);
    }
  });
  for (int64_t o = 4 * blocks; o < O; ++o) rows_block<1>(w, xp, yp, o, R, I, O);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "few-row float32 linear layer (AVX2/FMA)");
}
