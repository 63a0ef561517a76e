// Which instruction set the kernels use (AVX-512 or AVX2/FMA), shared by every kernel family
// of the extension (cpu_kernels.h), and whether the fast-numerics formats run here.
#include "cpu_kernels.h"

#include <torch/extension.h>

#include <atomic>
#include <cstdlib>
#include <string>

// AVX-512 (F, BW, VL, DQ) where the CPU has it, else AVX2/FMA; chosen at the first call from
// the CPU's flags, RAGSPEC_CPU_ISA=avx2 masks AVX-512 off, set_cpu_isa switches it (tests run
// both paths in one process).
namespace {

std::atomic<int> g_isa{-1};

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

int detect_isa() {
  const char* env = std::getenv("RAGSPEC_CPU_ISA");
  const std::string want = env ? env : "";
  if (want == "avx2" || want == "AVX2") return kIsaAvx2;
  return cpu_has_avx512() ? kIsaAvx512 : kIsaAvx2;
}

}  // namespace

int current_isa() {
  int v = g_isa.load(std::memory_order_relaxed);
  if (v < 0) {
    v = detect_isa();
    g_isa.store(v, std::memory_order_relaxed);
  }
  return v;
}

namespace {

inline const char* isa_name(int v) { return v == kIsaAvx512 ? "avx512" : "avx2"; }

}  // namespace

// AVX-512 quant_linear: activation rows up to which each weight row is multiplied alone
// (qpair_all's `alone`), by what each CPU ran faster: 4 on AMD (Zen 4), 0 elsewhere (the
// Intel Xeon); the same values either way
int64_t alone_rows() {
  static const int64_t rows = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") ? int64_t{4} : int64_t{0};
  }();
  return rows;
}

// "avx512" or "avx2": the instruction set the kernels use now
std::string cpu_isa() { return isa_name(current_isa()); }

// switch the kernels to "avx2", "avx512" (an error where the CPU lacks it) or "auto" (the
// CPU's best unless RAGSPEC_CPU_ISA=avx2); returns the previous one
std::string set_cpu_isa(const std::string& name) {
  const std::string prev = cpu_isa();
  if (name == "avx2") g_isa.store(kIsaAvx2);
  else if (name == "avx512") {
    TORCH_CHECK(cpu_has_avx512(), "set_cpu_isa: this CPU lacks AVX-512 (F, BW, VL, DQ)");
    g_isa.store(kIsaAvx512);
  } else if (name == "auto") g_isa.store(detect_isa());
  else TORCH_CHECK(false, "set_cpu_isa: expected 'avx2', 'avx512' or 'auto', got '", name, "'");
  return prev;
}

namespace {
bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && cpu_has_avx512();
}
}  // namespace

// whether this CPU runs the fast-numerics formats (3, 4): AVX-512 F/BW/VL/DQ and VNNI, and
// AVX-512 not masked off (RAGSPEC_CPU_ISA=avx2 / set_cpu_isa("avx2"))
bool fast_numerics_supported() { return cpu_has_vnni() && current_isa() == kIsaAvx512; }
