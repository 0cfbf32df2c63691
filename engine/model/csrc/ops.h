// The kernels' entry points, declared once: module.cpp registers them as torch operators, and decoder_layer.cpp
// calls several of them directly (C++ calls, no dispatch between them).
#pragma once
#include <torch/extension.h>
#include <optional>
#include <string>

torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                           const std::optional<torch::Tensor>& mins, int64_t bits, int64_t sub, c10::string_view isa);
torch::Tensor row_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& mask, double scaling, int64_t heads_per_kv_head,
                            const std::optional<torch::Tensor>& key_rows);
torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor fused_add_rms_norm(torch::Tensor& hidden, const torch::Tensor& delta, const torch::Tensor& weight,
                                 double eps, const std::optional<torch::Tensor>& delta_weight, double delta_eps);
torch::Tensor gated_activation(const torch::Tensor& gate_up, c10::string_view activation);
torch::Tensor rope_write(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                         int64_t kv_heads, const std::optional<torch::Tensor>& q_weight,
                         const std::optional<torch::Tensor>& k_weight, double eps, torch::Tensor& keys,
                         torch::Tensor& values, const torch::Tensor& slots);
torch::Tensor span_attention(const torch::Tensor& query, const torch::Tensor& keys, const torch::Tensor& values,
                             const torch::Tensor& key_slots, const torch::Tensor& mask, double scaling);
void spans_attention(const torch::Tensor& query, const torch::Tensor& keys, const torch::Tensor& values,
                     at::IntArrayRef query_starts, at::IntArrayRef query_lens, at::TensorList key_slots,
                     at::TensorList masks, double scaling, torch::Tensor& out);
torch::Tensor argmax_rows(const torch::Tensor& logits);
torch::Tensor sample_rows(const torch::Tensor& logits, double inv_temperature, at::ArrayRef<double> uniforms);
bool has_vnni();  // module.cpp
bool has_amx();  // block_linear.cpp
std::string row_attention_isa();
void set_row_attention_isa(const std::string& isa);
std::string fused_ops_isa();
void set_fused_ops_isa(const std::string& isa);

// hidden [T, n] contiguous float32, updated in place to the layer's output; normed [T, n] its input norm of hidden;
// cos, sin [T, d]; slots [T] the tokens' pool slots; the spans (query_starts .. masks) cover hidden's rows, each a
// sequence whose keys lie at its KEY_SLOTS in the pool (masks for this layer's window);
// keys, values the layer's pool; weights, forms, parts the four Linears' parts -> the output normed by next_norm.
torch::Tensor decoder_layer(
    torch::Tensor& hidden, const torch::Tensor& normed, const torch::Tensor& cos, const torch::Tensor& sin,
    const torch::Tensor& slots, at::IntArrayRef query_starts, at::IntArrayRef query_lens, at::TensorList key_slots,
    at::TensorList masks, torch::Tensor& keys, torch::Tensor& values,
    at::TensorList weights, at::IntArrayRef forms, at::IntArrayRef parts, c10::string_view isa, int64_t heads,
    int64_t kv_heads, double scaling, const std::optional<torch::Tensor>& q_weight,
    const std::optional<torch::Tensor>& k_weight, double qk_eps, const torch::Tensor& mlp_norm, double mlp_eps,
    const std::optional<torch::Tensor>& attention_out_norm, double attention_out_eps,
    const std::optional<torch::Tensor>& mlp_out_norm, double mlp_out_eps, const torch::Tensor& next_norm,
    double next_eps, c10::string_view activation);
