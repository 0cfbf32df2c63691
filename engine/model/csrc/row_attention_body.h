// row_attention's arithmetic, written once over a vector of 16 floats (V) and its operations, and included by
// row_attention.cpp once per instruction set inside a namespace that defines them: AVX-512 (one register) and AVX2
// (two). Each operation gives the same bits on both (the same lane-wise IEEE operations, fused multiply-adds
// included, and the same fixed trees of adds), so a row's output does not depend on which variant computes it.
// Included only from row_attention.cpp, inside `#pragma GCC target` regions: no include guard, no includes.

// exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, scaled by 2^n. Inputs below
// -87 give exp(-87) (~1e-38): weights that vanish beside the row's largest, which is 1.
inline V vexp_nonpositive(V x) {
  x = vmax(x, vset(-87.0f));
  const V n = vround(vmul(x, vset(1.44269504088896341f)));
  V r = vfnmadd(n, vset(0.693359375f), x);
  r = vfnmadd(n, vset(-2.12194440e-4f), r);
  V p = vset(1.0f / 720);
  p = vfmadd(p, r, vset(1.0f / 120));
  p = vfmadd(p, r, vset(1.0f / 24));
  p = vfmadd(p, r, vset(1.0f / 6));
  p = vfmadd(p, r, vset(0.5f));
  p = vfmadd(p, r, vset(1.0f));
  p = vfmadd(p, r, vset(1.0f));
  return vscale(p, n);
}

// Scores of N query rows (the heads of one KV head at one query position) against every key: S[n][j] =
// (q_n . k_j) * scale, each dot product the channels' products in 16 lanes (fused multiply-adds over the head's
// vectors in order, a last partial vector masked) summed by `lane_sums`: the same bits whichever rows and which
// block of 16 keys it is computed with. Keys 16 at a time, each block scored for every row while it is in L1.
template <int CHUNKS, int N>  // CHUNKS: the head's channels in vectors of 16; 0: any number, the last vector masked
void score_rows(
    const float* const* q, const KeyRows& keys, int64_t num_keys, int64_t d, float scale,
    float* const* scores) {
  const int64_t chunks = CHUNKS ? CHUNKS : (d + LANES - 1) / LANES;
  for (int64_t j0 = 0; j0 < num_keys; j0 += LANES) {
    const int present = static_cast<int>(std::min<int64_t>(LANES, num_keys - j0));
    for (int n = 0; n < N; ++n) {
      V acc[LANES];
      for (int j = present; j < LANES; ++j) acc[j] = vzero();
      if constexpr (CHUNKS > 0) {
        V qv[CHUNKS];
        for (int c = 0; c < CHUNKS; ++c) qv[c] = vload(q[n] + c * LANES);
        for (int j = 0; j < present; ++j) {
          const float* key = keys.at(j0 + j);
          V a = vzero();
          for (int c = 0; c < CHUNKS; ++c) a = vfmadd(qv[c], vload(key + c * LANES), a);
          acc[j] = a;
        }
      } else {
        for (int j = 0; j < present; ++j) {
          const float* key = keys.at(j0 + j);
          V a = vzero();
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t m = d - c * LANES;
            a = vfmadd(vloadn(q[n] + c * LANES, m), vloadn(key + c * LANES, m), a);
          }
          acc[j] = a;
        }
      }
      vstore(scores[n] + j0, vmul(vlane_sums(acc), vset(scale)));
    }
  }
}

// One row's softmax over the N keys it may see (INDEX: their keys, in order), in place in SCORES: the
// allowed scores compacted in key order, exp(s - max) in their place; returns the weights' sum (16 lanes, weight
// j in lane j % 16, then one lane tree).
float softmax_weights(float* scores, const std::vector<int32_t>& index, int64_t n) {
  if (n > 0 && index[n - 1] != n - 1) {  // else the allowed keys are a prefix (a causal row): nothing moves
    for (int64_t j = 0; j < n; ++j) scores[j] = scores[index[j]];  // j <= index[j]: in place, in order
  }
  V highest = vset(-INFINITY);
  for (int64_t j = 0; j < n; j += LANES) highest = vmax(highest, vloadn(&scores[j], n - j));
  const V vm = vset(vreduce_max(highest));  // a maximum: the same in any order
  V sums = vzero();
  for (int64_t j = 0; j < n; j += LANES) {  // the buffer holds whole vectors past n
    const V e = vexp_nonpositive(vsub(vload(&scores[j]), vm));
    vstore(&scores[j], e);
    sums = vadd(sums, vkeep(e, n - j));
  }
  return vreduce_add(sums);
}

// N rows' weighted sums of the values of their N allowed keys (INDEX): per row and vector of the head, even and
// odd keys in two chains added at the end, divided by the row's weight sum. Keys VALUE_BLOCK at a time, each
// block weighed for every row while its values are in L1 (the chains carried from block to block).
template <int CHUNKS, int N>
void weigh_values(
    float* const* weights, const float* totals, const std::vector<int32_t>& index, int64_t n, const KeyRows& values,
    int64_t d, float* const* out) {
  if constexpr (CHUNKS > 0) {
    V even[N][CHUNKS], odd[N][CHUNKS];
    for (int r = 0; r < N; ++r)
      for (int c = 0; c < CHUNKS; ++c) even[r][c] = odd[r][c] = vzero();
    for (int64_t j0 = 0; j0 < n; j0 += VALUE_BLOCK) {
      const int64_t stop = std::min<int64_t>(n, j0 + VALUE_BLOCK);
      for (int r = 0; r < N; ++r) {
        V e[CHUNKS], o[CHUNKS];
        for (int c = 0; c < CHUNKS; ++c) e[c] = even[r][c], o[c] = odd[r][c];
        int64_t j = j0;
        for (; j + 1 < stop; j += 2) {
          const V we = vset(weights[r][j]), wo = vset(weights[r][j + 1]);
          const float* ve = values.at(index[j]);
          const float* vo = values.at(index[j + 1]);
          for (int c = 0; c < CHUNKS; ++c) {
            e[c] = vfmadd(we, vload(ve + c * LANES), e[c]);
            o[c] = vfmadd(wo, vload(vo + c * LANES), o[c]);
          }
        }
        if (j < stop) {  // the last key of an odd count
          const V we = vset(weights[r][j]);
          const float* ve = values.at(index[j]);
          for (int c = 0; c < CHUNKS; ++c) e[c] = vfmadd(we, vload(ve + c * LANES), e[c]);
        }
        for (int c = 0; c < CHUNKS; ++c) even[r][c] = e[c], odd[r][c] = o[c];
      }
    }
    for (int r = 0; r < N; ++r) {
      const V total = vset(totals[r]);
      for (int c = 0; c < CHUNKS; ++c) vstore(out[r] + c * LANES, vdiv(vadd(even[r][c], odd[r][c]), total));
    }
    return;
  }
  for (int r = 0; r < N; ++r) {  // any head size: row by row, vector by vector
    for (int64_t c = 0; c < d; c += LANES) {
      const int64_t m = d - c;
      V even = vzero(), odd = vzero();
      int64_t j = 0;
      for (; j + 1 < n; j += 2) {
        even = vfmadd(vset(weights[r][j]), vloadn(values.at(index[j]) + c, m), even);
        odd = vfmadd(vset(weights[r][j + 1]), vloadn(values.at(index[j + 1]) + c, m), odd);
      }
      if (j < n) even = vfmadd(vset(weights[r][j]), vloadn(values.at(index[j]) + c, m), even);
      vstoren(out[r] + c, vdiv(vadd(even, odd), vset(totals[r])), m);
    }
  }
}

// Attention of N rows sharing one mask row (ALLOWED [L]): scores, softmax, weighted values. SCORES[n] [padded]
// and INDEX [padded] are scratch.
template <int CHUNKS, int N>
void attend_rows(const float* const* q, const KeyRows& keys, const KeyRows& values,
                 const bool* allowed, int64_t num_keys, int64_t d, float scale, float* const* scores,
                 std::vector<int32_t>& index, float* const* out) {
  score_rows<CHUNKS, N>(q, keys, num_keys, d, scale, scores);
  int64_t n = 0;
  for (int64_t j = 0; j < num_keys; ++j) {
    if (allowed[j]) index[n++] = static_cast<int32_t>(j);
  }
  float totals[N];
  for (int r = 0; r < N; ++r) totals[r] = softmax_weights(scores[r], index, n);
  weigh_values<CHUNKS, N>(scores, totals, index, n, values, d, out);
}

template <int N>
void attend_rows_any(const float* const* q, const KeyRows& keys, const KeyRows& values, const bool* allowed, int64_t num_keys, int64_t d, float scale,
                     float* const* scores, std::vector<int32_t>& index, float* const* out) {
  switch (d) {
    case 64: return attend_rows<4, N>(q, keys, values, allowed, num_keys, d, scale, scores, index, out);
    case 128: return attend_rows<8, N>(q, keys, values, allowed, num_keys, d, scale, scores, index, out);
    case 256: return attend_rows<16, N>(q, keys, values, allowed, num_keys, d, scale, scores, index, out);
    default: return attend_rows<0, N>(q, keys, values, allowed, num_keys, d, scale, scores, index, out);
  }
}

// Up to MAX_GROUP rows that share a mask row at once.
void attend_group(int group, const float* const* q, const KeyRows& keys, const KeyRows& values,
                  const bool* allowed, int64_t num_keys, int64_t d, float scale,
                  float* const* scores, std::vector<int32_t>& index, float* const* out) {
  switch (group) {
    case 1: return attend_rows_any<1>(q, keys, values, allowed, num_keys, d, scale, scores, index, out);
    case 2: return attend_rows_any<2>(q, keys, values, allowed, num_keys, d, scale, scores, index, out);
    case 3: return attend_rows_any<3>(q, keys, values, allowed, num_keys, d, scale, scores, index, out);
    default: return attend_rows_any<4>(q, keys, values, allowed, num_keys, d, scale, scores, index, out);
  }
}

