// The small operators of a decoder layer, fused: what the lean forward (engine/model/decoder.py) runs between its
// matmuls and its attention, one call each where torch takes several (F.rms_norm alone decomposes into five on the
// CPU). At batch 1 a layer's arithmetic outside the matmuls is a few thousand floats; its cost is the calls.
//
// - rms_norm: x * (1 / sqrt(mean(x^2) + eps)) * weight per row (Gemma's 1 + weight passed precomputed).
// - add_rms_norm: hidden += delta (or += rms_norm(delta) by a second weight: Gemma's norm after attention and after
//   the MLP), in place; returns rms_norm(hidden): the residual add and the next norm in one pass.
// - gated_activation: act(gate) * up over [.., gate | up], act SiLU or GELU-tanh.
// - rope_write: the rotary embedding of the query and key heads of a fused qkv projection (Gemma's per-head norms
//   before it), the keys and values written into the layer's pool slots; returns the queries.
// - span_attention, spans_attention: a sequence's queries (or several sequences') attended over its keys where they
//   lie in the pool (row_attention.cpp), the views and layout changes of engine/model/paged_attention.py's in-place
//   path made here.
// - sample_rows: each row's token at its uniform from softmax(logits / temperature), by the inverse CDF in two
//   stages (a row's weights summed 256 at a time, then one chunk searched): what softmax, a float64 cumulative
//   sum and a search do in torch in ~100 us for a 49,152-token row, in ~30 us.
// - argmax_rows: each row's torch.argmax in one vectorised pass.
//
// Batch invariance (engine/model/attention_layout.py): every row (a token, or a head of a token) is computed alone by
// the same instruction sequence whatever the rows beside it. Each kernel is written once over 16-float vectors (GCC's
// vector extensions) in fused_ops_body.h, included below for AVX-512F, AVX2 and baseline x86-64: the same float
// operations, in the same order, in every variant (no fused multiply-adds: -ffp-contract=off; sums over a row kept in
// 16 lanes added by a fixed tree), so all three give the same bits. exp is a polynomial of our own (as in
// row_attention.cpp), so SiLU and GELU differ from torch's in the last bits; the rotary embedding and the residual add
// are torch's arithmetic exactly, the norms differ in the rounding of their sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "row_attention.h"

namespace {

constexpr int W = 16;  // floats per vector

#define INLINE static inline __attribute__((always_inline))

enum class Isa { generic = 0, avx2 = 1, avx512 = 2 };

struct RopeArgs {
  const float* qkv;  // [T, (H + 2K) * d]
  const float* cos;  // [T, d]
  const float* sin;
  const float* q_weight;  // [d] or null: per-head norms before the rotation (Gemma 3)
  const float* k_weight;
  float eps;
  int64_t heads, kv_heads, d;
  float* query;  // [T, H, d]
  float* keys;   // pool slots of the layer
  float* values;
  int64_t slot_stride, head_stride;  // of keys and values
  const int64_t* slots;  // [T]
};

// ---- the kernels (fused_ops_body.h), compiled once per instruction set ----------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace fused_avx512 {
#include "fused_ops_body.h"
}  // namespace fused_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2")
namespace fused_avx2 {
#define FUSED_OPS_HALVES
#include "fused_ops_body.h"
#undef FUSED_OPS_HALVES
}  // namespace fused_avx2
#pragma GCC pop_options

namespace fused_generic {
#include "fused_ops_body.h"
}  // namespace fused_generic

#define DISPATCH(isa, name, ...)                                        \
  switch (isa) {                                                        \
    case Isa::avx512: fused_avx512::name##_kernel(__VA_ARGS__); break;  \
    case Isa::avx2: fused_avx2::name##_kernel(__VA_ARGS__); break;      \
    default: fused_generic::name##_kernel(__VA_ARGS__); break;          \
  }

// ---- which variant runs --------------------------------------------------------------------------------------------

// The best this CPU has, within SPECSERVE_CPU_ISA's cap (engine/model/cpu_kernels.py): avx2 leaves the AVX2 variant.
Isa detect_isa() {
  const char* cap = std::getenv("SPECSERVE_CPU_ISA");
  const std::string capped = cap != nullptr ? cap : "";
  if (capped != "avx2" && capped != "AVX2" && __builtin_cpu_supports("avx512f")) return Isa::avx512;
  if (__builtin_cpu_supports("avx2")) return Isa::avx2;
  return Isa::generic;
}

Isa& current_isa() {
  static Isa isa = detect_isa();
  return isa;
}

// Rows of at least this many floats in all make a chunk of a parallel loop: a decoding step's few rows run inline.
constexpr int64_t GRAIN_FLOATS = 1 << 14;

int64_t grain(int64_t floats_per_item) {
  return std::max<int64_t>(1, GRAIN_FLOATS / std::max<int64_t>(1, floats_per_item));
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, "'s last dimension must be contiguous");
}

// T's rows as [rows, n] with a row stride (T's leading dimensions must fold into one).
torch::Tensor as_rows(const torch::Tensor& t) { return t.dim() == 2 ? t : t.reshape({-1, t.size(-1)}); }

const float* optional_weight(const std::optional<torch::Tensor>& weight, int64_t n, const char* name) {
  if (!weight.has_value()) return nullptr;
  TORCH_CHECK(weight->scalar_type() == torch::kFloat32 && weight->is_contiguous() && weight->numel() == n, name,
              " must be ", n, " contiguous float32");
  return weight->data_ptr<float>();
}

}  // namespace

// x [.., n] float32 -> rms_norm(x) * weight, each row alone.
torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t n = x.size(-1);
  const float* w = optional_weight(weight, n, "weight");
  const auto rows = as_rows(x);
  auto out = torch::empty(x.sizes(), x.options());
  const float* xp = rows.data_ptr<float>();
  const int64_t stride = rows.stride(0);
  float* op = out.data_ptr<float>();
  const Isa isa = current_isa();
  at::parallel_for(0, rows.size(0), grain(n), [&](int64_t begin, int64_t end) {
    DISPATCH(isa, norm, xp, stride, w, static_cast<float>(eps), op, n, begin, end);
  });
  return out;
}

// hidden [rows, n] (contiguous) += delta (rms_norm(delta) * delta_weight where given, by DELTA_EPS), in place;
// -> rms_norm(hidden) * weight.
torch::Tensor fused_add_rms_norm(torch::Tensor& hidden, const torch::Tensor& delta, const torch::Tensor& weight,
                                 double eps, const std::optional<torch::Tensor>& delta_weight, double delta_eps) {
  check_rows(delta, "delta");
  TORCH_CHECK(hidden.scalar_type() == torch::kFloat32 && hidden.is_contiguous(), "hidden must be contiguous float32");
  const int64_t n = hidden.size(-1);
  TORCH_CHECK(delta.size(-1) == n && delta.numel() == hidden.numel(), "hidden and delta must have the same shape");
  const float* w = optional_weight(weight, n, "weight");
  const float* dw = optional_weight(delta_weight, n, "delta_weight");
  const auto delta_rows = as_rows(delta);
  auto out = torch::empty(hidden.sizes(), hidden.options());
  float* hp = hidden.data_ptr<float>();
  const float* dp = delta_rows.data_ptr<float>();
  const int64_t stride = delta_rows.stride(0);
  float* op = out.data_ptr<float>();
  const Isa isa = current_isa();
  at::parallel_for(0, hidden.numel() / n, grain(n), [&](int64_t begin, int64_t end) {
    DISPATCH(isa, add_norm, hp, dp, stride, w, dw, static_cast<float>(eps), static_cast<float>(delta_eps), op, n, begin,
             end);
  });
  return out;
}

// gate_up [.., 2n] -> act(gate) * up [.., n]; ACTIVATION "silu" or "gelu_pytorch_tanh".
torch::Tensor gated_activation(const torch::Tensor& gate_up, c10::string_view activation) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(activation == "silu" || activation == "gelu_pytorch_tanh", "gated_activation: silu or gelu_pytorch_tanh");
  const bool gelu = activation == "gelu_pytorch_tanh";
  const int64_t n = gate_up.size(-1) / 2;
  TORCH_CHECK(gate_up.size(-1) == 2 * n, "gate_up's last dimension must be even");
  const auto rows = as_rows(gate_up);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  auto out = torch::empty(sizes, gate_up.options());
  const float* gp = rows.data_ptr<float>();
  const int64_t stride = rows.stride(0);
  float* op = out.data_ptr<float>();
  const Isa isa = current_isa();
  at::parallel_for(0, rows.size(0), grain(2 * n), [&](int64_t begin, int64_t end) {
    DISPATCH(isa, gated, gelu, gp, stride, op, n, begin, end);
  });
  return out;
}

// qkv [T, (H + 2K) * d] (queries, keys, values of each token); cos, sin [T, d]; q_weight, k_weight [d]
// per-head norms before the rotation (Gemma 3) or none; keys, values [slots, K, d] the layer's pool (last dimension
// contiguous); slots [T] int64. Writes each token's rotated keys and its values at its slot -> queries [T, H, d].
torch::Tensor rope_write(const torch::Tensor& qkv_in, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                         int64_t kv_heads, const std::optional<torch::Tensor>& q_weight,
                         const std::optional<torch::Tensor>& k_weight, double eps, torch::Tensor& keys,
                         torch::Tensor& values, const torch::Tensor& slots) {
  TORCH_CHECK(qkv_in.scalar_type() == torch::kFloat32 && qkv_in.dim() == 2, "qkv must be [T, n] float32");
  const auto qkv = qkv_in.contiguous();
  const int64_t T = qkv.size(0), d = keys.size(2);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * d, "qkv must hold heads + 2 kv_heads heads of ", d);
  TORCH_CHECK(keys.scalar_type() == torch::kFloat32 && values.scalar_type() == torch::kFloat32 && keys.stride(2) == 1 &&
                  values.stride(2) == 1 && keys.strides() == values.strides() && keys.size(1) == kv_heads,
              "keys and values must be float32 [slots, kv_heads, d] alike, d contiguous");
  const auto c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.scalar_type() == torch::kFloat32 && s.scalar_type() == torch::kFloat32 && c.numel() == T * d &&
                  s.numel() == T * d,
              "cos and sin must be float32 [T, d]");
  const auto slot_index = slots.to(torch::kInt64).contiguous();
  TORCH_CHECK(slot_index.numel() == T, "one slot per token");
  auto query = torch::empty({T, heads, d}, qkv.options());
  const RopeArgs args{qkv.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(),
                      optional_weight(q_weight, d, "q_weight"), optional_weight(k_weight, d, "k_weight"),
                      static_cast<float>(eps), heads, kv_heads, d, query.data_ptr<float>(), keys.data_ptr<float>(),
                      values.data_ptr<float>(), keys.stride(0), keys.stride(1), slot_index.data_ptr<int64_t>()};
  const Isa isa = current_isa();
  at::parallel_for(0, T * (heads + 2 * kv_heads), grain(4 * d), [&](int64_t begin, int64_t end) {
    DISPATCH(isa, rope, args, begin, end);
  });
  return query;
}

namespace {

// row_attention's operands for a sequence's queries [Q, H, d] over its keys at KEY_SLOTS in the pool (keys, values
// [slots, K, d]): its query heads folded into rows, the pool as [1, K, slots, d] (views: nothing copied when Q = 1).
RowAttentionArgs span_args(const torch::Tensor& query, const torch::Tensor& keys, const torch::Tensor& values,
                           const torch::Tensor& key_slots, const torch::Tensor& mask, double scaling) {
  const int64_t Q = query.size(0), H = query.size(1), d = query.size(2), K = keys.size(1), S = keys.size(0);
  TORCH_CHECK(H % K == 0 && keys.strides() == values.strides() && keys.sizes() == values.sizes(),
              "span_attention: query heads a multiple of kv heads, keys and values alike");
  const int64_t G = H / K;
  const auto q = Q == 1 ? query.reshape({1, K, G, d})
                        : query.reshape({Q, K, G, d}).permute({1, 2, 0, 3}).reshape({1, K, G * Q, d});
  const std::vector<int64_t> sizes{1, K, S, d};
  const std::vector<int64_t> strides{S * keys.stride(0), keys.stride(1), keys.stride(0), 1};
  return {q, keys.as_strided(sizes, strides, keys.storage_offset()),
          values.as_strided(sizes, strides, values.storage_offset()), mask, scaling, G, key_slots.view({1, -1})};
}

// row_attention's [1, K, G * Q, d] back as the span's [Q, H, d], contiguous.
torch::Tensor span_rows(const torch::Tensor& out, int64_t Q, int64_t H, int64_t d) {
  const int64_t K = out.size(1), G = H / K;
  return Q == 1 ? out.view({1, H, d}) : out.view({K, G, Q, d}).permute({2, 0, 1, 3}).contiguous().view({Q, H, d});
}

}  // namespace

// query [Q, H, d] (a sequence's new tokens); keys, values [slots, K, d] the layer's pool; key_slots [L] int64 the pool
// slot of each of the sequence's L keys, wherever its blocks lie (padding keys: any slot, masked); mask
// [1, 1, G * Q, L] (paged_attention's in-place span) -> [Q, H, d] contiguous: row_attention reading the keys in the
// pool, its query heads folded into rows as it takes them.
torch::Tensor span_attention(const torch::Tensor& query, const torch::Tensor& keys, const torch::Tensor& values,
                             const torch::Tensor& key_slots, const torch::Tensor& mask, double scaling) {
  const auto out = row_attention_all({span_args(query, keys, values, key_slots, mask, scaling)})[0];
  return span_rows(out, query.size(0), query.size(1), query.size(2));
}

// spans_attention: `span_attention` for each of several sequences, written into their rows of OUT [total, H, d]:
// span i's queries are query[query_starts[i] : + query_lens[i]], its keys at KEY_SLOTS[i], its mask MASKS[i]. One
// parallel loop per layer over all of their rows, whatever the number of sequences. A span of one query (decoding)
// is read from QUERY and written to OUT in place (row_attention.h `DecodeSpan`): the same arithmetic, no tensors.
void spans_attention(const torch::Tensor& query, const torch::Tensor& keys, const torch::Tensor& values,
                     at::IntArrayRef query_starts, at::IntArrayRef query_lens, at::TensorList key_slots,
                     at::TensorList masks, double scaling, torch::Tensor& out) {
  const size_t n = query_starts.size();
  TORCH_CHECK(query_lens.size() == n && key_slots.size() == n && masks.size() == n,
              "spans_attention: one start, length, key slots and mask per span");
  const int64_t H = query.size(1), d = query.size(2);
  TORCH_CHECK(keys.dim() == 3 && keys.size(2) == d, "spans_attention: keys [slots, K, d] of the queries' head size");
  const bool in_place = query.is_contiguous() && out.is_contiguous() && out.sizes() == query.sizes() &&
                        query.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32;
  std::vector<RowAttentionArgs> calls;
  std::vector<size_t> called;  // the spans computed as calls, their outputs copied into OUT's rows
  std::vector<DecodeSpan> decoding;
  for (size_t i = 0; i < n; ++i) {
    const auto& mask = masks[i];
    const auto& slots = key_slots[i];
    // a decoding span reads its mask's first row alone: contiguous, whatever the rows' strides (an expanded mask's 0)
    if (in_place && query_lens[i] == 1 && mask.scalar_type() == torch::kBool && mask.dim() == 4 &&
        mask.stride(3) == 1 && mask.size(3) == slots.numel() && slots.scalar_type() == torch::kInt64 &&
        slots.is_contiguous()) {
      const int64_t row = query_starts[i] * H * d;
      decoding.push_back({query.data_ptr<float>() + row, mask.data_ptr<bool>(), slots.data_ptr<int64_t>(),
                          slots.numel(), out.data_ptr<float>() + row});
      continue;
    }
    calls.push_back(span_args(query.narrow(0, query_starts[i], query_lens[i]), keys, values, slots, mask, scaling));
    called.push_back(i);
  }
  const auto outs = row_attention_all(calls, decoding, &keys, &values, H, scaling);
  for (size_t c = 0; c < called.size(); ++c) {
    const size_t i = called[c];
    out.narrow(0, query_starts[i], query_lens[i]).copy_(span_rows(outs[c], query_lens[i], H, d));
  }
}

// logits [rows, n] float32, each row's token drawn at its uniform in (0, 1] from softmax(logits * inv_temperature)
// -> [rows] int64 (engine/sampler.py `sample_tokens`).
torch::Tensor sample_rows(const torch::Tensor& logits, double inv_temperature, at::ArrayRef<double> uniforms) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == static_cast<int64_t>(uniforms.size()),
              "sample_rows: logits [rows, n] and a uniform per row");
  const int64_t rows = logits.size(0), n = logits.size(1), blocks = (n + W - 1) / W;
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  auto scratch = torch::empty({rows * (blocks * W + blocks)}, logits.options());
  float* e = scratch.data_ptr<float>();
  float* sums = e + rows * blocks * W;
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  int64_t* op = out.data_ptr<int64_t>();
  const float inv_t = static_cast<float>(inv_temperature);
  const Isa isa = current_isa();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    DISPATCH(isa, sample, x, stride, n, inv_t, uniforms.data(), e, sums, op, begin, end);
  });
  return out;
}

// logits [rows, n] float32 -> [rows] int64, each row's torch.argmax (engine/sampler.py `greedy_token_tensor`): one
// vectorised pass where torch's argmax compares a float at a time (~6 us a 49,152-token row against ~60).
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax_rows: logits [rows, n], n > 0");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  const float* x = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const Isa isa = current_isa();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    DISPATCH(isa, argmax, x, stride, n, op, begin, end);
  });
  return out;
}

// Which variant of the fused operators runs: "avx512", "avx2" or "generic" (tests run each).
std::string fused_ops_isa() {
  switch (current_isa()) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "generic";
  }
}

void set_fused_ops_isa(const std::string& isa) {
  if (isa == "avx512") {
    TORCH_CHECK(__builtin_cpu_supports("avx512f"), "this CPU has no AVX-512F");
    current_isa() = Isa::avx512;
  } else if (isa == "avx2") {
    TORCH_CHECK(__builtin_cpu_supports("avx2"), "this CPU has no AVX2");
    current_isa() = Isa::avx2;
  } else {
    TORCH_CHECK(isa == "generic", "isa must be avx512, avx2 or generic");
    current_isa() = Isa::generic;
  }
}
