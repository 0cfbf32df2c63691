// row_attention's calls, as fused_ops.cpp's spans_attention makes several at once (one parallel loop over all of
// their rows, so a step decoding many sequences pays one fork and join per layer and spreads them evenly).
#pragma once
#include <torch/extension.h>
#include <optional>
#include <vector>

struct RowAttentionArgs {
  torch::Tensor q, k, v, mask;
  double scaling;
  int64_t heads_per_kv_head;
  std::optional<torch::Tensor> key_rows;
};

// A decoding sequence's one query over its keys where they lie in the pool, read and written in place: QUERY [H, d]
// and OUT [H, d] contiguous, MASK [L] (its allowed keys), KEY_SLOTS [L] the pool slot of each key. What
// row_attention_all computes of the same query as a call, without the call's tensors (views, a mask copy, an
// output and its copy back: ~5 us a sequence and layer, 30 layers a step; on a 2-core Xeon decoding ran 1.06x as
// fast at batch 1 without them, 1.10x at 16, 1.12x at 64).
struct DecodeSpan {
  const float* query;
  const bool* mask;
  const int64_t* key_slots;
  int64_t L;
  float* out;
};

// Each call's row_attention output, all computed in one parallel loop; each row's bits those of its call alone.
// DECODING: spans computed in the same loop, each over KEYS and VALUES [slots, K, d] (the layer's pool) with
// HEADS query heads, HEADS / K a KV head, at SCALING.
std::vector<torch::Tensor> row_attention_all(const std::vector<RowAttentionArgs>& calls,
                                             const std::vector<DecodeSpan>& decoding = {},
                                             const torch::Tensor* keys = nullptr, const torch::Tensor* values = nullptr,
                                             int64_t heads = 0, double scaling = 1.0);
