// Attention on the CPU one query row at a time: softmax(q k^T * scale) v over the keys the row may see, each row
// computed by the same instruction sequence whatever the other rows, the padding keys or the masked keys between
// its own (masked keys are skipped, not added as zeros), so a token's output does not depend on the forward that
// computes it (engine/attention_layout.py, batch invariance). One call replaces the dozen tensor operations and
// three batched matmuls per layer of engine/paged_attention.py's matmul path.
//
// Per row, for the allowed keys j in order: s_j = (q . k_j) * scale (the channels' products in 16 lanes, summed by
// a fixed tree; 16 keys at a time); m = max s; e_j = exp(s_j - m) (a vector polynomial, the same for every lane);
// out = (sum_j e_j v_j) / (sum_j e_j), each sum in a fixed association over the row's allowed keys in order (the
// weights' sum in 16 lanes, the weighted values in an even and an odd chain).
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

struct Strides {
  int64_t request, head, row;
};

Strides strides_of(const torch::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// Sums of the lanes of 16 vectors, v[j]'s sum in lane j: four levels of pairwise adds (halves, quarters, pairs,
// neighbours), the same tree for every vector whatever the others hold.
__attribute__((target("avx512f"))) inline __m512 lane_sums(const __m512* v) {
  __m512 halves[8], quarters[4], pairs[2];
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
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88), _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
  // lane 4b + p holds the sum of v[4p + b]: put v[j]'s sum in lane j
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

// Scores of one query row against every key: S[j] = (q . k_j) * scale, each dot product the channels' products
// in 16 lanes (fused multiply-adds over the head's vectors in order, a last partial vector masked) summed by
// `lane_sums`: the same bits whichever rows and which block of 16 keys it is computed with.
template <int CHUNKS>  // the head's channels in vectors of 16; 0: any number, the last vector masked
__attribute__((target("avx512f"))) void score_row(
    const float* q, const float* keys, int64_t key_stride, int64_t num_keys, int64_t d, float scale, float* scores) {
  const int64_t chunks = CHUNKS ? CHUNKS : (d + LANES - 1) / LANES;
  __m512 qv[CHUNKS ? CHUNKS : 1];
  if constexpr (CHUNKS > 0) {
    for (int c = 0; c < CHUNKS; ++c) qv[c] = _mm512_loadu_ps(q + c * LANES);
  }
  for (int64_t j0 = 0; j0 < num_keys; j0 += LANES) {
    __m512 acc[LANES];
    const int present = static_cast<int>(std::min<int64_t>(LANES, num_keys - j0));
    for (int j = 0; j < LANES; ++j) acc[j] = _mm512_setzero_ps();
    for (int j = 0; j < present; ++j) {
      const float* key = keys + (j0 + j) * key_stride;
      for (int64_t c = 0; c < chunks; ++c) {
        if constexpr (CHUNKS > 0) {
          acc[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(key + c * LANES), acc[j]);
        } else {
          const __mmask16 m = lanes(c * LANES, d);
          acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + c * LANES), _mm512_maskz_loadu_ps(m, key + c * LANES), acc[j]);
        }
      }
    }
    _mm512_storeu_ps(scores + j0, _mm512_mul_ps(lane_sums(acc), _mm512_set1_ps(scale)));
  }
}

void score_any(const float* q, const float* keys, int64_t key_stride, int64_t num_keys, int64_t d, float scale, float* scores) {
  switch (d) {
    case 64: return score_row<4>(q, keys, key_stride, num_keys, d, scale, scores);
    case 128: return score_row<8>(q, keys, key_stride, num_keys, d, scale, scores);
    default: return score_row<0>(q, keys, key_stride, num_keys, d, scale, scores);
  }
}

// One row's softmax over the keys it may see (ALLOWED [L]) and its weighted sum of their values. SCORES [L] (whole
// vectors past L) becomes scratch; INDEX [L] too.
template <int CHUNKS>
__attribute__((target("avx512f"))) void attend_row(
    float* scores, const bool* allowed, int64_t num_keys, const float* values, int64_t value_stride, int64_t d,
    std::vector<int32_t>& index, float* out) {
  int64_t n = 0;
  for (int64_t j = 0; j < num_keys; ++j) {
    if (!allowed[j]) continue;
    index[n] = static_cast<int32_t>(j);
    scores[n++] = scores[j];  // compacted in key order: n <= j
  }
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += LANES) vmax = _mm512_max_ps(vmax, _mm512_maskz_loadu_ps(lanes(j, n), &scores[j]));
  const float m = _mm512_reduce_max_ps(vmax);  // a maximum: the same in any order
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sums = _mm512_setzero_ps();  // the weights' sum in 16 lanes (weight j in lane j % 16), then one lane tree
  for (int64_t j = 0; j < n; j += LANES) {  // the buffer holds whole vectors past n
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(&scores[j]), vm));
    _mm512_storeu_ps(&scores[j], e);
    sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(lanes(j, n), e));
  }
  const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sums));
  if constexpr (CHUNKS > 0) {  // one pass over the keys for every vector of the head
    __m512 even[CHUNKS], odd[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) even[c] = odd[c] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 1 < n; j += 2) {
      const __m512 we = _mm512_set1_ps(scores[j]), wo = _mm512_set1_ps(scores[j + 1]);
      const float* ve = values + index[j] * value_stride;
      const float* vo = values + index[j + 1] * value_stride;
      for (int c = 0; c < CHUNKS; ++c) {
        even[c] = _mm512_fmadd_ps(we, _mm512_loadu_ps(ve + c * LANES), even[c]);
        odd[c] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(vo + c * LANES), odd[c]);
      }
    }
    if (j < n) {
      const __m512 we = _mm512_set1_ps(scores[j]);
      const float* ve = values + index[j] * value_stride;
      for (int c = 0; c < CHUNKS; ++c) even[c] = _mm512_fmadd_ps(we, _mm512_loadu_ps(ve + c * LANES), even[c]);
    }
    for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(out + c * LANES, _mm512_div_ps(_mm512_add_ps(even[c], odd[c]), total));
    return;
  }
  for (int64_t c = 0; c < d; c += LANES) {  // even and odd keys in two chains, added at the end
    const __mmask16 m = lanes(c, d);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 1 < n; j += 2) {
      even = _mm512_fmadd_ps(_mm512_set1_ps(scores[j]), _mm512_maskz_loadu_ps(m, values + index[j] * value_stride + c), even);
      odd = _mm512_fmadd_ps(_mm512_set1_ps(scores[j + 1]), _mm512_maskz_loadu_ps(m, values + index[j + 1] * value_stride + c), odd);
    }
    if (j < n) even = _mm512_fmadd_ps(_mm512_set1_ps(scores[j]), _mm512_maskz_loadu_ps(m, values + index[j] * value_stride + c), even);
    _mm512_mask_storeu_ps(out + c, m, _mm512_div_ps(_mm512_add_ps(even, odd), total));
  }
}

void attend_any(float* scores, const bool* allowed, int64_t num_keys, const float* values, int64_t value_stride, int64_t d,
                std::vector<int32_t>& index, float* out) {
  switch (d) {
    case 64: return attend_row<4>(scores, allowed, num_keys, values, value_stride, d, index, out);
    case 128: return attend_row<8>(scores, allowed, num_keys, values, value_stride, d, index, out);
    default: return attend_row<0>(scores, allowed, num_keys, values, value_stride, d, index, out);
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
  const int64_t padded = (L + LANES - 1) / LANES * LANES + LANES;
  at::parallel_for(0, R * H * rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(padded);
    std::vector<int32_t> index(padded);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / (H * rows), h = item / rows % H, i = item % rows;
      score_any(qp + r * qs.request + h * qs.head + i * qs.row, kp + r * ks.request + h * ks.head, ks.row, L, d, scale,
                scores.data());
      attend_any(scores.data(), mp + (r * rows + i) * L, L, vp + r * vs.request + h * vs.head, vs.row, d, index,
                 op + ((r * H + h) * rows + i) * d);
    }
  });
  return out;
}
