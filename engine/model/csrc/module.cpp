// The CPU kernels as operators of torch's own (torch.ops.specserve.*, so the profiler names their time) and what
// this CPU can run of them. Every kernel is compiled for its instruction set with target attributes, so the module
// loads on any x86-64 CPU; engine/model/cpu_kernels.py asks before it uses one.
#include <torch/extension.h>

torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                           const std::optional<torch::Tensor>& mins, int64_t bits, int64_t sub, c10::string_view isa);
torch::Tensor row_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& mask, double scaling, int64_t heads_per_kv_head);

bool has_avx512() { return __builtin_cpu_supports("avx512f"); }

bool has_vnni() { return has_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"); }

bool has_avx2() { return __builtin_cpu_supports("avx2"); }

TORCH_LIBRARY(specserve, m) {
  m.def("block_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int bits, int sub, str isa) -> Tensor",
        &block_linear);
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scaling, int heads_per_kv_head) -> Tensor", &row_attention);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_avx512", &has_avx512, "whether this CPU runs row_attention (AVX-512F)");
  m.def("has_vnni", &has_vnni, "whether this CPU runs block_linear's AVX512-VNNI variant");
  m.def("has_avx2", &has_avx2, "whether this CPU runs block_linear's AVX2 variant");
}
