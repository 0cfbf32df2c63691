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
// weighed, for all of them while it is in L1, each head's arithmetic exactly that of a row alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>

namespace {

constexpr int LANES = 16;
constexpr int MAX_GROUP = 4;  // query rows sharing a mask computed together (they share key and value loads)

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

// Scores of N query rows (the heads of one KV head at one query position) against every key: S[n][j] =
// (q_n . k_j) * scale, each dot product the channels' products in 16 lanes (fused multiply-adds over the head's
// vectors in order, a last partial vector masked) summed by `lane_sums`: the same bits whichever rows and which
// block of 16 keys it is computed with. Keys 16 at a time, each block scored for every row while it is in L1.
template <int CHUNKS, int N>  // CHUNKS: the head's channels in vectors of 16; 0: any number, the last vector masked
__attribute__((target("avx512f"))) void score_rows(
    const float* const* q, const float* keys, int64_t key_stride, int64_t num_keys, int64_t d, float scale,
    float* const* scores) {
  const int64_t chunks = CHUNKS ? CHUNKS : (d + LANES - 1) / LANES;
  for (int64_t j0 = 0; j0 < num_keys; j0 += LANES) {
    const int present = static_cast<int>(std::min<int64_t>(LANES, num_keys - j0));
    for (int n = 0; n < N; ++n) {
      __m512 acc[LANES];
      for (int j = present; j < LANES; ++j) acc[j] = _mm512_setzero_ps();
      if constexpr (CHUNKS > 0) {
        __m512 qv[CHUNKS];
        for (int c = 0; c < CHUNKS; ++c) qv[c] = _mm512_loadu_ps(q[n] + c * LANES);
        for (int j = 0; j < present; ++j) {
          const float* key = keys + (j0 + j) * key_stride;
          __m512 a = _mm512_setzero_ps();
          for (int c = 0; c < CHUNKS; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(key + c * LANES), a);
          acc[j] = a;
        }
      } else {
        for (int j = 0; j < present; ++j) {
          const float* key = keys + (j0 + j) * key_stride;
          __m512 a = _mm512_setzero_ps();
          for (int64_t c = 0; c < chunks; ++c) {
            const __mmask16 m = lanes(c * LANES, d);
            a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q[n] + c * LANES), _mm512_maskz_loadu_ps(m, key + c * LANES), a);
          }
          acc[j] = a;
        }
      }
      _mm512_storeu_ps(scores[n] + j0, _mm512_mul_ps(lane_sums(acc), _mm512_set1_ps(scale)));
    }
  }
}

// One row's softmax over the N keys it may see (INDEX: their keys, in order), in place in SCORES: the
// allowed scores compacted in key order, exp(s - max) in their place; returns the weights' sum (16 lanes, weight
// j in lane j % 16, then one lane tree).
__attribute__((target("avx512f"))) float softmax_weights(float* scores, const std::vector<int32_t>& index, int64_t n) {
  if (n > 0 && index[n - 1] != n - 1) {  // else the allowed keys are a prefix (a causal row): nothing moves
    for (int64_t j = 0; j < n; ++j) scores[j] = scores[index[j]];  // j <= index[j]: in place, in order
  }
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += LANES) vmax = _mm512_max_ps(vmax, _mm512_maskz_loadu_ps(lanes(j, n), &scores[j]));
  const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));  // a maximum: the same in any order
  __m512 sums = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += LANES) {  // the buffer holds whole vectors past n
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(&scores[j]), vm));
    _mm512_storeu_ps(&scores[j], e);
    sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(lanes(j, n), e));
  }
  return _mm512_reduce_add_ps(sums);
}

// N rows' weighted sums of the values of their N allowed keys (INDEX): per row and vector of the head, even and
// odd keys in two chains added at the end, divided by the row's weight sum. Keys VALUE_BLOCK at a time, each
// block weighed for every row while its values are in L1 (the chains carried from block to block).
constexpr int VALUE_BLOCK = 32;  // even

template <int CHUNKS, int N>
__attribute__((target("avx512f"))) void weigh_values(
    float* const* weights, const float* totals, const std::vector<int32_t>& index, int64_t n, const float* values,
    int64_t value_stride, int64_t d, float* const* out) {
  if constexpr (CHUNKS > 0) {
    __m512 even[N][CHUNKS], odd[N][CHUNKS];
    for (int r = 0; r < N; ++r)
      for (int c = 0; c < CHUNKS; ++c) even[r][c] = odd[r][c] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < n; j0 += VALUE_BLOCK) {
      const int64_t stop = std::min<int64_t>(n, j0 + VALUE_BLOCK);
      for (int r = 0; r < N; ++r) {
        __m512 e[CHUNKS], o[CHUNKS];
        for (int c = 0; c < CHUNKS; ++c) e[c] = even[r][c], o[c] = odd[r][c];
        int64_t j = j0;
        for (; j + 1 < stop; j += 2) {
          const __m512 we = _mm512_set1_ps(weights[r][j]), wo = _mm512_set1_ps(weights[r][j + 1]);
          const float* ve = values + index[j] * value_stride;
          const float* vo = values + index[j + 1] * value_stride;
          for (int c = 0; c < CHUNKS; ++c) {
            e[c] = _mm512_fmadd_ps(we, _mm512_loadu_ps(ve + c * LANES), e[c]);
            o[c] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(vo + c * LANES), o[c]);
          }
        }
        if (j < stop) {  // the last key of an odd count
          const __m512 we = _mm512_set1_ps(weights[r][j]);
          const float* ve = values + index[j] * value_stride;
          for (int c = 0; c < CHUNKS; ++c) e[c] = _mm512_fmadd_ps(we, _mm512_loadu_ps(ve + c * LANES), e[c]);
        }
        for (int c = 0; c < CHUNKS; ++c) even[r][c] = e[c], odd[r][c] = o[c];
      }
    }
    for (int r = 0; r < N; ++r) {
      const __m512 total = _mm512_set1_ps(totals[r]);
      for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(out[r] + c * LANES, _mm512_div_ps(_mm512_add_ps(even[r][c], odd[r][c]), total));
    }
    return;
  }
  for (int r = 0; r < N; ++r) {  // any head size: row by row, vector by vector
    for (int64_t c = 0; c < d; c += LANES) {
      const __mmask16 m = lanes(c, d);
      __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
      int64_t j = 0;
      for (; j + 1 < n; j += 2) {
        even = _mm512_fmadd_ps(_mm512_set1_ps(weights[r][j]), _mm512_maskz_loadu_ps(m, values + index[j] * value_stride + c), even);
        odd = _mm512_fmadd_ps(_mm512_set1_ps(weights[r][j + 1]), _mm512_maskz_loadu_ps(m, values + index[j + 1] * value_stride + c), odd);
      }
      if (j < n) even = _mm512_fmadd_ps(_mm512_set1_ps(weights[r][j]), _mm512_maskz_loadu_ps(m, values + index[j] * value_stride + c), even);
      _mm512_mask_storeu_ps(out[r] + c, m, _mm512_div_ps(_mm512_add_ps(even, odd), _mm512_set1_ps(totals[r])));
    }
  }
}

// Attention of N rows sharing one mask row (ALLOWED [L]): scores, softmax, weighted values. SCORES[n] [padded]
// and INDEX [padded] are scratch.
template <int CHUNKS, int N>
void attend_rows(const float* const* q, const float* keys, int64_t key_stride, const float* values, int64_t value_stride,
                 const bool* allowed, int64_t num_keys, int64_t d, float scale, float* const* scores,
                 std::vector<int32_t>& index, float* const* out) {
  score_rows<CHUNKS, N>(q, keys, key_stride, num_keys, d, scale, scores);
  int64_t n = 0;
  for (int64_t j = 0; j < num_keys; ++j) {
    if (allowed[j]) index[n++] = static_cast<int32_t>(j);
  }
  float totals[N];
  for (int r = 0; r < N; ++r) totals[r] = softmax_weights(scores[r], index, n);
  weigh_values<CHUNKS, N>(scores, totals, index, n, values, value_stride, d, out);
}

template <int N>
void attend_rows_any(const float* const* q, const float* keys, int64_t key_stride, const float* values, int64_t value_stride, const bool* allowed, int64_t num_keys, int64_t d, float scale,
                     float* const* scores, std::vector<int32_t>& index, float* const* out) {
  switch (d) {
    case 64: return attend_rows<4, N>(q, keys, key_stride, values, value_stride, allowed, num_keys, d, scale, scores, index, out);
    case 128: return attend_rows<8, N>(q, keys, key_stride, values, value_stride, allowed, num_keys, d, scale, scores, index, out);
    case 256: return attend_rows<16, N>(q, keys, key_stride, values, value_stride, allowed, num_keys, d, scale, scores, index, out);
    default: return attend_rows<0, N>(q, keys, key_stride, values, value_stride, allowed, num_keys, d, scale, scores, index, out);
  }
}

// Up to MAX_GROUP rows that share a mask row at once.
void attend_group(int group, const float* const* q, const float* keys, int64_t key_stride, const float* values, int64_t value_stride,
                  const bool* allowed, int64_t num_keys, int64_t d, float scale,
                  float* const* scores, std::vector<int32_t>& index, float* const* out) {
  switch (group) {
    case 1: return attend_rows_any<1>(q, keys, key_stride, values, value_stride, allowed, num_keys, d, scale, scores, index, out);
    case 2: return attend_rows_any<2>(q, keys, key_stride, values, value_stride, allowed, num_keys, d, scale, scores, index, out);
    case 3: return attend_rows_any<3>(q, keys, key_stride, values, value_stride, allowed, num_keys, d, scale, scores, index, out);
    default: return attend_rows_any<4>(q, keys, key_stride, values, value_stride, allowed, num_keys, d, scale, scores, index, out);
  }
}

// The number of keys a mask row needs scored: up to its last allowed key.
int64_t keys_needed(const bool* allowed, int64_t num_keys) {
  int64_t last = num_keys;
  while (last > 0 && !allowed[last - 1]) --last;
  return last;
}

}  // namespace

// q [R, H, G * Q, d] (G query heads per KV head, head-major: row g * Q + i is head g at query i); k, v [R, H, L, d]
// (last dimension contiguous, any other strides: views of the pool); mask [R, 1, G * Q or Q, L] bool, True where
// query i may look (rows i < Q read: the G heads of a query share its mask; each query sees at least one key)
// -> [R, H, G * Q, d]. The G rows of a query are computed together, MAX_GROUP at a time, each as if alone; only
// the keys up to a query's last allowed one are scored.
torch::Tensor row_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& mask, double scaling, int64_t heads_per_kv_head) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32,
              "row_attention takes float32");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the head dimension must be contiguous");
  const int64_t R = q.size(0), H = q.size(1), rows = q.size(2), d = q.size(3), L = k.size(2), G = heads_per_kv_head;
  TORCH_CHECK(G >= 1 && rows % G == 0, "rows (", rows, ") must be a multiple of heads_per_kv_head (", G, ")");
  const int64_t Q = rows / G;
  const auto allowed = mask.contiguous();
  TORCH_CHECK(allowed.size(0) == R && allowed.size(2) >= Q && allowed.size(3) == L,
              "the mask must have a row per query and a column per key");
  auto out = torch::empty({R, H, rows, d}, q.options());
  const Strides qs = strides_of(q), ks = strides_of(k), vs = strides_of(v);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = allowed.data_ptr<bool>();
  const int64_t mask_rows = allowed.size(2);
  float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  const int64_t padded = (L + LANES - 1) / LANES * LANES + LANES;
  at::parallel_for(0, R * H * Q, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffers(MAX_GROUP * padded);
    std::vector<int32_t> index(padded);
    float* scores[MAX_GROUP];
    for (int n = 0; n < MAX_GROUP; ++n) scores[n] = buffers.data() + n * padded;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / (H * Q), h = item / Q % H, i = item % Q;
      const float* keys = kp + r * ks.request + h * ks.head;
      const float* values = vp + r * vs.request + h * vs.head;
      const bool* row_mask = mp + (r * mask_rows + i) * L;
      const int64_t num_keys = keys_needed(row_mask, L);
      for (int64_t g0 = 0; g0 < G; g0 += MAX_GROUP) {
        const int group = static_cast<int>(std::min<int64_t>(MAX_GROUP, G - g0));
        const float* qrows[MAX_GROUP];
        float* orows[MAX_GROUP];
        for (int n = 0; n < group; ++n) {
          const int64_t row = (g0 + n) * Q + i;
          qrows[n] = qp + r * qs.request + h * qs.head + row * qs.row;
          orows[n] = op + ((r * H + h) * rows + row) * d;
        }
        attend_group(group, qrows, keys, ks.row, values, vs.row, row_mask, num_keys, d, scale, scores, index, orows);
      }
    }
  });
  return out;
}
