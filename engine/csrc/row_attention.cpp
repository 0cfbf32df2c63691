// Attention on the CPU one query row at a time: softmax(q k^T * scale) v over the keys the row may see, each row
// computed by the same instruction sequence whatever the other rows, the padding keys or the masked keys between
// its own (masked keys are skipped, not added as zeros), so a token's output does not depend on the forward that
// computes it (engine/attention_layout.py, batch invariance). One call replaces the dozen tensor operations and
// three batched matmuls per layer of engine/paged_attention.py's matmul path.
//
// Per row: s_j = (q . k_j) * scale for the allowed keys j in order (each dot product: d / 16 fused multiply-adds
// into one vector, a last partial vector masked, then its lanes summed by a fixed tree); m = max s; e_j = exp(s_j - m) (a vector polynomial,
// the same for every lane); out = (sum_j e_j v_j) / (sum_j e_j), both sums in key order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>

namespace {

constexpr int LANES = 16;

// exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, scaled by 2^n. Inputs below
// -87 give exp(-87) (~1e-38): weights that vanish beside the row's largest, which is 1.
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The lanes of a head's channels c .. c + 15 that exist (all but in a last, partial vector).
inline __mmask16 lanes(int64_t c, int64_t d) { return d - c >= LANES ? 0xFFFF : static_cast<__mmask16>((1u << (d - c)) - 1); }

__attribute__((target("avx512f"))) inline float dot(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += LANES) {
    const __mmask16 m = lanes(c, d);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + c), _mm512_maskz_loadu_ps(m, b + c), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

struct Strides {
  int64_t request, head, row;
};

Strides strides_of(const torch::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// One query row: QROW [d], keys and values of its (request, KV head) at KEYS/VALUES + j * key_stride, ALLOWED [L].
__attribute__((target("avx512f"))) void attend_row(
    const float* qrow, const float* keys, const float* values, int64_t key_stride, int64_t value_stride,
    const bool* allowed, int64_t num_keys, int64_t d, float scale, std::vector<float>& scores,
    std::vector<int32_t>& index, float* out) {
  int64_t n = 0;
  for (int64_t j = 0; j < num_keys; ++j) {
    if (!allowed[j]) continue;
    index[n] = static_cast<int32_t>(j);
    scores[n++] = dot(qrow, keys + j * key_stride, d) * scale;
  }
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, scores[j]);
  const __m512 vm = _mm512_set1_ps(m);
  for (int64_t j = 0; j < n; j += LANES) {  // the buffers hold whole vectors past n
    _mm512_storeu_ps(&scores[j], exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(&scores[j]), vm)));
  }
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) total += scores[j];
  for (int64_t c = 0; c < d; c += LANES) {
    const __mmask16 m = lanes(c, d);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      acc = _mm512_fmadd_ps(_mm512_set1_ps(scores[j]), _mm512_maskz_loadu_ps(m, values + index[j] * value_stride + c), acc);
    }
    _mm512_mask_storeu_ps(out + c, m, _mm512_div_ps(acc, _mm512_set1_ps(total)));
  }
}

}  // namespace

// q [R, H, rows, d]; k, v [R, H, L, d] (last dimension contiguous, any other strides: views of the pool);
// mask [R, 1, rows, L] bool, True where a query may look (each row sees at least one key) -> [R, H, rows, d].
torch::Tensor row_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& mask, double scaling) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32,
              "row_attention takes float32");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the head dimension must be contiguous");
  const int64_t R = q.size(0), H = q.size(1), rows = q.size(2), d = q.size(3), L = k.size(2);
  const auto allowed = mask.contiguous();
  auto out = torch::empty({R, H, rows, d}, q.options());
  const Strides qs = strides_of(q), ks = strides_of(k), vs = strides_of(v);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = allowed.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, R * H * rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(L + LANES);
    std::vector<int32_t> index(L + LANES);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / (H * rows), h = item / rows % H, i = item % rows;
      attend_row(qp + r * qs.request + h * qs.head + i * qs.row, kp + r * ks.request + h * ks.head,
                 vp + r * vs.request + h * vs.head, ks.row, vs.row, mp + (r * rows + i) * L, L, d, scale, scores,
                 index, op + ((r * H + h) * rows + i) * d);
    }
  });
  return out;
}
