// Linear layers with GGUF-style block-quantised weights (engine/model/blocks.py) times activations rounded to 8 bits
// per block of 32, multiplied in integers: the arithmetic llama.cpp runs a GGUF with, for two instruction sets chosen
// at run time (AVX512-VNNI, AVX2), each output row computed by the same instruction sequence whatever the other rows,
// so a token's logits do not depend on the forward that computes it (engine/model/attention_layout.py).
//
// Weights (packed by engine/model/block_linear.py), two forms:
// - unsigned: w[n, k] = scale[n, b] * code[n, k] + min[n, b], b = k / 32, codes 0..15 (bits 4) or 0..31 (bits 8);
// - signed: w[n, k] = scale[n, k / sub] * code[n, k], codes -128..127, sub 32 or 16 (two scales per block of 32).
// Layout per tile of 16 output channels and block of 32 inputs: 8 groups of 4 inputs, each a 64-byte vector of 16
// channels x 4 codes (4-bit: group j in the low, group j + 4 in the high nibbles of the same 64 bytes); AVX2 reads
// each vector as two 32-byte halves (channels 0-7, 8-15). Per tile and block: scales [32 / sub][16], mins [16].
// Activations: per row and block, d = max|x| / 127, q = nearbyint(x / d) as signed bytes, and the integer sum of q.
// Per row, channel and block, in order, in float32 without fused multiply-adds (-ffp-contract=off), so a reference
// reproduces every rounding and both instruction sets give the same bits:
//   unsigned:      t = float(sum code q) * scale; t = t + min * float(sum q); acc = acc + t * d
//   signed sub 32: t = float(sum code q) * scale; acc = acc + t * d
//   signed sub 16: t = float(dot0) * scale0; t = t + float(dot1) * scale1; acc = acc + t * d
// The dots are exact int32 sums whichever way they are formed. Unsigned codes are the instructions' unsigned operand
// as they are. Signed codes: VNNI multiplies code + 128 (a byte 0..255) and starts the sum at -128 * sum q (per 16
// inputs, from the activations: no weight-side buffer); AVX2, whose int16 products would saturate at 255 * 127,
// uses the sign trick: sum |code| * (q * sign(code)), |code| <= 128 as an unsigned byte.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define AVX2 __attribute__((target("avx2")))

namespace {

constexpr int TILE = 16;   // output channels per tile: one AVX-512 vector of floats, two AVX2 vectors
constexpr int BLOCK = 32;  // inputs per quantisation block
constexpr int ROWS = 4;    // activation rows that share one unpacking of a tile's weights

enum class Form { unsigned4, unsigned8, signed32, signed16 };
enum class Isa { avx2, vnni };

constexpr bool is_signed(Form f) { return f == Form::signed32 || f == Form::signed16; }
constexpr int block_bytes(Form f) { return f == Form::unsigned4 ? BLOCK * TILE / 2 : BLOCK * TILE; }
constexpr int block_scales(Form f) { return f == Form::signed16 ? 2 * TILE : TILE; }

struct Activations {
  const int8_t* codes;  // [M, K] q
  const float* scales;  // [M, K / 32] d
  const float* sums;    // [M, K / 32] float(sum q), exact
  const int32_t* offsets;  // [M, K / 16] -128 * sum q over each 16 inputs: where VNNI's signed dots start
  int64_t K;
  int64_t blocks;
};

struct Tile {  // one tile's blocks
  const uint8_t* codes;  // [blocks, block_bytes]
  const float* scales;   // [blocks, 32 / sub, 16]
  const float* mins;     // [blocks, 16] (unsigned form)
};

void quantize_row(const float* x, int64_t K, int8_t* codes, float* scales, float* sums, int32_t* offsets) {
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    const float* xb = x + b * BLOCK;
    float amax = 0.0f;
    for (int i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f;
    const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
    int half[2] = {0, 0};
    for (int i = 0; i < BLOCK; ++i) {
      const int q = static_cast<int>(std::nearbyint(xb[i] * inverse));
      codes[b * BLOCK + i] = static_cast<int8_t>(q);
      half[i / 16] += q;
    }
    scales[b] = d;
    sums[b] = static_cast<float>(half[0] + half[1]);
    offsets[2 * b] = -128 * half[0];
    offsets[2 * b + 1] = -128 * half[1];
  }
}

// ---- AVX512-VNNI: a 64-byte group vector is 16 channels x 4 codes, one dpbusd per group and row -------------------

// A block's 8 group vectors as dpbusd's unsigned operand: the codes, signed ones plus 128 (the sign bit flipped).
template <Form F>
VNNI inline void load_vnni(const uint8_t* w, __m512i* groups) {
  if constexpr (F == Form::unsigned4) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(w + j * 64);
      groups[j] = _mm512_and_si512(v, low);
      groups[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
  } else {
    for (int j = 0; j < 8; ++j) {
      const __m512i v = _mm512_loadu_si512(w + j * 64);
      if constexpr (is_signed(F)) {
        groups[j] = _mm512_xor_si512(v, _mm512_set1_epi8(-128));  // code + 128
      } else {
        groups[j] = v;
      }
    }
  }
}


// R rows (1..ROWS) of one tile: out[r, 0:16] for rows row0 .. row0 + R - 1.
template <Form F, int R>
VNNI void tile_rows_vnni(const Tile& w, const Activations& a, int64_t row0, float* out, int64_t ldo) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m512i groups[8];
    load_vnni<F>(w.codes + b * block_bytes(F), groups);
    const float* scale = w.scales + b * block_scales(F);
    for (int r = 0; r < R; ++r) {
      const int64_t row = row0 + r;
      const int32_t* x = reinterpret_cast<const int32_t*>(a.codes + row * a.K + b * BLOCK);
      __m512i first, second;  // two chains: inputs 0-15, 16-31
      if constexpr (is_signed(F)) {  // sum (code + 128) q - 128 sum q
        first = _mm512_set1_epi32(a.offsets[row * 2 * a.blocks + 2 * b]);
        second = _mm512_set1_epi32(a.offsets[row * 2 * a.blocks + 2 * b + 1]);
      } else {
        first = second = _mm512_setzero_si512();
      }
      for (int j = 0; j < 4; ++j) {
        first = _mm512_dpbusd_epi32(first, groups[j], _mm512_set1_epi32(x[j]));
        second = _mm512_dpbusd_epi32(second, groups[j + 4], _mm512_set1_epi32(x[j + 4]));
      }
      __m512 t;
      if constexpr (F == Form::signed16) {
        t = _mm512_mul_ps(_mm512_cvtepi32_ps(first), _mm512_loadu_ps(scale));
        t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_cvtepi32_ps(second), _mm512_loadu_ps(scale + TILE)));
      } else {
        t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(first, second)), _mm512_loadu_ps(scale));
        if constexpr (!is_signed(F)) {
          const __m512 sum = _mm512_set1_ps(a.sums[row * a.blocks + b]);
          t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_loadu_ps(w.mins + b * TILE), sum));
        }
      }
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(t, _mm512_set1_ps(a.scales[row * a.blocks + b])));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (row0 + r) * ldo, acc[r]);
}

// ---- AVX2: each 64-byte group vector as two 32-byte halves of 8 channels x 4 codes ---------------------------------

// Half H (channels 8H .. 8H + 7) of a block's 8 group vectors: the codes as stored and, signed, their magnitudes
// (-128 -> 0x80: 128 as the unsigned operand).
template <Form F>
AVX2 inline void load_avx2(const uint8_t* w, int half, __m256i* groups, __m256i* magnitudes) {
  const uint8_t* p = w + half * 32;
  if constexpr (F == Form::unsigned4) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * 64));
      groups[j] = _mm256_and_si256(v, low);
      groups[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
  } else {
    for (int j = 0; j < 8; ++j) {
      groups[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * 64));
      if constexpr (is_signed(F)) magnitudes[j] = _mm256_abs_epi8(groups[j]);
    }
  }
}

// Pairwise products of group j's codes with the row's 4 activation codes x, in int16 lanes, signed codes as
// |code| * (q * sign(code)); exact, no saturation: unsigned codes <= 31, |signed code| <= 128, |q| <= 127.
template <Form F>
AVX2 inline __m256i products_avx2(const __m256i* groups, const __m256i* magnitudes, const int32_t* x, int j) {
  const __m256i q = _mm256_set1_epi32(x[j]);
  if constexpr (is_signed(F)) {
    return _mm256_maddubs_epi16(magnitudes[j], _mm256_sign_epi8(q, groups[j]));
  } else {
    return _mm256_maddubs_epi16(groups[j], q);
  }
}

// Dots over groups 4s .. 4s + 3 (inputs 16s .. 16s + 15) in int32 lanes, one per channel.
template <Form F>
AVX2 inline __m256i dot16_avx2(const __m256i* groups, const __m256i* magnitudes, const int32_t* x, int s) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (is_signed(F)) {  // products up to 32512 per int16 lane: widen each group
    __m256i dot = _mm256_madd_epi16(products_avx2<F>(groups, magnitudes, x, 4 * s), ones);
    for (int j = 4 * s + 1; j < 4 * s + 4; ++j) {
      dot = _mm256_add_epi32(dot, _mm256_madd_epi16(products_avx2<F>(groups, magnitudes, x, j), ones));
    }
    return dot;
  } else {  // up to 4 * 7874 per int16 lane: sum 4 groups, widen once
    __m256i sum = products_avx2<F>(groups, magnitudes, x, 4 * s);
    for (int j = 4 * s + 1; j < 4 * s + 4; ++j) sum = _mm256_add_epi16(sum, products_avx2<F>(groups, magnitudes, x, j));
    return _mm256_madd_epi16(sum, ones);
  }
}

// R rows (1..ROWS) of one tile, 8 channels at a time.
template <Form F, int R>
AVX2 void tile_rows_avx2(const Tile& w, const Activations& a, int64_t row0, float* out, int64_t ldo) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const float* scale = w.scales + b * block_scales(F);
    for (int h = 0; h < 2; ++h) {
      // a compiler barrier: without it GCC hoists the R rows' 8 activation broadcasts out of this loop (they do
      // not depend on the half) and spills them all to the stack, which is slower than broadcasting them again
      asm volatile("" ::: "memory");
      __m256i groups[8], magnitudes[8];
      load_avx2<F>(w.codes + b * block_bytes(F), h, groups, magnitudes);
      for (int r = 0; r < R; ++r) {
        const int64_t row = row0 + r;
        const int32_t* x = reinterpret_cast<const int32_t*>(a.codes + row * a.K + b * BLOCK);
        const __m256i first = dot16_avx2<F>(groups, magnitudes, x, 0),
                      second = dot16_avx2<F>(groups, magnitudes, x, 1);
        __m256 t;
        if constexpr (F == Form::signed16) {
          t = _mm256_mul_ps(_mm256_cvtepi32_ps(first), _mm256_loadu_ps(scale + 8 * h));
          t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_cvtepi32_ps(second), _mm256_loadu_ps(scale + TILE + 8 * h)));
        } else {
          t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(first, second)), _mm256_loadu_ps(scale + 8 * h));
          if constexpr (!is_signed(F)) {
            const __m256 sum = _mm256_set1_ps(a.sums[row * a.blocks + b]);
            t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_loadu_ps(w.mins + b * TILE + 8 * h), sum));
          }
        }
        acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(t, _mm256_set1_ps(a.scales[row * a.blocks + b])));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + (row0 + r) * ldo, acc[r][0]);
    _mm256_storeu_ps(out + (row0 + r) * ldo + 8, acc[r][1]);
  }
}

// ---- dispatch ----------------------------------------------------------------------------------------------------

template <Form F, Isa I, int R>
void tile_rows(const Tile& w, const Activations& a, int64_t row0, float* out, int64_t ldo) {
  if constexpr (I == Isa::vnni) {
    tile_rows_vnni<F, R>(w, a, row0, out, ldo);
  } else {
    tile_rows_avx2<F, R>(w, a, row0, out, ldo);
  }
}

// All M rows of one tile: ROWS at a time, then the rest (each row's arithmetic the same in every group size).
template <Form F, Isa I>
void tile(const Tile& w, const Activations& a, int64_t M, float* out, int64_t ldo) {
  int64_t row = 0;
  for (; row + ROWS <= M; row += ROWS) tile_rows<F, I, ROWS>(w, a, row, out, ldo);
  switch (M - row) {
    case 3: tile_rows<F, I, 3>(w, a, row, out, ldo); break;
    case 2: tile_rows<F, I, 2>(w, a, row, out, ldo); break;
    case 1: tile_rows<F, I, 1>(w, a, row, out, ldo); break;
    default: break;
  }
}

struct Weights {
  const uint8_t* codes;
  const float* scales;
  const float* mins;
  int64_t tiles;
};

template <Form F, Isa I>
void all_tiles(const Weights& w, const Activations& a, int64_t M, float* out) {
  const int64_t N = w.tiles * TILE;
  at::parallel_for(0, w.tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Tile tile_weights{w.codes + t * a.blocks * block_bytes(F), w.scales + t * a.blocks * block_scales(F),
                              w.mins == nullptr ? nullptr : w.mins + t * a.blocks * TILE};
      tile<F, I>(tile_weights, a, M, out + t * TILE, N);
    }
  });
}

template <Isa I>
void run(Form form, const Weights& w, const Activations& a, int64_t M, float* out) {
  switch (form) {
    case Form::unsigned4: all_tiles<Form::unsigned4, I>(w, a, M, out); break;
    case Form::unsigned8: all_tiles<Form::unsigned8, I>(w, a, M, out); break;
    case Form::signed32: all_tiles<Form::signed32, I>(w, a, M, out); break;
    case Form::signed16: all_tiles<Form::signed16, I>(w, a, M, out); break;
  }
}

Isa parse_isa(c10::string_view isa) {
  if (isa == "avx512vnni") {
    TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vnni"),
                "block_linear: this CPU lacks AVX512-VNNI");
    return Isa::vnni;
  }
  TORCH_CHECK(isa == "avx2", "block_linear: isa must be \"avx512vnni\" or \"avx2\", got \"", std::string(isa), "\"");
  TORCH_CHECK(__builtin_cpu_supports("avx2"), "block_linear: this CPU lacks AVX2");
  return Isa::avx2;
}

Form parse_form(bool has_mins, int64_t bits, int64_t sub) {
  if (has_mins) {
    TORCH_CHECK(sub == BLOCK && (bits == 4 || bits == 8), "block_linear: unsigned codes need bits 4 or 8 and sub 32");
    return bits == 4 ? Form::unsigned4 : Form::unsigned8;
  }
  TORCH_CHECK(bits == 8 && (sub == 16 || sub == 32), "block_linear: signed codes need bits 8 and sub 16 or 32");
  return sub == 16 ? Form::signed16 : Form::signed32;
}

}  // namespace

// x [M, K] float32; codes [N / 16, K / 32, 64 * bits] uint8; scales [N / 16, K / 32, 32 / sub, 16] float32;
// mins [N / 16, K / 32, 16] float32 (unsigned form) or None (signed); isa "avx512vnni" or "avx2" -> [M, N] float32.
torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                           const std::optional<torch::Tensor>& mins, int64_t bits, int64_t sub, c10::string_view isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: [M, K] contiguous float32");
  const Isa chosen = parse_isa(isa);
  const Form form = parse_form(mins.has_value(), bits, sub);
  const int64_t M = x.size(0), K = x.size(1), tiles = codes.size(0), blocks = codes.size(1);
  TORCH_CHECK(K == blocks * BLOCK, "block_linear: x has ", K, " inputs, the weights ", blocks * BLOCK);
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 3 &&
                  codes.size(2) == block_bytes(form),
              "block_linear: codes must be contiguous uint8 [N / 16, K / 32, ", block_bytes(form), "]");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() &&
                  scales.numel() == tiles * blocks * block_scales(form),
              "block_linear: scales must be contiguous float32 [N / 16, K / 32, 32 / sub, 16]");
  if (mins.has_value()) {
    TORCH_CHECK(mins->scalar_type() == torch::kFloat32 && mins->is_contiguous() &&
                    mins->numel() == tiles * blocks * TILE,
                "block_linear: mins must be contiguous float32 [N / 16, K / 32, 16]");
  }
  auto out = torch::empty({M, tiles * TILE}, x.options());
  if (M == 0 || tiles == 0) return out;
  // the rounded activations in one allocation (a decoding step makes some seventy calls): scales, sums and
  // offsets [M, blocks | blocks | 2 blocks] as 4-byte words, then the codes [M, K]
  auto buffer = torch::empty({M * (4 * blocks + K / 4)}, x.options().dtype(torch::kInt32));
  float* qscales = reinterpret_cast<float*>(buffer.data_ptr<int32_t>());
  float* qsums = qscales + M * blocks;
  int32_t* qoffsets = reinterpret_cast<int32_t*>(qsums + M * blocks);
  int8_t* qcodes = reinterpret_cast<int8_t*>(qoffsets + M * 2 * blocks);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {  // each row alone: the same codes on any thread
    for (int64_t row = begin; row < end; ++row) {
      quantize_row(xp + row * K, K, qcodes + row * K, qscales + row * blocks, qsums + row * blocks,
                   qoffsets + row * 2 * blocks);
    }
  });
  const Activations a{qcodes, qscales, qsums, qoffsets, K, blocks};
  const Weights w{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                  mins.has_value() ? mins->data_ptr<float>() : nullptr, tiles};
  if (chosen == Isa::vnni) {
    run<Isa::vnni>(form, w, a, M, out.data_ptr<float>());
  } else {
    run<Isa::avx2>(form, w, a, M, out.data_ptr<float>());
  }
  return out;
}
