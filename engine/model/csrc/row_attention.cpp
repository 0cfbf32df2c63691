// Attention on the CPU one query row at a time: softmax(q k^T * scale) v over the keys the row may see, each row
// computed by the same instruction sequence whatever the other rows, the padding keys or the masked keys between
// its own (masked keys are skipped, not added as zeros), so a token's output does not depend on the forward that
// computes it (engine/model/attention_layout.py, batch invariance). One call replaces the dozen tensor operations and
// three batched matmuls per layer of engine/model/paged_attention.py's matmul path.
//
// Per row, for the allowed keys j in order: s_j = (q . k_j) * scale (the channels' products in 16 lanes, summed by
// a fixed tree; 16 keys at a time); m = max s; e_j = exp(s_j - m) (a vector polynomial, the same for every lane);
// out = (sum_j e_j v_j) / (sum_j e_j), each sum in a fixed association over the row's allowed keys in order (the
// weights' sum in 16 lanes, the weighted values in an even and an odd chain). The query heads that share a KV head
// are computed together at each query (they share its mask): a block of keys is scored, and a block of values
// weighed, for all of them while it is in L1, each head's arithmetic exactly that of a row alone (so where
// there are fewer queries than threads, a query's heads are split over the threads without changing a bit).
//
// The arithmetic is written once (row_attention_body.h) over 16-float vectors and compiled twice: for AVX-512F (one
// register) and for AVX2 with FMA (two), chosen at run time (SPECSERVE_CPU_ISA=avx2 picks AVX2 on an AVX-512 CPU).
// Both give the same bits: lane-wise IEEE operations, the same fused multiply-adds, the same trees of adds.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "row_attention.h"

namespace {

constexpr int LANES = 16;
constexpr int MAX_GROUP = 4;  // query rows sharing a mask computed together (they share key and value loads)
constexpr int VALUE_BLOCK = 32;  // keys whose values are weighed for every row of a group at once (even)

struct Strides {
  int64_t request, head, row;
};

Strides strides_of(const torch::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// Where each key (or value) of a row lies: key j at base + rows[j] * stride. rows is 0, 1, 2, .. for keys in
// consecutive slots, and the pool slots of a sequence's keys where its blocks lie apart (read in place, not copied).
struct KeyRows {
  const float* base;
  const int64_t* rows;
  int64_t stride;
  const float* at(int64_t j) const { return base + rows[j] * stride; }
};

using AttendGroup = void (*)(int group, const float* const* q, const KeyRows& keys, const KeyRows& values,
                             const bool* allowed, int64_t num_keys, int64_t d, float scale, float* const* scores,
                             std::vector<int32_t>& index, float* const* out);

}  // namespace

// ---- AVX-512F: a vector is one register ----------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace row_avx512 {

using V = __m512;

inline __mmask16 lanes(int64_t n) { return n >= LANES ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float x) { return _mm512_set1_ps(x); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vloadn(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }  // lanes >= n: 0
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline void vstoren(float* p, V v, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
inline V vkeep(V v, int64_t n) { return _mm512_maskz_mov_ps(lanes(n), v); }
inline V vfmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline float vreduce_max(V v) { return _mm512_reduce_max_ps(v); }
// GCC's reduction: lanes l + l+8, then l + l+4, l + l+2, l + l+1: the tree vlane_sums takes per vector
inline float vreduce_add(V v) { return _mm512_reduce_add_ps(v); }

inline V vfnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
inline V vround(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); }  // to nearest, ties to even
inline V vscale(V p, V n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n whole

// Sums of the lanes of 16 vectors, v[j]'s sum in lane j: four levels of pairwise adds (halves, quarters, pairs,
// neighbours), the same tree for every vector whatever the others hold.
inline V vlane_sums(const V* v) {
  V halves[8], quarters[4], pairs[2];
  for (int k = 0; k < 8; ++k) {  // [v_2k lanes l + l+8 | v_2k+1 lanes l + l+8], l < 8
    halves[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44), _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  }
  for (int k = 0; k < 4; ++k) {  // [v_4k | v_4k+1 | v_4k+2 | v_4k+3], 4 partial sums each
    quarters[k] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * k], halves[2 * k + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * k], halves[2 * k + 1], 0xDD));
  }
  for (int k = 0; k < 2; ++k) {  // in 128-bit block b: two partial sums of v_8k+b, then two of v_8k+4+b
    pairs[k] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * k], quarters[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(quarters[2 * k], quarters[2 * k + 1], 0xEE));
  }
  const V sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88), _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
  // lane 4b + p holds the sum of v[4p + b]: put v[j]'s sum in lane j
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

#include "row_attention_body.h"

}  // namespace row_avx512
#pragma GCC pop_options

// ---- AVX2 with FMA: a vector is two registers, lanes 0-7 and 8-15 -----------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace row_avx2 {

struct V {
  __m256 lo, hi;
};

// Lanes i < n of 8 starting at lane FIRST as an all-ones mask.
inline __m256i lanes(int64_t n, int first) {
  const int64_t count = std::min<int64_t>(std::max<int64_t>(n - first, 0), 8);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V vloadn(const float* p, int64_t n) {
  if (n >= LANES) return vload(p);
  return {_mm256_maskload_ps(p, lanes(n, 0)), _mm256_maskload_ps(p + 8, lanes(n, 8))};
}
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
inline void vstoren(float* p, V v, int64_t n) {
  if (n >= LANES) return vstore(p, v);
  _mm256_maskstore_ps(p, lanes(n, 0), v.lo), _mm256_maskstore_ps(p + 8, lanes(n, 8), v.hi);
}
inline V vkeep(V v, int64_t n) {
  return {_mm256_and_ps(v.lo, _mm256_castsi256_ps(lanes(n, 0))), _mm256_and_ps(v.hi, _mm256_castsi256_ps(lanes(n, 8)))};
}
inline V vfmadd(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V vadd(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V vsub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V vdiv(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }

inline float vreduce_max(V v) {
  const __m256 h = _mm256_max_ps(v.lo, v.hi);
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// The lanes' sum by AVX-512's tree: h_l = a_l + a_l+8, q_l = h_l + h_l+4, p_l = q_l + q_l+2, p_0 + p_1.
inline float vreduce_add(V v) {
  const __m256 h = _mm256_add_ps(v.lo, v.hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

inline V vfnmadd(V a, V b, V c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline V vround(V x) {
  constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.lo, nearest), _mm256_round_ps(x.hi, nearest)};
}

// AVX-512's scalef: p times 2^n, the power made exactly from n's exponent bits (n >= -126 in vexp_nonpositive: a
// normal float), one rounding as scalef's.
inline __m256 scale_half(__m256 p, __m256 n) {
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}
inline V vscale(V p, V n) { return {scale_half(p.lo, n.lo), scale_half(p.hi, n.hi)}; }

inline V vlane_sums(const V* v) {
  alignas(32) float sums[LANES];
  for (int j = 0; j < LANES; ++j) sums[j] = vreduce_add(v[j]);
  return vload(sums);
}

#include "row_attention_body.h"

}  // namespace row_avx2
#pragma GCC pop_options

namespace {

enum class RowIsa { none, avx2, avx512 };

// The best variant this CPU runs, within SPECSERVE_CPU_ISA's cap (engine/model/cpu_kernels.py).
RowIsa detect_row_isa() {
  const char* cap = std::getenv("SPECSERVE_CPU_ISA");
  const std::string capped = cap != nullptr ? cap : "";
  if (capped == "none" || capped == "NONE") return RowIsa::none;
  if (capped != "avx2" && capped != "AVX2" && __builtin_cpu_supports("avx512f")) return RowIsa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return RowIsa::avx2;
  return RowIsa::none;
}

RowIsa& current_row_isa() {
  static RowIsa isa = detect_row_isa();
  return isa;
}

// The number of keys a mask row needs scored: up to its last allowed key.
int64_t keys_needed(const bool* allowed, int64_t num_keys) {
  int64_t last = num_keys;
  while (last > 0 && !allowed[last - 1]) --last;
  return last;
}

}  // namespace

namespace {

// One call's operands, checked, and the tensors it reads and writes kept alive.
struct Call {
  torch::Tensor allowed, key_index, out;
  const float *qp, *kp, *vp;
  const bool* mp;
  const int64_t* kr;
  float* op;
  Strides qs, ks, vs;
  int64_t R, H, rows, d, L, G, Q, mask_rows, key_rows_stride;
  float scale;
};

Call prepare(const RowAttentionArgs& a) {
  const auto &q = a.q, &k = a.k, &v = a.v;
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32,
              "row_attention takes float32");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the head dimension must be contiguous");
  Call c;
  c.R = q.size(0), c.H = q.size(1), c.rows = q.size(2), c.d = q.size(3), c.G = a.heads_per_kv_head;
  c.L = a.key_rows.has_value() ? a.key_rows->size(-1) : k.size(2);
  TORCH_CHECK(c.G >= 1 && c.rows % c.G == 0, "rows (", c.rows, ") must be a multiple of heads_per_kv_head (", c.G, ")");
  TORCH_CHECK(k.size(2) == v.size(2), "keys and values must have as many rows");
  c.Q = c.rows / c.G;
  c.allowed = a.mask.contiguous();
  TORCH_CHECK(c.allowed.size(0) == c.R && c.allowed.size(2) >= c.Q && c.allowed.size(3) == c.L,
              "the mask must have a row per query and a column per key");
  c.key_index = a.key_rows.has_value() ? a.key_rows->to(torch::kInt64).contiguous().view({-1})
                                       : torch::arange(c.L, torch::dtype(torch::kInt64));
  c.kr = c.key_index.data_ptr<int64_t>();
  if (a.key_rows.has_value()) {
    TORCH_CHECK(c.key_index.numel() == c.R * c.L, "key_rows must be [R, L]");
    for (int64_t j = 0; j < c.R * c.L; ++j) {
      TORCH_CHECK(c.kr[j] >= 0 && c.kr[j] < k.size(2), "key_rows must index k's rows");
    }
  }
  c.key_rows_stride = a.key_rows.has_value() ? c.L : 0;
  c.out = torch::empty({c.R, c.H, c.rows, c.d}, q.options());
  c.qs = strides_of(q), c.ks = strides_of(k), c.vs = strides_of(v);
  c.qp = q.data_ptr<float>(), c.kp = k.data_ptr<float>(), c.vp = v.data_ptr<float>();
  c.mp = c.allowed.data_ptr<bool>();
  c.mask_rows = c.allowed.size(2);
  c.op = c.out.data_ptr<float>();
  c.scale = static_cast<float>(a.scaling);
  return c;
}

// The pool decoding spans read (keys, values [slots, K, d]), checked once per call: float32, alike, the head
// dimension contiguous, HEADS query heads a multiple of its K.
void check_decode_pool(const torch::Tensor& keys, const torch::Tensor& values, int64_t heads) {
  TORCH_CHECK(keys.scalar_type() == torch::kFloat32 && values.scalar_type() == torch::kFloat32 && keys.stride(2) == 1 &&
                  keys.strides() == values.strides() && keys.sizes() == values.sizes() && heads % keys.size(1) == 0,
              "span_attention: float32 keys and values alike, query heads a multiple of kv heads");
}

// A decoding span as the call row_attention_all would prepare from span_attention's views of it (fused_ops.cpp
// span_args): its query as [1, K, G, d], the pool as [1, K, slots, d] (`check_decode_pool`), its output OUT's own
// rows.
Call decode_call(const DecodeSpan& span, const torch::Tensor& keys, const torch::Tensor& values, int64_t heads,
                 double scaling) {
  const int64_t K = keys.size(1), d = keys.size(2), S = keys.size(0);
  for (int64_t j = 0; j < span.L; ++j) {
    TORCH_CHECK(span.key_slots[j] >= 0 && span.key_slots[j] < S, "key_rows must index k's rows");
  }
  Call c;
  c.R = 1, c.H = K, c.G = heads / K, c.rows = c.G, c.Q = 1, c.d = d, c.L = span.L;
  c.qs = {heads * d, c.G * d, d};
  c.ks = {S * keys.stride(0), keys.stride(1), keys.stride(0)};
  c.vs = {S * values.stride(0), values.stride(1), values.stride(0)};
  c.qp = span.query, c.kp = keys.data_ptr<float>(), c.vp = values.data_ptr<float>();
  c.mp = span.mask, c.mask_rows = 1, c.kr = span.key_slots, c.key_rows_stride = span.L;
  c.op = span.out;
  c.scale = static_cast<float>(scaling);
  return c;
}

}  // namespace

// Each call: q [R, H, G * Q, d] (G query heads per KV head, head-major: row g * Q + i is head g at query i); k, v
// [R, H, S, d] (last dimension contiguous, any other strides: views of the pool); mask [R, 1, G * Q or Q, L] bool,
// True where query i may look (rows i < Q read: the G heads of a query share its mask; each query sees at least one
// key); key_rows [R, L] int64, the index along S of each of the L keys (None: keys 0 .. L - 1, S = L): a sequence's
// keys read where they lie in the pool -> [R, H, G * Q, d]. The G rows of a query are computed together, MAX_GROUP
// at a time, each as if alone; only the keys up to a query's last allowed one are scored. The calls' queries share
// one parallel loop.
std::vector<torch::Tensor> row_attention_all(const std::vector<RowAttentionArgs>& args,
                                             const std::vector<DecodeSpan>& decoding, const torch::Tensor* keys,
                                             const torch::Tensor* values, int64_t heads, double scaling) {
  TORCH_CHECK(current_row_isa() != RowIsa::none, "row_attention needs AVX-512F or AVX2 with FMA");
  const AttendGroup attend_group =
      current_row_isa() == RowIsa::avx512 ? row_avx512::attend_group : row_avx2::attend_group;
  std::vector<Call> calls;
  for (const auto& a : args) calls.push_back(prepare(a));
  if (!decoding.empty()) check_decode_pool(*keys, *values, heads);
  for (const auto& span : decoding) calls.push_back(decode_call(span, *keys, *values, heads, scaling));
  int64_t queries = 0, padded = LANES;
  for (const auto& c : calls) {
    queries += c.R * c.H * c.Q;
    padded = std::max(padded, (c.L + LANES - 1) / LANES * LANES + LANES);
  }
  // Fewer queries than threads (decoding with one KV head): a query's heads split into smaller groups, one per
  // thread. Each head's arithmetic is that of a row alone whatever its group, so the split changes no bits.
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> per_group, splits, first_item{0};
  for (const auto& c : calls) {
    per_group.push_back(queries >= threads ? MAX_GROUP
                                           : std::clamp<int64_t>((c.G * queries + threads - 1) / threads, 1, MAX_GROUP));
    splits.push_back((c.G + per_group.back() - 1) / per_group.back());
    first_item.push_back(first_item.back() + c.R * c.H * c.Q * splits.back());
  }
  at::parallel_for(0, first_item.back(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffers(MAX_GROUP * padded);
    std::vector<int32_t> index(padded);
    float* scores[MAX_GROUP];
    for (int n = 0; n < MAX_GROUP; ++n) scores[n] = buffers.data() + n * padded;
    size_t which = std::upper_bound(first_item.begin(), first_item.end(), begin) - first_item.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= first_item[which + 1]) ++which;
      const Call& c = calls[which];
      const int64_t local = item - first_item[which], s = splits[which];
      const int64_t query = local / s, r = query / (c.H * c.Q), h = query / c.Q % c.H, i = query % c.Q;
      const KeyRows keys{c.kp + r * c.ks.request + h * c.ks.head, c.kr + r * c.key_rows_stride, c.ks.row};
      const KeyRows values{c.vp + r * c.vs.request + h * c.vs.head, c.kr + r * c.key_rows_stride, c.vs.row};
      const bool* row_mask = c.mp + (r * c.mask_rows + i) * c.L;
      const int64_t num_keys = keys_needed(row_mask, c.L);
      const int64_t g0 = local % s * per_group[which];
      const int group = static_cast<int>(std::min<int64_t>(per_group[which], c.G - g0));
      const float* qrows[MAX_GROUP];
      float* orows[MAX_GROUP];
      for (int n = 0; n < group; ++n) {
        const int64_t row = (g0 + n) * c.Q + i;
        qrows[n] = c.qp + r * c.qs.request + h * c.qs.head + row * c.qs.row;
        orows[n] = c.op + ((r * c.H + h) * c.rows + row) * c.d;
      }
      attend_group(group, qrows, keys, values, row_mask, num_keys, c.d, c.scale, scores, index, orows);
    }
  });
  std::vector<torch::Tensor> outs;
  for (size_t i = 0; i < args.size(); ++i) outs.push_back(calls[i].out);
  return outs;
}

torch::Tensor row_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& mask, double scaling, int64_t heads_per_kv_head,
                            const std::optional<torch::Tensor>& key_rows) {
  return row_attention_all({RowAttentionArgs{q, k, v, mask, scaling, heads_per_kv_head, key_rows}})[0];
}

// Which variant of row_attention runs: "avx512", "avx2" or "none" (tests run each).
std::string row_attention_isa() {
  switch (current_row_isa()) {
    case RowIsa::avx512: return "avx512";
    case RowIsa::avx2: return "avx2";
    default: return "none";
  }
}

void set_row_attention_isa(const std::string& isa) {
  if (isa == "avx512") {
    TORCH_CHECK(__builtin_cpu_supports("avx512f"), "this CPU has no AVX-512F");
    current_row_isa() = RowIsa::avx512;
  } else {
    TORCH_CHECK(isa == "avx2", "isa must be avx512 or avx2");
    TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), "this CPU has no AVX2 with FMA");
    current_row_isa() = RowIsa::avx2;
  }
}
