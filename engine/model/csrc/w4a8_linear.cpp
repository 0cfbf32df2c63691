// Linear layers with 4-bit or 8-bit weights in blocks of 32 inputs and activations rounded to 8 bits per block of 32,
// multiplied in integers with AVX512-VNNI: the arithmetic llama.cpp runs a Q4_1 or Q8_0 GGUF with (its Q8_1/Q8_0
// activations), here with every output row computed by the same instruction sequence whatever the other rows, so a
// token's logits do not depend on the forward that computes it (engine/model/attention_layout.py, batch invariance).
//
// Weights (packed by engine/model/w4a8.py): w[n, k] = scale[n, b] * code[n, k] + min[n, b], b = k / 32, codes signed bytes
// (0..15 for 4-bit, -127..127 for 8-bit), laid out per tile of 16 output channels and block of 32 inputs as the
// VNNI instruction reads them: 8 groups of 4 inputs, each a 64-byte vector of 16 channels x 4 codes; 4-bit codes
// hold group j in the low nibbles and group j + 4 in the high nibbles of the same 64 bytes.
// Activations: per row and block, d = max|x| / 127, q = round(x / d), stored as q + 128 (the instruction's unsigned
// operand); the shift's contribution 128 * sum(code) is subtracted exactly, in integers, from precomputed sums.
// Per block: t = float(sum q code) * scale + min * float(sum q); y += t * d.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>

namespace {

constexpr int TILE = 16;   // output channels per tile: one vector of floats
constexpr int BLOCK = 32;  // inputs per quantisation block
constexpr int ROWS = 4;    // activation rows that share one unpacking of a tile's weights

struct Activations {
  const uint8_t* codes;  // [M, K] q + 128
  const float* scales;   // [M, K / 32] d
  const float* sums;     // [M, K / 32] float(sum q)
  int64_t K;
  int64_t blocks;
};

void quantize_row(const float* x, int64_t K, uint8_t* codes, float* scales, float* sums) {
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    const float* xb = x + b * BLOCK;
    float amax = 0.0f;
    for (int i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f;
    const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int i = 0; i < BLOCK; ++i) {
      const int q = static_cast<int>(std::nearbyint(xb[i] * inverse));
      codes[b * BLOCK + i] = static_cast<uint8_t>(q + 128);
      sum += q;
    }
    scales[b] = d;
    sums[b] = static_cast<float>(sum);
  }
}

template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void load_tile_block(const int8_t* w, __m512i* groups) {
  if constexpr (BITS == 4) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(w + j * 64);
      groups[j] = _mm512_and_si512(v, low);
      groups[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
  } else {
    for (int j = 0; j < 8; ++j) groups[j] = _mm512_loadu_si512(w + j * 64);
  }
}

// R rows (1..ROWS) of one tile: out[r, 0:16] for rows row0 .. row0 + R - 1.
template <int BITS, int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_rows(
    const int8_t* w, const int32_t* shift, const float* scale, const float* min, const Activations& a, int64_t row0,
    float* out, int64_t ldo) {
  constexpr int block_bytes = BLOCK * TILE * BITS / 8;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m512i groups[8];
    load_tile_block<BITS>(w + b * block_bytes, groups);
    const __m512i vshift = _mm512_loadu_si512(shift + b * TILE);
    const __m512 vscale = _mm512_loadu_ps(scale + b * TILE);
    const __m512 vmin = _mm512_loadu_ps(min + b * TILE);
    for (int r = 0; r < R; ++r) {
      const int64_t row = row0 + r;
      const int32_t* x = reinterpret_cast<const int32_t*>(a.codes + row * a.K + b * BLOCK);
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();  // two chains: half the latency
      for (int j = 0; j < 8; j += 2) {
        even = _mm512_dpbusd_epi32(even, _mm512_set1_epi32(x[j]), groups[j]);
        odd = _mm512_dpbusd_epi32(odd, _mm512_set1_epi32(x[j + 1]), groups[j + 1]);
      }
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(even, odd), vshift);  // exact: integers
      __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), vscale);
      t = _mm512_fmadd_ps(vmin, _mm512_set1_ps(a.sums[row * a.blocks + b]), t);
      acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(a.scales[row * a.blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (row0 + r) * ldo, acc[r]);
}

template <int BITS>
void tile(const int8_t* w, const int32_t* shift, const float* scale, const float* min, const Activations& a,
          int64_t M, float* out, int64_t ldo) {
  int64_t row = 0;
  for (; row + ROWS <= M; row += ROWS) tile_rows<BITS, ROWS>(w, shift, scale, min, a, row, out, ldo);
  switch (M - row) {
    case 3: tile_rows<BITS, 3>(w, shift, scale, min, a, row, out, ldo); break;
    case 2: tile_rows<BITS, 2>(w, shift, scale, min, a, row, out, ldo); break;
    case 1: tile_rows<BITS, 1>(w, shift, scale, min, a, row, out, ldo); break;
    default: break;
  }
}

}  // namespace

// x [M, K] float32; codes [N / 16, K / 32, 32 * 16 * bits / 8] int8; shift [N / 16, K / 32, 16] int32;
// scale, min [N / 16, K / 32, 16] float32 -> [M, N] float32.
torch::Tensor w4a8_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& shift,
                     const torch::Tensor& scale, const torch::Tensor& min, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: [M, K] contiguous float32");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t M = x.size(0), K = x.size(1), tiles = scale.size(0), blocks = scale.size(1);
  TORCH_CHECK(K == blocks * BLOCK, "x has ", K, " inputs, the weights ", blocks * BLOCK);
  auto qcodes = torch::empty({M, K}, x.options().dtype(torch::kUInt8));
  auto qscales = torch::empty({M, blocks}, x.options());
  auto qsums = torch::empty({M, blocks}, x.options());
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {  // each row alone: the same codes on any thread
    for (int64_t row = begin; row < end; ++row) {
      quantize_row(xp + row * K, K, qcodes.data_ptr<uint8_t>() + row * K, qscales.data_ptr<float>() + row * blocks,
                   qsums.data_ptr<float>() + row * blocks);
    }
  });
  const Activations a{qcodes.data_ptr<uint8_t>(), qscales.data_ptr<float>(), qsums.data_ptr<float>(), K, blocks};
  auto out = torch::empty({M, tiles * TILE}, x.options());
  const int8_t* w = codes.data_ptr<int8_t>();
  const int64_t tile_bytes = codes.size(1) * codes.size(2);
  const int32_t* sh = shift.data_ptr<int32_t>();
  const float* sc = scale.data_ptr<float>();
  const float* mn = min.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t N = tiles * TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t params = t * blocks * TILE;
      if (bits == 4) {
        tile<4>(w + t * tile_bytes, sh + params, sc + params, mn + params, a, M, o + t * TILE, N);
      } else {
        tile<8>(w + t * tile_bytes, sh + params, sc + params, mn + params, a, M, o + t * TILE, N);
      }
    }
  });
  return out;
}
