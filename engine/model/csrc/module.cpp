// The CPU kernels as operators of torch's own (torch.ops.specserve.*, so the profiler names their time) and what
// this CPU can run of them. Every kernel is compiled for its instruction set with target attributes, so the module
// loads on any x86-64 CPU; engine/model/cpu_kernels.py asks before it uses one.
#include <torch/extension.h>

#include "ops.h"

bool has_avx512() { return __builtin_cpu_supports("avx512f"); }

bool has_vnni() { return has_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"); }

bool has_avx2() { return __builtin_cpu_supports("avx2"); }

TORCH_LIBRARY(specserve, m) {
  m.def("block_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int bits, int sub, str isa) -> Tensor",
        &block_linear);
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scaling, int heads_per_kv_head, "
        "Tensor? key_rows=None) -> Tensor", &row_attention);
  // engine/model/csrc/fused_ops.cpp: the lean decoder's small operators, fused
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &fused_rms_norm);
  m.def("add_rms_norm(Tensor(a!) hidden, Tensor delta, Tensor weight, float eps, Tensor? delta_weight, "
        "float delta_eps) -> Tensor", &fused_add_rms_norm);
  m.def("gated_activation(Tensor gate_up, str activation) -> Tensor", &gated_activation);
  m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor? q_weight, Tensor? k_weight, "
        "float eps, Tensor(a!) keys, Tensor(b!) values, Tensor slots) -> Tensor", &rope_write);
  m.def("span_attention(Tensor query, Tensor keys, Tensor values, Tensor key_slots, Tensor mask, float scaling) "
        "-> Tensor", &span_attention);
  m.def("spans_attention(Tensor query, Tensor keys, Tensor values, int[] query_starts, int[] query_lens, "
        "Tensor[] key_slots, Tensor[] masks, float scaling, Tensor(a!) out) -> ()", &spans_attention);
  m.def("argmax_rows(Tensor logits) -> Tensor", &argmax_rows);
  m.def("sample_rows(Tensor logits, float inv_temperature, float[] uniforms) -> Tensor", &sample_rows);
  // engine/model/csrc/decoder_layer.cpp: a whole layer of the lean decoder, its projections GGUF blocks
  m.def("decoder_layer(Tensor(a!) hidden, Tensor normed, Tensor cos, Tensor sin, Tensor slots, int[] query_starts, "
        "int[] query_lens, Tensor[] key_slots, Tensor[] masks, Tensor(b!) keys, Tensor(c!) values, "
        "Tensor[] weights, int[] forms, int[] parts, str isa, int heads, int kv_heads, float scaling, "
        "Tensor? q_weight, Tensor? k_weight, float qk_eps, Tensor mlp_norm, float mlp_eps, "
        "Tensor? attention_out_norm, float attention_out_eps, Tensor? mlp_out_norm, float mlp_out_eps, "
        "Tensor next_norm, float next_eps, str activation) -> Tensor", &decoder_layer);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_avx512", &has_avx512, "whether this CPU has AVX-512F");
  m.def("row_attention_isa", &row_attention_isa, "which variant of row_attention runs: avx512, avx2 or none");
  m.def("set_row_attention_isa", &set_row_attention_isa, "run row_attention's avx512 or avx2 variant (tests)");
  m.def("has_vnni", &has_vnni, "whether this CPU runs block_linear's AVX512-VNNI variant");
  m.def("has_amx", &has_amx, "whether this CPU and kernel run block_linear's AMX variant (AMX-INT8 and AVX512-VNNI)");
  m.def("has_avx2", &has_avx2, "whether this CPU runs block_linear's AVX2 variant");
  m.def("fused_ops_isa", &fused_ops_isa, "which variant of fused_ops.cpp runs: avx512, avx2 or generic");
  m.def("set_fused_ops_isa", &set_fused_ops_isa, "run fused_ops.cpp's avx512, avx2 or generic variant (tests)");
}
