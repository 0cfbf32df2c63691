// A whole decoder layer of the lean forward in one call (decoder_layer.cpp): declared here for module.cpp, which
// registers it.
#pragma once
#include <torch/extension.h>
#include <optional>

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
