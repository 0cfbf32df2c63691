// fused_ops.cpp's arithmetic, written once over a vector of 16 floats and included by fused_ops.cpp once per
// instruction set inside a namespace (under `#pragma GCC target`): AVX-512F and baseline x86-64 take GCC's 16-float
// vector as it is; AVX2 (FUSED_OPS_HALVES) takes a pair of 8-float vectors with the same operations lane by lane.
// With a 16-float vector GCC 12 keeps AVX2 values in memory, moves them a lane at a time and compares and selects lane
// by lane: on 16 rows rms_norm took 10.9 us where the pair takes 5.3, SiLU 47.8 against 14.7, sampling 295 against
// 53 us a 49,152-token row. Every operation is the same IEEE operation on each lane in every variant, so all three
// give the same bits. No include guard, no includes.

#ifdef FUSED_OPS_HALVES
typedef float vh __attribute__((vector_size(32)));
typedef int32_t vhi __attribute__((vector_size(32)));
struct vf {
  vh lo, hi;  // lanes 0-7, 8-15
};
struct vi {
  vhi lo, hi;
};
INLINE vf operator+(vf a, vf b) { return {a.lo + b.lo, a.hi + b.hi}; }
INLINE vf operator-(vf a, vf b) { return {a.lo - b.lo, a.hi - b.hi}; }
INLINE vf operator*(vf a, vf b) { return {a.lo * b.lo, a.hi * b.hi}; }
INLINE vf operator/(vf a, vf b) { return {a.lo / b.lo, a.hi / b.hi}; }
INLINE vf operator-(vf a) { return {-a.lo, -a.hi}; }
INLINE vi operator<(vf a, vf b) { return {a.lo < b.lo, a.hi < b.hi}; }
INLINE vi operator>(vf a, vf b) { return {a.lo > b.lo, a.hi > b.hi}; }
INLINE vi operator==(vf a, vf b) { return {a.lo == b.lo, a.hi == b.hi}; }
INLINE vi operator+(vi a, int32_t b) { return {a.lo + b, a.hi + b}; }
INLINE vi operator<<(vi a, int b) { return {a.lo << b, a.hi << b}; }
INLINE vf splat(float x) { return {vh{} + x, vh{} + x}; }
INLINE vf select(vi mask, vf a, vf b) { return {mask.lo ? a.lo : b.lo, mask.hi ? a.hi : b.hi}; }
INLINE vi to_int(vf v) { return {__builtin_convertvector(v.lo, vhi), __builtin_convertvector(v.hi, vhi)}; }
INLINE vf as_float(vi bits) { return {(vh)bits.lo, (vh)bits.hi}; }
INLINE vf load(const float* p) {  // half by half: a copy of the whole pair goes through the stack
  vf v;
  std::memcpy(&v.lo, p, sizeof v.lo);
  std::memcpy(&v.hi, p + W / 2, sizeof v.hi);
  return v;
}
INLINE void store(float* p, vf v) {
  std::memcpy(p, &v.lo, sizeof v.lo);
  std::memcpy(p + W / 2, &v.hi, sizeof v.hi);
}
#else
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
INLINE vf splat(float x) { return vf{} + x; }
INLINE vf select(vi mask, vf a, vf b) { return mask ? a : b; }  // a where MASK is set (-1), else b
INLINE vi to_int(vf v) { return __builtin_convertvector(v, vi); }  // rounding towards zero
INLINE vf as_float(vi bits) { return (vf)bits; }  // the same bits read as floats
INLINE vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
INLINE void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
#endif

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
  x = select(x < splat(-87.0f), splat(-87.0f), x);
  x = select(x > splat(88.0f), splat(88.0f), x);
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
  return p * as_float((to_int(n) + 127) << 23);
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

// ---- the kernels' bodies ----------------------------------------------------------------------------------------

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
    high = select(v > high, v, high);
  }
  float top = -INFINITY;
  float lanes[W];
  store(lanes, high);
  for (int l = 0; l < W; ++l) top = std::max(top, lanes[l]);
  TORCH_CHECK(top > -INFINITY, "sample_rows: a row with every token masked");
  double total = 0.0;
  for (int64_t c = 0; c * SAMPLE_CHUNK < blocks; ++c) {  // each chunk's weights summed in 16 lanes, then one tree
    vf chunk = splat(0.0f);
    for (int64_t b = c * SAMPLE_CHUNK; b < std::min(blocks, (c + 1) * SAMPLE_CHUNK); ++b) {
      const vf v = load(b < whole ? x + b * W : e + b * W);
      const vf weights = select(v == minus_inf, splat(0.0f), exp_clamped((v - splat(top)) * splat(inv_t)));
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

// The index torch.argmax gives a row X [n]: the first of its largest float, or of its first NaN where it has one. One
// pass keeps each lane's largest float and the first block it was reached in (a block index as a float: exact below
// 2^24); the row's largest is the largest lane's, its first index the least block * 16 + lane among lanes holding it
// (a lane's first block comes before every later one in any lane). The floats past the last whole vector follow.
INLINE int64_t argmax_body(const float* x, int64_t n) {
  const int64_t whole = n / W;
  const vf zero = splat(0.0f), one = splat(1.0f);
  vf high = splat(-INFINITY), first = zero, nans = zero;
  for (int64_t b = 0; b < whole; ++b) {
    const vf v = load(x + b * W);
    first = select(v > high, splat(static_cast<float>(b)), first);
    high = select(v > high, v, high);
    nans = nans + select(v == v, zero, one);
  }
  float lanes[W], blocks[W], nan_lanes[W];
  store(lanes, high);
  store(blocks, first);
  store(nan_lanes, nans);
  bool nan = false;
  for (int l = 0; l < W; ++l) nan = nan || nan_lanes[l] > 0.0f;
  for (int64_t j = whole * W; j < n; ++j) nan = nan || std::isnan(x[j]);
  if (nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (std::isnan(x[j])) return j;
    }
  }
  float top = -INFINITY;
  int64_t index = 0;
  for (int l = 0; l < W && whole; ++l) {
    const int64_t at = static_cast<int64_t>(blocks[l]) * W + l;
    if (lanes[l] > top || (lanes[l] == top && at < index)) top = lanes[l], index = at;
  }
  for (int64_t j = whole * W; j < n; ++j) {
    if (x[j] > top || (!whole && j == 0)) top = x[j], index = j;
  }
  return index;
}

// ---- the entry points fused_ops.cpp dispatches to -----------------------------------------------------------------

void rope_kernel(const RopeArgs& a, int64_t begin, int64_t end) { rope_body(a, begin, end); }

void norm_kernel(const float* x, int64_t x_stride, const float* weight, float eps, float* out, int64_t n,
                 int64_t begin, int64_t end) {
  norm_body(x, x_stride, weight, eps, out, n, begin, end);
}

void add_norm_kernel(float* hidden, const float* delta, int64_t delta_stride, const float* weight,
                     const float* delta_weight, float eps, float delta_eps, float* out, int64_t n, int64_t begin,
                     int64_t end) {
  add_norm_body(hidden, delta, delta_stride, weight, delta_weight, eps, delta_eps, out, n, begin, end);
}

void gated_kernel(bool gelu, const float* gate_up, int64_t stride, float* out, int64_t n, int64_t begin, int64_t end) {
  if (gelu) {
    gated_body<true>(gate_up, stride, out, n, begin, end);
  } else {
    gated_body<false>(gate_up, stride, out, n, begin, end);
  }
}

void argmax_kernel(const float* x, int64_t stride, int64_t n, int64_t* out, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) out[r] = argmax_body(x + r * stride, n);
}

void sample_kernel(const float* x, int64_t stride, int64_t n, float inv_t, const double* u, float* e, float* sums,
                   int64_t* out, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    out[r] = sample_body(x + r * stride, n, inv_t, u[r], e + r * ((n + W - 1) / W * W), sums + r * ((n + W - 1) / W));
  }
}
