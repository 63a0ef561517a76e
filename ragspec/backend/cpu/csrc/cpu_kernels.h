// Declarations shared by the sources of the compiled CPU kernels' extension library, one
// source per kernel family:
//   isa.cpp            which instruction set the kernels use (AVX-512 or AVX2/FMA)
//   linear.cpp         skinny_linear: few-row float32 linear layers (tiles in linear_tiles.h)
//   quant_linear.cpp   quant_linear: the same over GGUF blocks (Q4_1, Q8_0, Q6_K)
//   fast_numerics.cpp  quant_linear's int8-activation formats (AVX-512 VNNI, --numerics fast)
//   attention.cpp      few_query_attention: a few query rows over a KV cache
//   prefill_attention.cpp  prefill_attention: a prompt chunk's causal attention (AVX-512)
//   decoder_step.cpp   DecoderStep: every decoder layer of a step in one call
//   module.cpp         the Python module
// (kernel_simd.h, kernel_simd512.h and linear_tiles.h: inline helpers several sources share.)
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

// ---- the instruction set (isa.cpp)
constexpr int kIsaAvx2 = 0, kIsaAvx512 = 1;

// kIsaAvx512 or kIsaAvx2: the instruction set the kernels use now (chosen at the first call
// from the CPU's flags; RAGSPEC_CPU_ISA=avx2 masks AVX-512 off; set_cpu_isa switches it)
int current_isa();

// "avx512" or "avx2": current_isa's name
std::string cpu_isa();

// switch the kernels to "avx2", "avx512" (an error where the CPU lacks it) or "auto" (the
// CPU's best unless RAGSPEC_CPU_ISA=avx2); returns the previous one
std::string set_cpu_isa(const std::string& name);

// AVX-512 quant_linear: activation rows up to which each weight row is multiplied alone, by
// what each CPU ran faster (the same values either way)
int64_t alone_rows();

// whether this CPU runs quant_linear's fast-numerics formats (3, 4): AVX-512 F/BW/VL/DQ and
// VNNI, and AVX-512 not masked off
bool fast_numerics_supported();

// ---- the kernels

// x float32 [R, I] contiguous; weight float32 [O, I] contiguous; bias float32 [O] or empty
// -> float32 [R, O]. Every output row depends on its input row alone.
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);

// The same over a GGUF block weight (qs, scales, format code) -> float32 [R, O], bit for bit
// skinny_linear over the de-quantized weight.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, int64_t fmt,
                           c10::optional<torch::Tensor> bias);

// quant_linear's formats 3 and 4 (fast_numerics.cpp): int8 activations, AVX-512 VNNI; x
// float32 [R, I] (I a multiple of 64), qs uint8, scales float32, bias float32 [O] or empty ->
// float32 [R, O]
torch::Tensor quant_linear_fast(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales,
                                int64_t fmt, const c10::optional<torch::Tensor>& bias);

// query float32 [1, Hq, Q, d], key/value [1, Hkv, S, d] (contiguous last dimension), mask
// bool [1, 1, Q, S] or empty, scale -> float32 [1, Q, Hq, d]. Keys/values float32 or float16
// (widened exactly: the float32 call's bits over key.float()).
torch::Tensor few_query_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                                  c10::optional<torch::Tensor> mask, double scale);

// The same for several requests (query i over key/value i, mask i) in one parallel region;
// each output is bit for bit the single call's.
std::vector<torch::Tensor> few_query_attention_many(const std::vector<torch::Tensor>& queries,
                                                    const std::vector<torch::Tensor>& keys,
                                                    const std::vector<torch::Tensor>& values,
                                                    const std::vector<c10::optional<torch::Tensor>>& masks,
                                                    double scale);

// One request of few_query_attention_into: raw pointers into the caller's buffers (the
// native step's, no tensors made per request and layer). q: float32 queries, row i of
// head h at q + h * qsH + i * qsQ (Q rows); k, v: float32, or float16 bits where half, key
// t of head h at k + h * ksH + t * ksS (S keys, the last Q the rows' own); mask: bool
// [Q, S] contiguous (true = attend) or null (every row sees every key); out: float32
// [Q, Hq, d] contiguous.
struct AttnRequest {
  const float* q;
  int64_t qsH, qsQ;
  const void* k;
  const void* v;
  bool half;
  int64_t ksH, ksS, vsH, vsS;
  const bool* mask;
  int64_t Q, S;
  float* out;
};

// few_query_attention_many over raw pointers, each output written to its request's out:
// bit for bit the tensor call's.
void few_query_attention_into(const std::vector<AttnRequest>& requests, int64_t heads, int64_t kv_heads,
                              int64_t head_dim, double scale);

// Causal attention of a prompt chunk (prefill_attention.cpp): query float32 [1, Hq, Q, d],
// key/value float32 [1, Hkv, S, d] (S >= Q; query row i sees keys 0 .. S - Q + i), last
// dimension contiguous, scale -> float32 [1, Q, Hq, d]. AVX-512 only (prefill_attention_supported).
torch::Tensor prefill_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, double scale);

// whether prefill_attention runs here for this head size: the kernels use AVX-512 and d is a
// multiple of 16 (at most 512)
bool prefill_attention_supported(int64_t head_dim);

// prefill_attention over raw pointers (the native step's buffers): one request's causal
// rows (mask null), float32 keys and values (half false); out [Q, Hq, d] contiguous. The
// caller checks prefill_attention_supported (once per call of its own).
void prefill_attention_into(const AttnRequest& r, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale);

// Registers the fused decoder step (decoder_step.cpp) with the extension module.
void register_decoder_step(pybind11::module& m);
