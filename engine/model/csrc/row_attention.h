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

// Each call's row_attention output, all computed in one parallel loop; each row's bits those of its call alone.
std::vector<torch::Tensor> row_attention_all(const std::vector<RowAttentionArgs>& calls);
