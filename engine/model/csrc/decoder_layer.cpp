// A whole decoder layer of the lean forward in one call (engine/model/decoder.py `_fused_layer`, the same kernels in
// the same order, so the same bits): the fused qkv projection, the rotary embedding that writes the keys and values
// into the pool, attention over each sequence's keys where they lie in the pool, the output projection, the residual
// add and the MLP's norm, the gated MLP, and the residual add with the next layer's input norm.
//
// At batch 1 a layer's arithmetic takes about a millisecond and the dozen Python calls around it a noticeable part of
// that again; here they are C++ calls. The projections are GGUF blocks (block_linear.cpp), each Linear one or more
// parts whose outputs are concatenated (a Q5_0 query beside a Q8_0 value: one part per block type).
#include <torch/extension.h>
#include <optional>
#include <vector>

#include "ops.h"

namespace {

constexpr int64_t LINEARS = 4;  // qkv, output, gate_up, down
constexpr int64_t TENSORS_PER_PART = 3;  // codes, scales, mins (empty for signed codes)
constexpr int64_t FORMS_PER_PART = 3;  // bits, sub, out_features

struct Linears {
  at::TensorList weights;
  at::IntArrayRef forms;
  at::IntArrayRef parts;  // parts of each of the LINEARS
  c10::string_view isa;
  std::vector<int64_t> first_part;  // index of each linear's first part

  Linears(at::TensorList w, at::IntArrayRef f, at::IntArrayRef p, c10::string_view i)
      : weights(w), forms(f), parts(p), isa(i) {
    TORCH_CHECK(parts.size() == LINEARS, "decoder_layer: parts of qkv, output, gate_up and down");
    int64_t total = 0;
    for (const int64_t n : parts) {
      TORCH_CHECK(n >= 1, "decoder_layer: every Linear has a part");
      first_part.push_back(total);
      total += n;
    }
    TORCH_CHECK(static_cast<int64_t>(weights.size()) == TENSORS_PER_PART * total &&
                    static_cast<int64_t>(forms.size()) == FORMS_PER_PART * total,
                "decoder_layer: codes, scales and mins, and bits, sub and out_features, for every part");
  }

  // x times linear I's weights: its parts' outputs side by side (BlockLinear.forward, concatenated).
  torch::Tensor apply(int64_t i, const torch::Tensor& x) const {
    std::vector<torch::Tensor> outs;
    for (int64_t part = first_part[i]; part < first_part[i] + parts[i]; ++part) {
      const auto& mins = weights[TENSORS_PER_PART * part + 2];
      const int64_t* form = forms.data() + FORMS_PER_PART * part;
      auto out = block_linear(x, weights[TENSORS_PER_PART * part], weights[TENSORS_PER_PART * part + 1],
                              mins.numel() ? std::optional<torch::Tensor>(mins) : std::nullopt, form[0], form[1], isa);
      outs.push_back(out.size(1) == form[2] ? out : out.narrow(1, 0, form[2]));
    }
    return outs.size() == 1 ? outs[0] : torch::cat(outs, 1);
  }
};

}  // namespace

torch::Tensor decoder_layer(
    torch::Tensor& hidden, const torch::Tensor& normed, const torch::Tensor& cos, const torch::Tensor& sin,
    const torch::Tensor& slots, at::IntArrayRef query_starts, at::IntArrayRef query_lens, at::TensorList key_slots,
    at::TensorList masks, torch::Tensor& keys, torch::Tensor& values,
    at::TensorList weights, at::IntArrayRef forms, at::IntArrayRef parts, c10::string_view isa, int64_t heads,
    int64_t kv_heads, double scaling, const std::optional<torch::Tensor>& q_weight,
    const std::optional<torch::Tensor>& k_weight, double qk_eps, const torch::Tensor& mlp_norm, double mlp_eps,
    const std::optional<torch::Tensor>& attention_out_norm, double attention_out_eps,
    const std::optional<torch::Tensor>& mlp_out_norm, double mlp_out_eps, const torch::Tensor& next_norm,
    double next_eps, c10::string_view activation) {
  const Linears linears(weights, forms, parts, isa);
  int64_t covered = 0;
  for (const int64_t n : query_lens) covered += n;
  TORCH_CHECK(covered == hidden.size(0), "decoder_layer: the spans must cover every row");
  const auto query = rope_write(linears.apply(0, normed), cos, sin, heads, kv_heads, q_weight, k_weight, qk_eps, keys,
                                values, slots);
  auto attended = torch::empty_like(query);
  spans_attention(query, keys, values, query_starts, query_lens, key_slots, masks, scaling, attended);
  const auto projected = linears.apply(1, attended.view({hidden.size(0), -1}));
  const auto mlp_input = fused_add_rms_norm(hidden, projected, mlp_norm, mlp_eps, attention_out_norm,
                                            attention_out_eps);
  const auto mlp = linears.apply(3, gated_activation(linears.apply(2, mlp_input), activation));
  return fused_add_rms_norm(hidden, mlp, next_norm, next_eps, mlp_out_norm, mlp_out_eps);
}
