// A fused decoder step for Llama-architecture models (llama, SmolLM2) on CPU: one call runs
// every decoder layer for R new rows (1-16 per request: the root and the draft nodes of a
// verification, or a chunk of a prompt) of one or several requests, each request attending
// to its own KV buffer, and returns the final-norm hidden states [R, H]. The output layer
// stays with the caller (ragspec/backend/hf.py).
//
// Prompt chunks (more than 16 rows of a request; pack_layer): the linear layers multiply
// through the weights packed for oneDNN (torch's mkldnn::_linear_pointwise, as transformers'
// modules do in ragspec's own forwards), the attention through prefill_attention.cpp, and
// the element-wise parts split their rows over the threads: the values of transformers'
// forward of the chunk bit for bit, without its ~40 module calls per layer and its separate
// element-wise passes (a 660-token prompt of the default model: norms 19 -> 8 ms, SiLU-mul
// 14 -> 7, RoPE and KV 10 -> 6 on the 2-core CPU).
//
// transformers' forward of the same step runs ~40 modules per layer in Python (on the
// 2-core CPU of our CI ~6-10 ms of a ~22 ms one-row step of SmolLM2-135M goes to Python and
// dispatch); here the only per-step Python is the embedding lookup, the rotary cos/sin (the
// model's own rotary_emb) and the output layer.
//
// Numerics: the same values as ragspec's transformers path with the compiled kernels, bit
// for bit: the linear layers and the attention are the same kernels (linear.cpp, quant_linear.cpp, attention.cpp) on
// the same inputs; RMSNorm's mean of squares and SiLU are ATen's own kernels (at::mean,
// at::silu: the calls transformers' modules make); the rest is element-wise float32
// arithmetic in transformers' order of operations, each operation rounded once (no
// contraction into fused multiply-adds, see the pragma below): RMSNorm
// w * (x * (1 / sqrt(mean(x^2) + eps))), RoPE (q * cos) + (rotate_half(q) * sin),
// SiLU(gate) * up, residual adds.
//
// KV layout (one buffer per request, owned by the caller): float32 or float16 (a float16 KV
// cache: the new rows' keys and values rounded to nearest when written, widened exactly when
// read) [L, 2, H_kv, C, d] contiguous (layer, key/value, head, position, dimension; C the capacity): the new rows of
// a request are written at positions past .. past + Q - 1 of its buffer, and its attention
// reads positions 0 .. past + Q - 1.
#include "cpu_kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kMaxHeadDim = 128;  // the head dims the step takes: 32, 64, 128

// x [R, I] through a weight pre-packed for oneDNN (torch.ops.mkldnn._reorder_linear_weight):
// torch.ops.mkldnn._linear_pointwise, the op transformers' modules call on a prompt chunk in
// ragspec's own forwards (ragspec/backend/cpu/fastpaths.py), so the same values bit for bit
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

constexpr int64_t kSkinnyRows = 16;  // rows up to which the step's own linear kernels run (SKINNY_MAX_ROWS)

// One linear layer: a float32 weight (skinny_linear) or GGUF blocks (quant_linear), and for
// prompt chunks the float32 weight packed for oneDNN.
struct Linear {
  torch::Tensor weight;  // float32 [O, I] contiguous, or undefined
  torch::Tensor qs, scales;
  int64_t fmt = -1;  // -1: float32 weight, else quant_linear's format code
  c10::optional<torch::Tensor> bias;
  int64_t out = 0, in = 0;
  torch::Tensor packed;  // the float32 weight packed for oneDNN (prompt chunks), or undefined

  // chunk: a prompt chunk's rows (through the packed weight where there is one and the rows
  // are more than 16); else the few-row kernels, each row's bits independent of the others
  torch::Tensor operator()(const torch::Tensor& x, bool chunk = false) const {
    if (chunk && packed.defined() && x.size(0) > kSkinnyRows) return packed_linear(x, packed, bias);
    return fmt < 0 ? skinny_linear(x, weight, bias) : quant_linear(x, qs, scales, fmt, bias);
  }
};

// (weight, qs, scales, fmt, bias, out_features, in_features) as Python passes it
using LinearSpec = std::tuple<c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                              c10::optional<torch::Tensor>, int64_t, c10::optional<torch::Tensor>, int64_t, int64_t>;

Linear make_linear(const LinearSpec& spec) {
  Linear lin;
  const auto& [weight, qs, scales, fmt, bias, out, in] = spec;
  lin.fmt = fmt;
  lin.out = out;
  lin.in = in;
  if (fmt < 0) {
    TORCH_CHECK(weight.has_value() && weight->defined(), "DecoderStep: a float32 linear needs its weight");
    TORCH_CHECK(weight->scalar_type() == at::kFloat && weight->is_contiguous() && weight->dim() == 2 &&
                    weight->size(0) == out && weight->size(1) == in,
                "DecoderStep: weight must be float32 [out, in] contiguous");
    lin.weight = *weight;
  } else {
    TORCH_CHECK(qs.has_value() && scales.has_value() && qs->defined() && scales->defined() && qs->size(0) == out,
                "DecoderStep: a GGUF linear needs qs [out, *] and scales");
    lin.qs = *qs;
    lin.scales = *scales;
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out, "DecoderStep: bias must be float32 [out]");
    lin.bias = bias->contiguous();
  }
  return lin;
}

// Linear layers applied to the same input, their outputs side by side (q|k|v, gate|up):
// one call when the caller fused them into one weight, else one call each.
struct Group {
  std::vector<Linear> parts;
  int64_t out = 0;
  std::vector<Linear> packed;  // each linear of the group on its packed weight (prompt chunks), or none

  torch::Tensor operator()(const torch::Tensor& x, bool chunk = false) const {
    const auto& use = chunk && !packed.empty() && x.size(0) > kSkinnyRows ? packed : parts;
    if (use.size() == 1) return use[0](x, chunk);
    std::vector<torch::Tensor> outs;
    outs.reserve(use.size());
    for (const auto& p : use) outs.push_back(p(x, chunk));
    return at::cat(outs, 1);
  }
};

Group make_group(const std::vector<LinearSpec>& specs, int64_t in, int64_t out) {
  Group g;
  for (const auto& s : specs) {
    g.parts.push_back(make_linear(s));
    TORCH_CHECK(g.parts.back().in == in, "DecoderStep: linear in-features mismatch");
    g.out += g.parts.back().out;
  }
  TORCH_CHECK(g.out == out, "DecoderStep: linear out-features mismatch");
  return g;
}

// (packed weight, bias, out_features, in_features) as Python passes it
using PackedSpec = std::tuple<torch::Tensor, c10::optional<torch::Tensor>, int64_t, int64_t>;

Linear make_packed(const PackedSpec& spec) {
  Linear lin;
  const auto& [packed, bias, out, in] = spec;
  TORCH_CHECK(packed.defined(), "DecoderStep: a packed linear needs its weight");
  lin.packed = packed;
  lin.out = out;
  lin.in = in;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out, "DecoderStep: bias must be float32 [out]");
    lin.bias = bias->contiguous();
  }
  return lin;
}

struct Layer {
  torch::Tensor ln1, ln2;  // float32 [H]
  Group qkv;               // [Hq d | Hkv d | Hkv d]
  Linear o;                // Hq d -> H
  Group gate_up;           // [I | I]
  Linear down;             // I -> H
};

// ---------------------------------------------------------------------------------------
// Element-wise parts. transformers (ATen) rounds after every operation; GCC would contract
// a * b + c into one fused multiply-add (-ffp-contract=fast is its default), which rounds
// once and gives other values, so contraction is off for these functions.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// sq = x * x (torch.pow(x, 2) is x * x in ATen)
void square(const float* x, float* sq, int64_t n) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
  for (int64_t i = 0; i < n; ++i) sq[i] = x[i] * x[i];
}

// out[r] = w * (x[r] * (1 / sqrt(var[r] + eps))): LlamaRMSNorm after its mean of squares
void rms_scale(const float* x, const float* var, const float* w, float eps, float* out, int64_t R, int64_t H) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.f / std::sqrt(var[r] + eps);
    const float* xr = x + r * H;
    float* orow = out + r * H;
    for (int64_t i = 0; i < H; ++i) {
      const float t = xr[i] * inv;
      orow[i] = w[i] * t;
    }
  }
}

// dst = (src * cos) + (rotate_half(src) * sin) for one head row of d values
// (rotate_half(x) = [-x2, x1]); each product and the sum rounded once
void rope_row(const float* src, const float* c, const float* s, float* dst, int64_t d) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = src[i] * c[i];
    const float b = (-src[i + h]) * s[i];
    dst[i] = a + b;
  }
  for (int64_t i = h; i < d; ++i) {
    const float a = src[i] * c[i];
    const float b = src[i - h] * s[i];
    dst[i] = a + b;
  }
}

// y[r, i] = g[r, i] * u[r, i] (g: SiLU(gate) [R, I] contiguous; u: rows of stride us)
void gated(const float* g, const float* u, int64_t us, float* y, int64_t R, int64_t I) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; ++i) y[r * I + i] = g[r * I + i] * u[r * us + i];
}

// float32 -> float16, round to nearest even (F16C; torch's float -> half conversion too)
void narrow_row(const float* x, uint16_t* y, int64_t d) {
  for (int64_t c = 0; c < d; c += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + c),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// x += y (transformers: residual + hidden_states)
void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] + y[i];
}

#pragma GCC pop_options

// f(r0, r1) over rows 0 .. R - 1 of per_row elements each: in one piece for a step's few
// rows, split over the threads for a prompt chunk (the element-wise parts above give every
// element the same value however the rows are split)
template <class F>
void over_rows(int64_t R, int64_t per_row, const F& f) {
  constexpr int64_t kSerialElements = 1 << 15;
  if (R * per_row <= kSerialElements) {
    f(0, R);
    return;
  }
  at::parallel_for(0, R, std::max<int64_t>(1, kSerialElements / 4 / per_row), f);
}

using Clock = std::chrono::steady_clock;

// categories of the optional per-step timers
enum Part { kNorm = 0, kLinear, kRope, kAttention, kMlpAct, kResidual, kParts };
const char* const kPartNames[kParts] = {"norm", "linear", "rope_kv", "attention", "silu_mul", "residual"};

}  // namespace

// The decoder's weights (held by reference, built once) and its step.
class DecoderStep {
 public:
  DecoderStep(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
              double scale, torch::Tensor final_norm)
      : H_(hidden), Hq_(heads), Hkv_(kv_heads), d_(head_dim), I_(intermediate), eps_(static_cast<float>(eps)),
        scale_(scale) {
    TORCH_CHECK(Hkv_ > 0 && Hq_ % Hkv_ == 0, "DecoderStep: heads must be a multiple of kv_heads");
    TORCH_CHECK(d_ == 32 || d_ == 64 || d_ == 128, "DecoderStep: head_dim must be 32, 64 or 128");
    // an empty final_norm: none (the layers' output itself, e.g. an EAGLE head's layer)
    if (final_norm.numel() > 0) norm_ = check_norm(final_norm);
  }

  void add_layer(torch::Tensor ln1, std::vector<LinearSpec> qkv, LinearSpec o, torch::Tensor ln2,
                 std::vector<LinearSpec> gate_up, LinearSpec down) {
    Layer layer;
    layer.ln1 = check_norm(ln1);
    layer.ln2 = check_norm(ln2);
    layer.qkv = make_group(qkv, H_, (Hq_ + 2 * Hkv_) * d_);
    layer.o = make_linear(o);
    TORCH_CHECK(layer.o.in == Hq_ * d_ && layer.o.out == H_, "DecoderStep: o_proj shape");
    layer.gate_up = make_group(gate_up, H_, 2 * I_);
    layer.down = make_linear(down);
    TORCH_CHECK(layer.down.in == I_ && layer.down.out == H_, "DecoderStep: down_proj shape");
    layers_.push_back(std::move(layer));
  }

  // Prompt chunks (more than 16 rows) of layer l through weights packed for oneDNN, each
  // (packed, bias, out, in) as the caller packed it: q, k, v; o; gate, up; down.
  void pack_layer(int64_t l, std::vector<PackedSpec> qkv, PackedSpec o, std::vector<PackedSpec> gate_up, PackedSpec down) {
    TORCH_CHECK(l >= 0 && l < num_layers(), "DecoderStep: no layer ", l);
    Layer& layer = layers_[l];
    auto packed_group = [](const std::vector<PackedSpec>& specs, const Group& g) {
      std::vector<Linear> out;
      int64_t total = 0;
      for (const auto& sp : specs) {
        out.push_back(make_packed(sp));
        TORCH_CHECK(out.back().in == g.parts[0].in, "DecoderStep: packed linear in-features mismatch");
        total += out.back().out;
      }
      TORCH_CHECK(total == g.out, "DecoderStep: packed linears' out-features mismatch");
      return out;
    };
    layer.qkv.packed = packed_group(qkv, layer.qkv);
    layer.gate_up.packed = packed_group(gate_up, layer.gate_up);
    Linear po = make_packed(o), pd = make_packed(down);
    TORCH_CHECK(po.in == layer.o.in && po.out == layer.o.out && pd.in == layer.down.in && pd.out == layer.down.out,
                "DecoderStep: packed o_proj / down_proj shape");
    layer.o.packed = po.packed;
    layer.down.packed = pd.packed;
    packed_ = true;
  }

  // whether every layer takes prompt chunks through packed weights
  bool packed() const { return packed_; }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: float32 [R, H] (the input embeddings of all rows); cos, sin: float32 [R, d] (each
  // row's rotary values); kv: one buffer per request, float32 [L, 2, Hkv, C_i, d]
  // contiguous; bounds: R_0 = 0 <= ... <= R_n = R, request i's rows bounds[i]:bounds[i+1];
  // pasts: request i's cached positions (its new rows are written at past_i ..); masks:
  // request i's bool [Q_i, past_i + Q_i] (True = attend) or None (causal); prompt: the rows
  // are prompt chunks (a request's more than 16 causal rows through the packed weights and
  // prefill_attention; a verification's rows never: each keeps the one-row step's bits)
  // -> float32 [R, H] after the final norm.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> kv,
                        std::vector<int64_t> bounds, std::vector<int64_t> pasts,
                        std::vector<c10::optional<torch::Tensor>> masks, bool prompt) {
    c10::InferenceMode guard;
    const int64_t L = num_layers(), n = static_cast<int64_t>(kv.size());
    TORCH_CHECK(L > 0, "DecoderStep: no layers");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == H_ && x.scalar_type() == at::kFloat, "DecoderStep: x must be float32 [R, H]");
    const int64_t R = x.size(0);
    TORCH_CHECK(R > 0, "DecoderStep: no rows");
    TORCH_CHECK(cos.sizes() == torch::IntArrayRef({R, d_}) && sin.sizes() == cos.sizes() &&
                    cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
                "DecoderStep: cos/sin must be float32 [R, head_dim]");
    TORCH_CHECK(n > 0 && static_cast<int64_t>(bounds.size()) == n + 1 && static_cast<int64_t>(pasts.size()) == n &&
                    static_cast<int64_t>(masks.size()) == n && bounds[0] == 0 && bounds[n] == R,
                "DecoderStep: kv, bounds, pasts and masks disagree");
    std::vector<torch::Tensor> mask(n);
    // which requests' rows take prefill_attention, decided once for the whole forward (the
    // kernels' instruction set may be switched meanwhile: every layer must agree with the
    // masks built here)
    std::vector<char> chunked(n, 0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t Q = bounds[i + 1] - bounds[i], past = pasts[i];
      TORCH_CHECK(Q > 0 && past >= 0, "DecoderStep: every request needs rows");
      const auto& b = kv[i];
      TORCH_CHECK(b.dim() == 5 && b.size(0) == L && b.size(1) == 2 && b.size(2) == Hkv_ && b.size(4) == d_ &&
                      (b.scalar_type() == at::kFloat || b.scalar_type() == at::kHalf) && b.is_contiguous(),
                  "DecoderStep: kv buffer must be float32 or float16 [L, 2, H_kv, capacity, head_dim] contiguous");
      TORCH_CHECK(past + Q <= b.size(3), "DecoderStep: kv buffer too small for the new rows");
      const int64_t S = past + Q;
      if (masks[i].has_value() && masks[i]->defined()) {
        const auto& m = *masks[i];
        TORCH_CHECK(m.scalar_type() == at::kBool && m.numel() == Q * S && m.size(-1) == S,
                    "DecoderStep: mask must be bool [Q, past + Q]");
        mask[i] = m.reshape({1, 1, Q, S}).contiguous();
      } else if (prompt && chunk_attention(Q, b)) {
        chunked[i] = 1;  // causal through prefill_attention: no mask
      } else if (Q > 1) {  // causal: row j sees positions 0 .. past + j
        mask[i] = torch::ones({Q, S}, torch::dtype(torch::kBool)).tril(past).reshape({1, 1, Q, S});
      }
    }
    x = x.contiguous().clone();  // the residual stream, updated in place
    cos = cos.contiguous();
    sin = sin.contiguous();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    auto opts = x.options();
    auto h = torch::empty({R, H_}, opts);
    auto sq = torch::empty({R, H_}, opts);
    auto q = torch::empty({R, Hq_, d_}, opts);
    auto act = torch::empty({R, I_}, opts);
    auto attn = torch::empty({R, Hq_ * d_}, opts);  // the attention's output, every layer
    float* attnp = attn.data_ptr<float>();
    float* xp = x.data_ptr<float>();
    const int64_t QKV = (Hq_ + 2 * Hkv_) * d_;
    for (int64_t l = 0; l < L; ++l) {
      const Layer& layer = layers_[l];
      // --- attention block
      auto t0 = Clock::now();
      rms_norm(x, layer.ln1, sq, h);
      tick(kNorm, t0);
      auto qkv = layer.qkv(h, prompt);  // [R, QKV]
      tick(kLinear, t0);
      const float* qkvp = qkv.data_ptr<float>();
      float* qp = q.data_ptr<float>();
      over_rows(R, Hq_ * d_, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t hh = 0; hh < Hq_; ++hh)
            rope_row(qkvp + r * QKV + hh * d_, cp + r * d_, sp + r * d_, qp + (r * Hq_ + hh) * d_, d_);
      });
      for (int64_t i = 0; i < n; ++i) {
        const int64_t C = kv[i].size(3);
        const int64_t koff = (l * 2 + 0) * Hkv_ * C * d_, voff = (l * 2 + 1) * Hkv_ * C * d_;
        const bool half = kv[i].scalar_type() == at::kHalf;
        uint16_t* base16 = half ? reinterpret_cast<uint16_t*>(kv[i].data_ptr()) : nullptr;
        float* base = half ? nullptr : kv[i].data_ptr<float>();
        over_rows(bounds[i + 1] - bounds[i], 2 * Hkv_ * d_, [&](int64_t r0, int64_t r1) {
        for (int64_t r = bounds[i] + r0; r < bounds[i] + r1; ++r) {
          const int64_t pos = pasts[i] + (r - bounds[i]);
          for (int64_t hh = 0; hh < Hkv_; ++hh) {
            const float* ksrc = qkvp + r * QKV + (Hq_ + hh) * d_;
            const float* vsrc = qkvp + r * QKV + (Hq_ + Hkv_ + hh) * d_;
            const int64_t at = (hh * C + pos) * d_;
            if (half) {  // a float16 KV cache: the float32 values rounded to nearest (as torch's .half())
              float krot[kMaxHeadDim];
              rope_row(ksrc, cp + r * d_, sp + r * d_, krot, d_);
              narrow_row(krot, base16 + koff + at, d_);
              narrow_row(vsrc, base16 + voff + at, d_);
            } else {
              rope_row(ksrc, cp + r * d_, sp + r * d_, base + koff + at, d_);
              std::copy(vsrc, vsrc + d_, base + voff + at);
            }
          }
        }
        });
      }
      tick(kRope, t0);
      // every request's attention in one parallel region, written into attn [R, Hq d]:
      // request i's queries q[a_i .. a_i + Q_i) ([Q, Hq, d]), its layer's keys and values
      // (positions 0 .. past_i + Q_i of [Hkv, C, d]) by pointers into the buffers, no
      // tensor views per request and layer
      std::vector<AttnRequest> reqs(n);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t a = bounds[i], Q = bounds[i + 1] - a, S = pasts[i] + Q, C = kv[i].size(3);
        const bool half = kv[i].scalar_type() == at::kHalf;
        const int64_t esz = half ? 2 : 4;
        const char* base = static_cast<const char*>(kv[i].data_ptr());
        AttnRequest& r = reqs[i];
        r.q = qp + a * Hq_ * d_;
        r.qsH = d_;
        r.qsQ = Hq_ * d_;
        r.k = base + (l * 2 + 0) * Hkv_ * C * d_ * esz;
        r.v = base + (l * 2 + 1) * Hkv_ * C * d_ * esz;
        r.half = half;
        r.ksH = r.vsH = C * d_;
        r.ksS = r.vsS = d_;
        r.mask = mask[i].defined() ? mask[i].data_ptr<bool>() : nullptr;
        r.Q = Q;
        r.S = S;
        r.out = attnp + a * Hq_ * d_;
      }
      // a prompt chunk (more than 16 causal rows, float32 keys and values) through the
      // prefill kernel, each alone; the others together
      std::vector<AttnRequest> few;
      for (int64_t i = 0; i < n; ++i) {
        if (chunked[i]) prefill_attention_into(reqs[i], Hq_, Hkv_, d_, scale_);
        else few.push_back(reqs[i]);
      }
      if (!few.empty()) few_query_attention_into(few, Hq_, Hkv_, d_, scale_);
      tick(kAttention, t0);
      auto o = layer.o(attn, prompt);  // [R, H]
      tick(kLinear, t0);
      add_rows(xp, o.data_ptr<float>(), R);
      tick(kResidual, t0);
      // --- MLP block
      rms_norm(x, layer.ln2, sq, h);
      tick(kNorm, t0);
      auto gu = layer.gate_up(h, prompt);  // [R, 2I]
      tick(kLinear, t0);
      auto g = at::silu(gu.narrow(1, 0, I_));  // [R, I] contiguous, ATen's SiLU
      const float* gp = g.data_ptr<float>();
      const float* up = gu.data_ptr<float>() + I_;
      float* ap = act.data_ptr<float>();
      over_rows(R, I_, [&](int64_t r0, int64_t r1) {
        gated(gp + r0 * I_, up + r0 * 2 * I_, 2 * I_, ap + r0 * I_, r1 - r0, I_);
      });
      tick(kMlpAct, t0);
      auto dn = layer.down(act, prompt);  // [R, H]
      tick(kLinear, t0);
      add_rows(xp, dn.data_ptr<float>(), R);
      tick(kResidual, t0);
    }
    ++steps_;
    if (!norm_.defined()) return x;
    auto t0 = Clock::now();
    auto out = torch::empty({R, H_}, opts);
    rms_norm(x, norm_, sq, out);
    tick(kNorm, t0);
    return out;
  }

  // Per-part timers (seconds summed over the timed steps), when enabled.
  void set_timing(bool on) { timing_ = on; }

  std::map<std::string, double> timings(bool reset) {
    std::map<std::string, double> out;
    for (int p = 0; p < kParts; ++p) out[kPartNames[p]] = seconds_[p];
    out["steps"] = static_cast<double>(steps_);
    if (reset) {
      std::fill(seconds_, seconds_ + kParts, 0.0);
      steps_ = 0;
    }
    return out;
  }

 private:
  torch::Tensor check_norm(const torch::Tensor& w) const {
    TORCH_CHECK(w.dim() == 1 && w.size(0) == H_ && w.scalar_type() == at::kFloat,
                "DecoderStep: norm weight must be float32 [H]");
    return w.contiguous();
  }

  // LlamaRMSNorm: w * (x * rsqrt(mean(x^2) + eps)), the mean by ATen (its summation order)
  void rms_norm(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& sq, torch::Tensor& out) const {
    const int64_t R = x.size(0);
    const float* xp = x.data_ptr<float>();
    float* sp = sq.data_ptr<float>();
    over_rows(R, H_, [&](int64_t r0, int64_t r1) { square(xp + r0 * H_, sp + r0 * H_, (r1 - r0) * H_); });
    auto var = at::mean(sq, {-1}, /*keepdim=*/true);  // [R, 1]
    const float* vp = var.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* op = out.data_ptr<float>();
    over_rows(R, H_, [&](int64_t r0, int64_t r1) { rms_scale(xp + r0 * H_, vp + r0, wp, eps_, op + r0 * H_, r1 - r0, H_); });
  }

  // x += y over R rows of H (the residual adds)
  void add_rows(float* x, const float* y, int64_t R) const {
    over_rows(R, H_, [&](int64_t r0, int64_t r1) { add_into(x + r0 * H_, y + r0 * H_, (r1 - r0) * H_); });
  }

  // whether a request's Q causal rows take prefill_attention: more than 16 rows (a prompt
  // chunk), float32 keys and values, the AVX-512 kernels
  bool chunk_attention(int64_t Q, const torch::Tensor& kv) const {
    return Q > kSkinnyRows && kv.scalar_type() == at::kFloat && prefill_attention_supported(d_);
  }

  void tick(Part part, Clock::time_point& t0) {
    if (!timing_) return;
    const auto t1 = Clock::now();
    seconds_[part] += std::chrono::duration<double>(t1 - t0).count();
    t0 = t1;
  }

  int64_t H_, Hq_, Hkv_, d_, I_;
  float eps_;
  double scale_;
  torch::Tensor norm_;
  std::vector<Layer> layers_;
  bool timing_ = false;
  bool packed_ = false;
  double seconds_[kParts] = {0, 0, 0, 0, 0, 0};
  int64_t steps_ = 0;
};

void register_decoder_step(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecoderStep>(m, "DecoderStep", "fused decoder step of a Llama-architecture model (decoder_step.cpp)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, torch::Tensor>(), py::arg("hidden"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"),
           py::arg("scale"), py::arg("final_norm"))
      .def("add_layer", &DecoderStep::add_layer, py::arg("ln1"), py::arg("qkv"), py::arg("o"), py::arg("ln2"),
           py::arg("gate_up"), py::arg("down"))
      .def("num_layers", &DecoderStep::num_layers)
      .def("pack_layer", &DecoderStep::pack_layer, py::arg("layer"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"))
      .def("packed", &DecoderStep::packed)
      .def("forward", &DecoderStep::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("kv"),
           py::arg("bounds"), py::arg("pasts"), py::arg("masks"), py::arg("prompt") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("set_timing", &DecoderStep::set_timing)
      .def("timings", &DecoderStep::timings, py::arg("reset") = false);
}
