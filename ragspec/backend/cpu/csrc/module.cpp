// The extension module: the kernels of every family, bound for Python.
#include "cpu_kernels.h"

#include <torch/extension.h>

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
  m.def("prefill_attention", &prefill_attention,
        "causal attention of a prompt chunk over its keys (AVX-512; query rows as vector lanes)");
  m.def("prefill_attention_supported", &prefill_attention_supported,
        "whether prefill_attention runs here for this head size (AVX-512 kernels, d a multiple of 16)");
  register_decoder_step(m);  // decoder_step.cpp
}
