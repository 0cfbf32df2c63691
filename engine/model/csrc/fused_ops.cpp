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
//
// Batch invariance (engine/model/attention_layout.py): every row (a token, or a head of a token) is computed alone by
// the same instruction sequence whatever the rows beside it. Each kernel is written once over 16-float vectors (GCC's
// vector extensions) and compiled for AVX-512F, AVX2 and baseline x86-64 by target attributes: the same float
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
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

#define INLINE static inline __attribute__((always_inline))
#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2")))

enum class Isa { generic = 0, avx2 = 1, avx512 = 2 };

// ---- vector helpers: the same float operations in every variant -----------------------------------------------------

INLINE vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

INLINE void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

INLINE vf splat(float x) { return vf{} + x; }

// The first N < 16 floats at P, zeros after them.
INLINE vf load_part(const float* p, int64_t n) {
  float buffer[W] = {};
  std::memcpy(buffer, p, n * sizeof(float));
  return load(buffer);
}

INLINE void store_part(float* p, vf v, int64_t n) {
  float buffer[W];
  store(buffer, v);
  std::memcpy(p, buffer, n * sizeof(float));
}

// The sum of a vector's lanes by a fixed tree: lane l + lane l + 8, then + 4, + 2, + 1.
INLINE float lane_sum(vf v) {
  float s[W];
  store(s, v);
  for (int width = W / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) s[l] = s[l] + s[l + width];
  }
  return s[0];
}

// 1 / sqrt(mean(x^2) + eps) over N floats: the squares summed in 16 lanes (float i in lane i % 16), in order.
INLINE float inverse_rms(const float* x, int64_t n, float eps) {
  vf acc = {};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf v = load(x + i);
    acc = acc + v * v;
  }
  if (i < n) {
    const vf v = load_part(x + i, n - i);
    acc = acc + v * v;
  }
  return 1.0f / std::sqrt(lane_sum(acc) / static_cast<float>(n) + eps);
}

// out = (x * inverse) * weight, as torch's rms_norm scales. OUT may be X.
INLINE void scale_row(const float* x, float inverse, const float* weight, float* out, int64_t n) {
  const vf s = splat(inverse);
  int64_t i = 0;
  for (; i + W <= n; i += W) store(out + i, (load(x + i) * s) * load(weight + i));
  if (i < n) store_part(out + i, (load_part(x + i, n - i) * s) * load_part(weight + i, n - i), n - i);
}

INLINE void norm_row(const float* x, const float* weight, float eps, float* out, int64_t n) {
  scale_row(x, inverse_rms(x, n, eps), weight, out, n);
}

// exp(x), x clamped to [-87, 88]: x = n ln2 + r, a degree-6 polynomial in r, times 2^n built in the exponent bits.
INLINE vf exp_clamped(vf x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  x = x > splat(88.0f) ? splat(88.0f) : x;
  const vf n = (x * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f);  // round to nearest
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.0f / 720);
  p = p * r + splat(1.0f / 120);
  p = p * r + splat(1.0f / 24);
  p = p * r + splat(1.0f / 6);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// act(g) * u: SiLU g / (1 + exp(-g)); GELU-tanh 0.5 g (1 + tanh(y)) = g / (1 + exp(-2y)),
// y = sqrt(2/pi) (g + 0.044715 g^3).
template <bool GELU>
INLINE vf gated(vf g, vf u) {
  vf z;
  if constexpr (GELU) {
    z = splat(-1.5957691216057308f) * (g + splat(0.044715f) * (g * g * g));
  } else {
    z = -g;
  }
  return (g / (splat(1.0f) + exp_clamped(z))) * u;
}

// Rotary embedding of one head in place (X may be OUT): out = x cos + rotate_half(x) sin, as transformers computes
// it: the first half x1 cos - x2 sin, the second x2 cos + x1 sin (a sum with a negated product is the difference).
INLINE void rotate_head(const float* x, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t half = d / 2;
  if (half % W == 0) {
    for (int64_t i = 0; i < half; i += W) {
      const vf a = load(x + i), b = load(x + half + i);
      const vf lo = a * load(cos + i) - b * load(sin + i);
      const vf hi = b * load(cos + half + i) + a * load(sin + half + i);
      store(out + i, lo);
      store(out + half + i, hi);
    }
    return;
  }
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[half + i];
    const float lo = a * cos[i] - b * sin[i];
    const float hi = b * cos[half + i] + a * sin[half + i];
    out[i] = lo;
    out[half + i] = hi;
  }
}

// ---- the kernels' bodies, compiled once per instruction set ---------------------------------------------------------

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

// Head J (queries, then keys, then values) of token T.
INLINE void rope_one(const RopeArgs& a, int64_t t, int64_t j) {
  const int64_t d = a.d;
  const float* src = a.qkv + (t * (a.heads + 2 * a.kv_heads) + j) * d;
  const bool is_query = j < a.heads, is_key = !is_query && j < a.heads + a.kv_heads;
  const int64_t kv_head = is_query ? 0 : (j - a.heads) % a.kv_heads;
  float* dst = is_query ? a.query + (t * a.heads + j) * d
                        : (is_key ? a.keys : a.values) + a.slots[t] * a.slot_stride + kv_head * a.head_stride;
  if (!is_query && !is_key) {
    std::memcpy(dst, src, d * sizeof(float));
    return;
  }
  const float* weight = is_query ? a.q_weight : a.k_weight;
  if (weight != nullptr) {
    norm_row(src, weight, a.eps, dst, d);
    src = dst;
  }
  rotate_head(src, a.cos + t * d, a.sin + t * d, dst, d);
}

INLINE void rope_body(const RopeArgs& a, int64_t begin, int64_t end) {
  const int64_t per_token = a.heads + 2 * a.kv_heads;
  for (int64_t item = begin; item < end; ++item) rope_one(a, item / per_token, item % per_token);
}

INLINE void norm_body(const float* x, int64_t x_stride, const float* weight, float eps, float* out, int64_t n,
                      int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) norm_row(x + r * x_stride, weight, eps, out + r * n, n);
}

// hidden[r] += delta[r] (normed by DELTA_WEIGHT first where given); out[r] = rms_norm(hidden[r]).
INLINE void add_norm_body(float* hidden, const float* delta, int64_t delta_stride, const float* weight,
                          const float* delta_weight, float eps, float delta_eps, float* out, int64_t n, int64_t begin,
                          int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    float* h = hidden + r * n;
    const float* x = delta + r * delta_stride;
    const float inverse = delta_weight != nullptr ? inverse_rms(x, n, delta_eps) : 0.0f;
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const vf add = delta_weight != nullptr ? (load(x + i) * splat(inverse)) * load(delta_weight + i) : load(x + i);
      store(h + i, load(h + i) + add);
    }
    for (; i < n; ++i) h[i] = h[i] + (delta_weight != nullptr ? (x[i] * inverse) * delta_weight[i] : x[i]);
    norm_row(h, weight, eps, out + r * n, n);
  }
}

template <bool GELU>
INLINE void gated_body(const float* gate_up, int64_t stride, float* out, int64_t n, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const float* g = gate_up + r * stride;
    const float* u = g + n;
    float* o = out + r * n;
    int64_t i = 0;
    for (; i + W <= n; i += W) store(o + i, gated<GELU>(load(g + i), load(u + i)));
    if (i < n) store_part(o + i, gated<GELU>(load_part(g + i, n - i), load_part(u + i, n - i)), n - i);
  }
}

// One token of a row X [n] drawn at uniform U in (0, 1] from softmax(x * inv_t): weights e = exp((x - max) * inv_t)
// (0 for a -inf logit) into E, each chunk of 256 summed in 16 lanes and then by the fixed tree into SUMS; the first
// chunk whose running total (double, chunks in order) reaches u * total, then the first token in it whose running
// total (double, token by token) reaches it. A token without weight is never the first to reach it; where rounding
// leaves the chunk's tokens a hair short of its sum, the chunk's last token with weight is taken (it has some: its
// sum reached the target).
constexpr int64_t SAMPLE_CHUNK = 16;  // vectors of weights per summed chunk: 256 tokens

INLINE int64_t sample_body(const float* x, int64_t n, float inv_t, double u, float* e, float* sums) {
  const vf minus_inf = splat(-INFINITY);
  const int64_t whole = n / W, blocks = (n + W - 1) / W;
  if (blocks > whole) {  // the last block's tokens in E, -inf past the row's end
    store(e + whole * W, minus_inf);
    std::memcpy(e + whole * W, x + whole * W, (n - whole * W) * sizeof(float));
  }
  vf high = minus_inf;
  for (int64_t b = 0; b < blocks; ++b) {
    const vf v = load(b < whole ? x + b * W : e + b * W);
    high = v > high ? v : high;
  }
  float top = -INFINITY;
  for (int l = 0; l < W; ++l) top = std::max(top, high[l]);
  TORCH_CHECK(top > -INFINITY, "sample_rows: a row with every token masked");
  double total = 0.0;
  for (int64_t c = 0; c * SAMPLE_CHUNK < blocks; ++c) {  // each chunk's weights summed in 16 lanes, then one tree
    vf chunk = splat(0.0f);
    for (int64_t b = c * SAMPLE_CHUNK; b < std::min(blocks, (c + 1) * SAMPLE_CHUNK); ++b) {
      const vf v = load(b < whole ? x + b * W : e + b * W);
      const vf weights = v == minus_inf ? splat(0.0f) : exp_clamped((v - splat(top)) * splat(inv_t));
      store(e + b * W, weights);
      chunk = chunk + weights;
    }
    sums[c] = lane_sum(chunk);
    total += sums[c];
  }
  const double target = u * total;
  double before = 0.0;
  int64_t c = 0;
  while ((c + 1) * SAMPLE_CHUNK < blocks && before + sums[c] < target) before += sums[c++];
  int64_t last = -1;
  for (int64_t j = c * SAMPLE_CHUNK * W; j < std::min(n, (c + 1) * SAMPLE_CHUNK * W); ++j) {
    if (e[j] == 0.0f) continue;
    last = j;
    before += e[j];
    if (before >= target) return j;
  }
  return last;
}

#define SAMPLE_PARAMS \
  (const float* x, int64_t stride, int64_t n, float inv_t, const double* u, float* e, float* sums, int64_t* out, \
   int64_t begin, int64_t end)
#define SAMPLE_LOOP \
  for (int64_t r = begin; r < end; ++r)                                                                        \
    out[r] = sample_body(x + r * stride, n, inv_t, u[r], e + r * ((n + W - 1) / W * W), sums + r * ((n + W - 1) / W))

#define DISPATCH(isa, name, ...)                                        \
  switch (isa) {                                                        \
    case Isa::avx512: name##_avx512(__VA_ARGS__); break;                \
    case Isa::avx2: name##_avx2(__VA_ARGS__); break;                    \
    default: name##_generic(__VA_ARGS__); break;                        \
  }

AVX512 void rope_avx512(const RopeArgs& a, int64_t begin, int64_t end) { rope_body(a, begin, end); }
AVX2 void rope_avx2(const RopeArgs& a, int64_t begin, int64_t end) { rope_body(a, begin, end); }
void rope_generic(const RopeArgs& a, int64_t begin, int64_t end) { rope_body(a, begin, end); }

#define NORM_PARAMS \
  (const float* x, int64_t x_stride, const float* weight, float eps, float* out, int64_t n, int64_t begin, int64_t end)
AVX512 void norm_avx512 NORM_PARAMS { norm_body(x, x_stride, weight, eps, out, n, begin, end); }
AVX2 void norm_avx2 NORM_PARAMS { norm_body(x, x_stride, weight, eps, out, n, begin, end); }
void norm_generic NORM_PARAMS { norm_body(x, x_stride, weight, eps, out, n, begin, end); }

#define ADD_NORM_PARAMS                                                                                           \
  (float* hidden, const float* delta, int64_t delta_stride, const float* weight, const float* delta_weight,       \
   float eps, float delta_eps, float* out, int64_t n, int64_t begin, int64_t end)
#define ADD_NORM_ARGS hidden, delta, delta_stride, weight, delta_weight, eps, delta_eps, out, n, begin, end
AVX512 void add_norm_avx512 ADD_NORM_PARAMS { add_norm_body(ADD_NORM_ARGS); }
AVX2 void add_norm_avx2 ADD_NORM_PARAMS { add_norm_body(ADD_NORM_ARGS); }
void add_norm_generic ADD_NORM_PARAMS { add_norm_body(ADD_NORM_ARGS); }

#define GATED_PARAMS \
  (bool gelu, const float* gate_up, int64_t stride, float* out, int64_t n, int64_t begin, int64_t end)
#define GATED_CALL \
  gelu ? gated_body<true>(gate_up, stride, out, n, begin, end) : gated_body<false>(gate_up, stride, out, n, begin, end)
AVX512 void gated_avx512 GATED_PARAMS { GATED_CALL; }
AVX2 void gated_avx2 GATED_PARAMS { GATED_CALL; }
void gated_generic GATED_PARAMS { GATED_CALL; }

AVX512 void sample_avx512 SAMPLE_PARAMS { SAMPLE_LOOP; }
AVX2 void sample_avx2 SAMPLE_PARAMS { SAMPLE_LOOP; }
void sample_generic SAMPLE_PARAMS { SAMPLE_LOOP; }

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
// parallel loop per layer over all of their rows, whatever the number of sequences.
void spans_attention(const torch::Tensor& query, const torch::Tensor& keys, const torch::Tensor& values,
                     at::IntArrayRef query_starts, at::IntArrayRef query_lens, at::TensorList key_slots,
                     at::TensorList masks, double scaling, torch::Tensor& out) {
  const size_t n = query_starts.size();
  TORCH_CHECK(query_lens.size() == n && key_slots.size() == n && masks.size() == n,
              "spans_attention: one start, length, key slots and mask per span");
  std::vector<RowAttentionArgs> calls;
  for (size_t i = 0; i < n; ++i) {
    calls.push_back(span_args(query.narrow(0, query_starts[i], query_lens[i]), keys, values, key_slots[i], masks[i],
                              scaling));
  }
  const auto outs = row_attention_all(calls);
  for (size_t i = 0; i < n; ++i) {
    out.narrow(0, query_starts[i], query_lens[i]).copy_(span_rows(outs[i], query_lens[i], query.size(1), query.size(2)));
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
