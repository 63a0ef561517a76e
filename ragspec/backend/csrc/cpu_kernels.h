// Declarations of the compiled CPU kernels of cpu_kernels.cpp, shared with the other
// sources of the same extension library (decoder_step.cpp calls them directly).
#pragma once

#include <torch/extension.h>

// x float32 [R, I] contiguous; weight float32 [O, I] contiguous; bias float32 [O] or empty
// -> float32 [R, O]. Every output row depends on its input row alone.
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);

// The same over a GGUF block weight (qs, scales, format code) -> float32 [R, O], bit for bit
// skinny_linear over the de-quantized weight.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, int64_t fmt,
                           c10::optional<torch::Tensor> bias);

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

// Registers the fused decoder step (decoder_step.cpp) with the extension module.
void register_decoder_step(pybind11::module& m);
