// Causal attention of a prompt chunk (many query rows) over its request's keys: the
// prefill's attention, AVX-512 only.
//
// few_query_attention (attention.cpp) computes each query row's scores with horizontal
// sums and keeps per-key-block partial results for a merge: right for a step's few rows,
// but a 256-row prompt chunk ran it at ~190-215 GFLOP/s and past ~1800 keys its partial
// results leave the cache. Here the query rows are the vector lanes (flash attention's
// online softmax, Dao 2023, with the rows of a tile transposed so that a row's softmax
// statistics are lane-wise):
//
// * a work item is one key/value head, NV vectors of 16 query rows (the group's query
//   heads x a block of 16 positions each) and the keys 0 .. the item's last visible one, in
//   blocks of 64 keys; its queries are scaled and transposed once (qt: [d, NV * 16]);
// * the scores of TK keys x NV vectors accumulate over d with each key's element broadcast
//   (s[t] lane l = q_l . k_t), so a block's max and sum per row are vertical operations;
//   keys a row may not see (past its position: causal) are -inf and weigh exactly 0;
// * out^T [d, NV * 16] += v[t][c] (broadcast) x p[t] over the block's keys, rescaled by
//   exp(old max - new max) first (Milakov & Gimelshein 2018's online softmax).
//
// A row's arithmetic (its score's sum over d in order, each 64-key block's max, exp and
// lane-wise sums in key order, its value sums in key order) depends only on its own query,
// its position and the keys: the same bits whatever the chunk's size, the item's shape or
// the thread that ran it. Values agree with SDPA and few_query_attention to float32
// rounding (the order of the sums differs).
#include "cpu_kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#include "kernel_simd512.h"
namespace {
namespace prefill_attn {

constexpr int64_t kKeys = 64;  // keys per block
constexpr int64_t kLanes = 16;

struct Args {
  const float* q;  // row i of query head hq at q + hq * qsH + i * qsQ
  const float* k;  // key t of key/value head h at k + h * ksH + t * ksS
  const float* v;
  float* out;  // [Q, Hq, d] contiguous
  int64_t Hq, G, Q, S, past, d, qsH, qsQ, ksH, ksS, vsH, vsS;
  float scale;
};

// The scores of TK keys (rows kr[t], d elements each) against NV vectors of transposed
// queries (qt [d, W]) -> out [TK, W]: s[t] lane l = sum over c in order of k_t[c] * q_l[c].
// Out of line, so that its TK x NV accumulators have the registers to themselves.
template <int NV, int TK>
__attribute__((noinline)) void score_tile(const float* qt, int64_t W, const float* const* kr, int64_t d, float* out) {
  __m512 acc[TK][NV];
  for (int t = 0; t < TK; ++t)
    for (int n = 0; n < NV; ++n) acc[t][n] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; ++c) {
    __m512 qv[NV];
    for (int n = 0; n < NV; ++n) qv[n] = _mm512_loadu_ps(qt + c * W + n * kLanes);
    for (int t = 0; t < TK; ++t) {
      const __m512 kb = _mm512_set1_ps(kr[t][c]);
      for (int n = 0; n < NV; ++n) acc[t][n] = _mm512_fmadd_ps(kb, qv[n], acc[t][n]);
    }
  }
  for (int t = 0; t < TK; ++t)
    for (int n = 0; n < NV; ++n) _mm512_storeu_ps(out + t * W + n * kLanes, acc[t][n]);
}

// ot [TC, W] (dimensions c0 .. c0 + TC - 1 of out^T) = ot * corr + sum over the block's nk
// keys in order of v_t[c] * p[t] (pt [nk, W]; vr: the block's first value row at c0, rows
// vs apart). Out of line for the same reason.
template <int NV, int TC>
__attribute__((noinline)) void value_tile(const float* pt, int64_t W, const float* vr, int64_t vs, int64_t nk,
                                          const __m512* corr, float* ot) {
  __m512 o[TC][NV];
  for (int c = 0; c < TC; ++c)
    for (int n = 0; n < NV; ++n) o[c][n] = _mm512_mul_ps(_mm512_loadu_ps(ot + c * W + n * kLanes), corr[n]);
  for (int64_t t = 0; t < nk; ++t, vr += vs) {
    __m512 p[NV];
    for (int n = 0; n < NV; ++n) p[n] = _mm512_loadu_ps(pt + t * W + n * kLanes);
    for (int c = 0; c < TC; ++c) {
      const __m512 vb = _mm512_set1_ps(vr[c]);
      for (int n = 0; n < NV; ++n) o[c][n] = _mm512_fmadd_ps(vb, p[n], o[c][n]);
    }
  }
  for (int c = 0; c < TC; ++c)
    for (int n = 0; n < NV; ++n) _mm512_storeu_ps(ot + c * W + n * kLanes, o[c][n]);
}

// One work item: key/value head h, query heads g0 .. g0 + ng - 1 of its group, positions
// i0 .. i0 + 16 * pv - 1 (vector n = (g - g0) * pv + position block); NV = ng * pv vectors.
// Scratch (floats): qt [d, NV * 16], ot [d, NV * 16], pt [64, NV * 16].
template <int NV>
void run_item(const Args& a, int64_t h, int64_t g0, int64_t ng, int64_t i0, int64_t pv, float* qt, float* ot,
              float* pt) {
  constexpr int64_t W = NV * kLanes;  // lanes of a tile row
  const int64_t d = a.d;
  const int64_t last = std::min(a.Q, i0 + kLanes * pv) - 1;  // the item's last real position
  const int64_t visible = a.past + last + 1;                  // keys any of its rows sees
  // queries, scaled and transposed; lanes past the chunk's rows zero (their results dropped)
  for (int64_t n = 0; n < NV; ++n) {
    const int64_t g = g0 + n / pv, ib = i0 + (n % pv) * kLanes;
    const float* qh = a.q + (h * a.G + g) * a.qsH;
    for (int64_t l = 0; l < kLanes; ++l) {
      const int64_t i = ib + l;
      for (int64_t c = 0; c < d; ++c) qt[c * W + n * kLanes + l] = i < a.Q ? qh[i * a.qsQ + c] * a.scale : 0.f;
    }
  }
  std::fill(ot, ot + d * W, 0.f);
  __m512 mx[NV], sum[NV];
  __m512i pos[NV];  // each lane's position among the keys (past + i)
  for (int n = 0; n < NV; ++n) {
    mx[n] = _mm512_set1_ps(-INFINITY);
    sum[n] = _mm512_setzero_ps();
    const int64_t ib = i0 + (n % pv) * kLanes;
    pos[n] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(a.past + ib)),
                              _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  const float* kh = a.k + h * a.ksH;
  const float* vh = a.v + h * a.vsH;
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  constexpr int TK = NV >= 4 ? 4 : 8;  // keys per score tile (TK x NV accumulators)
  for (int64_t j0 = 0; j0 < visible; j0 += kKeys) {
    const int64_t nk = std::min(kKeys, visible - j0);
    // scores s[t] (lanes: rows) for the block's keys, TK at a time
    __m512 bmx[NV];  // the block's max per row
    for (int n = 0; n < NV; ++n) bmx[n] = ninf;
    for (int64_t t0 = 0; t0 < nk; t0 += TK) {
      const float* kr[TK];  // past the block's last key: its last key again (scores hidden below)
      for (int t = 0; t < TK; ++t) kr[t] = kh + (j0 + std::min<int64_t>(t0 + t, nk - 1)) * a.ksS;
      score_tile<NV, TK>(qt, W, kr, d, pt + t0 * W);
    }
    // key j visible to the lanes whose position >= j
    for (int64_t t = 0; t < nk; ++t) {
      const __m512i j = _mm512_set1_epi32(static_cast<int>(j0 + t));
      for (int n = 0; n < NV; ++n) {
        float* p = pt + t * W + n * kLanes;
        const __m512 s = _mm512_mask_mov_ps(ninf, _mm512_cmp_epi32_mask(pos[n], j, _MM_CMPINT_NLT), _mm512_loadu_ps(p));
        bmx[n] = _mm512_max_ps(bmx[n], s);
        _mm512_storeu_ps(p, s);
      }
    }
    // online softmax: new max, the old sums rescaled, p = exp(s - max) (hidden keys 0)
    __m512 corr[NV];
    for (int n = 0; n < NV; ++n) {
      const __m512 m = _mm512_max_ps(mx[n], bmx[n]);
      corr[n] = exp512(_mm512_sub_ps(mx[n], m));  // mx -inf (first block): ~1e-38 times zero sums
      mx[n] = m;
      __m512 ls = _mm512_setzero_ps();
      for (int64_t t = 0; t < nk; ++t) {
        float* p = pt + t * W + n * kLanes;
        const __m512 s = _mm512_loadu_ps(p);
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, ninf, _CMP_NEQ_OQ), exp512(_mm512_sub_ps(s, m)));
        _mm512_storeu_ps(p, e);
        ls = _mm512_add_ps(ls, e);
      }
      sum[n] = _mm512_add_ps(_mm512_mul_ps(sum[n], corr[n]), ls);
    }
    // out^T = out^T * corr + sum_t v[t][c] p[t], TC dimensions x NV vectors at a time
    constexpr int TC = NV >= 4 ? 4 : (NV >= 2 ? 8 : 16);
    for (int64_t c0 = 0; c0 < d; c0 += TC) value_tile<NV, TC>(pt, W, vh + j0 * a.vsS + c0, a.vsS, nk, corr, ot + c0 * W);
  }
  // out[i, hq, c] = out^T[c][lane] / sum[lane]
  alignas(64) float inv[kLanes];
  for (int64_t n = 0; n < NV; ++n) {
    const int64_t hq = h * a.G + g0 + n / pv, ib = i0 + (n % pv) * kLanes;
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sum[n]));
    for (int64_t l = 0; l < kLanes && ib + l < a.Q; ++l) {
      float* o = a.out + ((ib + l) * a.Hq + hq) * d;
      for (int64_t c = 0; c < d; ++c) o[c] = ot[c * W + n * kLanes + l] * inv[l];
    }
  }
}

template <int NV>
void run_all(const Args& a, int64_t ng, int64_t pv) {
  const int64_t hkv = a.Hq / a.G;
  const int64_t span = kLanes * pv;  // positions per item
  const int64_t blocks = (a.Q + span - 1) / span, groups = a.G / ng;
  const int64_t items = hkv * groups * blocks;
  // the costliest items (latest positions: most keys) first, taken in turn by the threads
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(static_cast<size_t>((2 * a.d + kKeys) * NV * kLanes));
    float* qt = scratch.data();
    float* ot = qt + a.d * NV * kLanes;
    float* pt = ot + a.d * NV * kLanes;
    for (int64_t it; (it = next.fetch_add(1)) < items;) {
      const int64_t b = blocks - 1 - it / (hkv * groups), rest = it % (hkv * groups);
      run_item<NV>(a, rest / groups, (rest % groups) * ng, ng, b * span, pv, qt, ot, pt);
    }
  });
}

}  // namespace prefill_attn
}  // namespace
#pragma GCC pop_options

bool prefill_attention_supported(int64_t head_dim) {
  return current_isa() == kIsaAvx512 && head_dim % 16 == 0 && head_dim >= 16 && head_dim <= 512;
}

// the group's query heads x position blocks per item: 3 or 4 vectors where the group allows
static void run_args(const prefill_attn::Args& a) {
  const int64_t G = a.G;
  if (G % 4 == 0) prefill_attn::run_all<4>(a, 4, 1);
  else if (G % 3 == 0) prefill_attn::run_all<3>(a, 3, 1);
  else if (G % 2 == 0) prefill_attn::run_all<4>(a, 2, 2);
  else prefill_attn::run_all<3>(a, 1, 3);
}

void prefill_attention_into(const AttnRequest& r, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale) {
  // the caller decided on prefill_attention_supported once (the instruction set may be
  // switched since: the CPU still has AVX-512)
  TORCH_CHECK(!r.half && r.mask == nullptr && r.Q > 0 && r.S >= r.Q && kv_heads > 0 && heads % kv_heads == 0 &&
                  head_dim % 16 == 0 && head_dim <= 512,
              "prefill_attention_into: float32 keys and values, causal rows and a head size that is a multiple of 16");
  prefill_attn::Args a{r.q, static_cast<const float*>(r.k), static_cast<const float*>(r.v), r.out,
                       heads, heads / kv_heads, r.Q, r.S, r.S - r.Q, head_dim,
                       r.qsH, r.qsQ, r.ksH, r.ksS, r.vsH, r.vsS, static_cast<float>(scale)};
  run_args(a);
}

torch::Tensor prefill_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(0) == 1 && key.size(0) == 1,
              "prefill_attention: expects [1, H, L, d] tensors");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat,
              "prefill_attention: float32 queries, keys and values");
  const int64_t Hq = query.size(1), Q = query.size(2), d = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2);
  TORCH_CHECK(value.sizes() == key.sizes() && key.size(3) == d && Hkv > 0 && Hq % Hkv == 0,
              "prefill_attention: shape mismatch");
  TORCH_CHECK(Q > 0 && S >= Q, "prefill_attention: needs rows and at least as many keys");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1,
              "prefill_attention: the last dimension must be contiguous");
  TORCH_CHECK(prefill_attention_supported(d),
              "prefill_attention: needs the AVX-512 kernels and a head size that is a multiple of 16 (at most 512)");
  auto out = torch::empty({1, Q, Hq, d}, query.options());
  prefill_attn::Args a{query.data_ptr<float>(), key.data_ptr<float>(), value.data_ptr<float>(), out.data_ptr<float>(),
                       Hq, Hq / Hkv, Q, S, S - Q, d,
                       query.stride(1), query.stride(2), key.stride(1), key.stride(2), value.stride(1), value.stride(2),
                       static_cast<float>(scale)};
  run_args(a);
  return out;
}
