// Linear layers with GGUF-style block-quantised weights (engine/model/blocks.py) times activations rounded to 8 bits
// per block of 32, multiplied in integers: the arithmetic llama.cpp runs a GGUF with, for three instruction sets chosen
// at run time (AMX, AVX512-VNNI, AVX2), each output row's bits the same whatever the other rows and whichever set
// computes it, so a token's logits do not depend on the forward that computes it (engine/model/attention_layout.py).
//
// Weights (packed by engine/model/block_linear.py), two forms:
// - unsigned: w[n, k] = scale[n, b] * code[n, k] + min[n, b], b = k / 32, codes 0..15 (bits 4) or 0..31 (bits 8);
// - signed: w[n, k] = scale[n, k / sub] * code[n, k], codes -128..127, sub 32 or 16 (two scales per block of 32);
//   narrow signed codes (-32..31: Q5_0, Q6_K) are stored the same way and flagged bits 6.
// Layout per tile of 16 output channels and block of 32 inputs: 8 groups of 4 inputs, each a 64-byte vector of 16
// channels x 4 codes (4-bit: group j in the low, group j + 4 in the high nibbles of the same 64 bytes); AVX2 reads
// each vector as two 32-byte halves (channels 0-7, 8-15). Per tile and block: scales [32 / sub][16], mins [16], float32
// or, where each is exactly a half, float16 (converted back to the same floats as they are read).
// Activations: per row and block, d = max|x| / 127, q = nearbyint(x * (1 / d)) as signed bytes, and their sum.
// Per row, channel and block, in order, in float32 without fused multiply-adds (-ffp-contract=off), so a reference
// reproduces every rounding and both instruction sets give the same bits:
//   unsigned:      t = float(sum code q) * scale; t = t + min * float(sum q); acc = acc + t * d
//   signed sub 32: t = float(sum code q) * scale; acc = acc + t * d
//   signed sub 16: t = float(dot0) * scale0; t = t + float(dot1) * scale1; acc = acc + t * d
// The dots are exact int32 sums whichever way they are formed. Unsigned codes are the instructions' unsigned operand
// as they are. Signed codes: VNNI multiplies code + 128 (a byte 0..255) and starts the sum at -128 * sum q (per 16
// inputs, from the activations: no weight-side buffer); AVX2, whose int16 products would saturate at 255 * 127,
// uses the sign trick: sum |code| * (q * sign(code)), |code| <= 128 as an unsigned byte. Narrow codes (bits 6) on
// AVX2 instead take code + 32 (0..63) as the unsigned operand, two groups' products summed in int16 (at most
// 4 * 63 * 127) before widening, the sum started at -32 * sum q: half the instructions per weight and row.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "ops.h"
#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <atomic>
#include <algorithm>
#include <cstdint>
#include <vector>

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define AVX2 __attribute__((target("avx2,f16c")))

namespace {

constexpr int TILE = 16;   // output channels per tile: one AVX-512 vector of floats, two AVX2 vectors
constexpr int BLOCK = 32;  // inputs per quantisation block
constexpr int ROWS = 4;    // activation rows that share one unpacking of a tile's weights

enum class Form { unsigned4, unsigned8, signed32, signed16, narrow32, narrow16 };
enum class Isa { avx2, vnni, amx };

constexpr bool is_narrow(Form f) { return f == Form::narrow32 || f == Form::narrow16; }
constexpr bool is_signed(Form f) { return f == Form::signed32 || f == Form::signed16 || is_narrow(f); }
constexpr bool two_scales(Form f) { return f == Form::signed16 || f == Form::narrow16; }  // a scale per 16 inputs
constexpr int block_bytes(Form f) { return f == Form::unsigned4 ? BLOCK * TILE / 2 : BLOCK * TILE; }
constexpr int block_scales(Form f) { return two_scales(f) ? 2 * TILE : TILE; }
constexpr int NARROW_OFFSET = 32;  // narrow codes + 32 lie in 0..63
constexpr int NARROW_SHIFT = 2;  // -128 * sum q >> 2 = -32 * sum q, exactly (a multiple of 128)

struct Activations {
  const int8_t* codes;  // [M, K] q
  const float* scales;  // [M, K / 32] d
  const float* sums;    // [M, K / 32] float(sum q), exact
  const int32_t* offsets;  // [M, K / 16] -128 * sum q over each 16 inputs: where VNNI's signed dots start
  int64_t K;
  int64_t blocks;
};

// S: how scales and minimums are stored, float or IEEE half (uint16_t) where each is exactly a half, as the scales a
// GGUF stores as halves are: half the bytes, converted back to the same float in the kernel.
template <typename S>
struct Tile {  // one tile's blocks
  const uint8_t* codes;  // [blocks, block_bytes]
  const S* scales;   // [blocks, 32 / sub, 16]
  const S* mins;     // [blocks, 16] (unsigned form)
};

VNNI inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
VNNI inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AVX2 inline __m256 load8(const uint16_t* p) {  // F16C: every CPU with AVX2 has it
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One row's activations per block of 32, as the header says: d = max|x| / 127, q = nearbyint(x * (1 / d)) (converted in
// the default rounding mode, to nearest even, as nearbyint rounds), the codes' sum and its halves' offsets. Eight
// floats at a time (every CPU the kernels run on has AVX2): the maximum and the integer sums are exact in any order.
AVX2 void quantize_row(const float* x, int64_t K, int8_t* codes, float* scales, float* sums, int32_t* offsets) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs interleave 128-bit lanes: undo it
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    const float* xb = x + b * BLOCK;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                             _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xB1));
    const float d = _mm256_cvtss_f32(m) / 127.0f;
    const __m256 inverse = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * BLOCK), _mm256_permutevar8x32_epi32(bytes, order));
    int half[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i s = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      half[h] = _mm_cvtsi128_si32(t);
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
template <Form F, int R, typename S>
VNNI void tile_rows_vnni(const Tile<S>& w, const Activations& a, int64_t row0, float* out, int64_t ldo) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m512i groups[8];
    load_vnni<F>(w.codes + b * block_bytes(F), groups);
    const S* scale = w.scales + b * block_scales(F);
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
      if constexpr (two_scales(F)) {
        t = _mm512_mul_ps(_mm512_cvtepi32_ps(first), load16(scale));
        t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_cvtepi32_ps(second), load16(scale + TILE)));
      } else {
        t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(first, second)), load16(scale));
        if constexpr (!is_signed(F)) {
          const __m512 sum = _mm512_set1_ps(a.sums[row * a.blocks + b]);
          t = _mm512_add_ps(t, _mm512_mul_ps(load16(w.mins + b * TILE), sum));
        }
      }
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(t, _mm512_set1_ps(a.scales[row * a.blocks + b])));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (row0 + r) * ldo, acc[r]);
}

// ---- AVX2: each 64-byte group vector as two 32-byte halves of 8 channels x 4 codes ---------------------------------
// A tile is multiplied half by half (channels 0-7 over every block, then 8-15): with the accumulators of one half,
// R rows' dots and the few group vectors in use at once, the sixteen ymm registers hold the whole inner loop.

// Group j (inputs 4j .. 4j + 3) of a block's half P, codes as stored, 4-bit ones taken from their nibbles.
template <Form F>
AVX2 inline __m256i group_avx2(const uint8_t* p, int j) {
  if constexpr (F == Form::unsigned4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (j % 4) * 64));
    return _mm256_and_si256(j < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * 64));
  }
}

AVX2 inline __m256i broadcast(const int32_t* x, int j) { return _mm256_set1_epi32(x[j]); }

// dot[r] += the products of groups 4s .. 4s + 3 (inputs 16s .. 16s + 15) with row r's activation codes X[r], in
// int32 lanes, one per channel. Exact: an int16 lane holds the pairs of products of four groups of unsigned codes
// (<= 4 * 2 * 31 * 127), of two groups of narrow codes + 32 (<= 2 * 2 * 63 * 127) or of one group of signed
// magnitudes (<= 2 * 128 * 127).
template <Form F, int R>
AVX2 inline void add_dot16_avx2(const uint8_t* p, const int32_t* const* x, int s, __m256i* dot) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (F == Form::unsigned4 || F == Form::unsigned8) {
    __m256i v[4];
    #pragma GCC unroll 8
    for (int i = 0; i < 4; ++i) v[i] = group_avx2<F>(p, 4 * s + i);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256i sum = _mm256_maddubs_epi16(v[0], broadcast(x[r], 4 * s));
      #pragma GCC unroll 8
      for (int i = 1; i < 4; ++i) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(v[i], broadcast(x[r], 4 * s + i)));
      dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(sum, ones));
    }
  } else if constexpr (is_narrow(F)) {  // code + 32 as the unsigned operand
    const __m256i offset = _mm256_set1_epi8(NARROW_OFFSET);
    #pragma GCC unroll 8
    for (int j = 4 * s; j < 4 * s + 4; j += 2) {
      const __m256i v0 = _mm256_add_epi8(group_avx2<F>(p, j), offset),
                    v1 = _mm256_add_epi8(group_avx2<F>(p, j + 1), offset);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(v0, broadcast(x[r], j)),
                                              _mm256_maddubs_epi16(v1, broadcast(x[r], j + 1)));
        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pair, ones));
      }
    }
  } else {  // the sign trick: |code| * (q * sign(code)), -128 -> 0x80: 128 as the unsigned operand
    #pragma GCC unroll 8
    for (int j = 4 * s; j < 4 * s + 4; ++j) {
      const __m256i v = group_avx2<F>(p, j), magnitude = _mm256_abs_epi8(v);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i products = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(broadcast(x[r], j), v));
        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(products, ones));
      }
    }
  }
}

// R rows (1..ROWS) of one tile.
template <Form F, int R, typename S>
AVX2 void tile_rows_avx2(const Tile<S>& w, const Activations& a, int64_t row0, float* out, int64_t ldo) {
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* p = w.codes + b * block_bytes(F) + h * 32;
      const S* scale = w.scales + b * block_scales(F) + 8 * h;
      const int32_t* x[R];
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) x[r] = reinterpret_cast<const int32_t*>(a.codes + (row0 + r) * a.K + b * BLOCK);
      __m256i dot[R];
      __m256 t[R];
      #pragma GCC unroll 8
      for (int s = 0; s < 2; ++s) {
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          // narrow codes' sum starts at -32 * sum q over these 16 inputs (a quarter of VNNI's -128 * sum q)
          const __m256i start = is_narrow(F)
              ? _mm256_set1_epi32(a.offsets[(row0 + r) * 2 * a.blocks + 2 * b + s] >> NARROW_SHIFT)
              : _mm256_setzero_si256();
          dot[r] = s == 0 || two_scales(F) ? start : _mm256_add_epi32(dot[r], start);
        }
        add_dot16_avx2<F, R>(p, x, s, dot);
        if constexpr (two_scales(F)) {  // t = dot0 * scale0, then t + dot1 * scale1
          #pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r]), load8(scale + TILE * s));
            t[r] = s == 0 ? part : _mm256_add_ps(t[r], part);
          }
        }
      }
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t row = row0 + r;
        if constexpr (!two_scales(F)) {
          t[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r]), load8(scale));
          if constexpr (!is_signed(F)) {
            const __m256 sum = _mm256_set1_ps(a.sums[row * a.blocks + b]);
            t[r] = _mm256_add_ps(t[r], _mm256_mul_ps(load8(w.mins + b * TILE + 8 * h), sum));
          }
        }
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(t[r], _mm256_set1_ps(a.scales[row * a.blocks + b])));
      }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + (row0 + r) * ldo + 8 * h, acc[r]);
  }
}

// ---- AMX: sixteen rows of a tile in one multiply per block (engine/model/csrc/block_linear_amx.h) ---------------
#include "block_linear_amx.h"

// ---- dispatch ----------------------------------------------------------------------------------------------------

template <Form F, Isa I, int R, typename S>
void tile_rows(const Tile<S>& w, const Activations& a, int64_t row0, float* out, int64_t ldo) {
  if constexpr (I == Isa::avx2) {
    tile_rows_avx2<F, R>(w, a, row0, out, ldo);
  } else {  // AMX's rows left over too
    tile_rows_vnni<F, R>(w, a, row0, out, ldo);
  }
}

// All M rows of one tile: with AMX 16 at a time; then ROWS at a time, then the rest (each row's arithmetic the
// same in every group size and variant).
template <Form F, Isa I, typename S>
void tile(const Tile<S>& w, const Activations& a, int64_t M, float* out, int64_t ldo) {
  int64_t row = 0;
  if constexpr (I == Isa::amx) row = tile_amx<F>(w, a, M, out, ldo);
  for (; row + ROWS <= M; row += ROWS) tile_rows<F, I, ROWS>(w, a, row, out, ldo);
  switch (M - row) {
    case 3: tile_rows<F, I, 3>(w, a, row, out, ldo); break;
    case 2: tile_rows<F, I, 2>(w, a, row, out, ldo); break;
    case 1: tile_rows<F, I, 1>(w, a, row, out, ldo); break;
    default: break;
  }
}

template <typename S>
struct Weights {
  const uint8_t* codes;
  const S* scales;
  const S* mins;
  int64_t tiles;
};

template <Form F, Isa I, typename S>
void tile_range(const Weights<S>& w, const Activations& a, int64_t M, float* out, int64_t begin, int64_t end) {
  const int64_t N = w.tiles * TILE;
  for (int64_t t = begin; t < end; ++t) {
    const Tile<S> tile_weights{w.codes + t * a.blocks * block_bytes(F), w.scales + t * a.blocks * block_scales(F),
                               w.mins == nullptr ? nullptr : w.mins + t * a.blocks * TILE};
    tile<F, I>(tile_weights, a, M, out + t * TILE, N);
  }
}

// The tiles in chunks that each thread takes as it comes free (eight per thread): on a machine whose cores run at
// different speeds (another process on one of them) a fixed split leaves the faster ones waiting at the end.
template <Form F, Isa I, typename S>
void all_tiles(const Weights<S>& w, const Activations& a, int64_t M, float* out) {
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, (w.tiles + 8 * threads - 1) / (8 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    if constexpr (I == Isa::amx) configure_amx<F>();  // tile configuration is per thread
    for (int64_t begin; (begin = next.fetch_add(chunk)) < w.tiles;) {
      tile_range<F, I>(w, a, M, out, begin, std::min(begin + chunk, w.tiles));
    }
    if constexpr (I == Isa::amx) release_amx();
  });
}

// VNNI and AMX multiply narrow codes as any signed ones (code + 128 costs VNNI nothing more).
template <Isa I, typename S>
void run(Form form, const Weights<S>& w, const Activations& a, int64_t M, float* out) {
  constexpr bool avx2 = I == Isa::avx2;
  switch (form) {
    case Form::unsigned4: all_tiles<Form::unsigned4, I>(w, a, M, out); break;
    case Form::unsigned8: all_tiles<Form::unsigned8, I>(w, a, M, out); break;
    case Form::signed32: all_tiles<Form::signed32, I>(w, a, M, out); break;
    case Form::signed16: all_tiles<Form::signed16, I>(w, a, M, out); break;
    case Form::narrow32: all_tiles<avx2 ? Form::narrow32 : Form::signed32, I>(w, a, M, out); break;
    case Form::narrow16: all_tiles<avx2 ? Form::narrow16 : Form::signed16, I>(w, a, M, out); break;
  }
}

template <typename S>
void run_with(Isa isa, Form form, const Weights<S>& w, const Activations& a, int64_t M, torch::Tensor& out) {
  if (isa == Isa::amx) {
    run<Isa::amx>(form, w, a, M, out.data_ptr<float>());
  } else if (isa == Isa::vnni) {
    run<Isa::vnni>(form, w, a, M, out.data_ptr<float>());
  } else {
    run<Isa::avx2>(form, w, a, M, out.data_ptr<float>());
  }
}

Isa parse_isa(c10::string_view isa) {
  if (isa == "amx") {
    TORCH_CHECK(has_vnni() && amx_permitted(), "block_linear: this CPU (or its kernel) does not run AMX-INT8");
    return Isa::amx;
  }
  if (isa == "avx512vnni") {
    TORCH_CHECK(has_vnni(), "block_linear: this CPU lacks AVX512-VNNI");
    return Isa::vnni;
  }
  TORCH_CHECK(isa == "avx2", "block_linear: isa must be \"amx\", \"avx512vnni\" or \"avx2\", got \"",
              std::string(isa), "\"");
  TORCH_CHECK(__builtin_cpu_supports("avx2"), "block_linear: this CPU lacks AVX2");
  return Isa::avx2;
}

Form parse_form(bool has_mins, int64_t bits, int64_t sub) {
  if (has_mins) {
    TORCH_CHECK(sub == BLOCK && (bits == 4 || bits == 8), "block_linear: unsigned codes need bits 4 or 8 and sub 32");
    return bits == 4 ? Form::unsigned4 : Form::unsigned8;
  }
  TORCH_CHECK((bits == 8 || bits == 6) && (sub == 16 || sub == 32),
              "block_linear: signed codes need bits 8 (-128..127) or 6 (-32..31) and sub 16 or 32");
  if (bits == 6) return sub == 16 ? Form::narrow16 : Form::narrow32;
  return sub == 16 ? Form::signed16 : Form::signed32;
}

}  // namespace

bool has_amx() { return has_vnni() && amx_permitted(); }

// x [M, K] float32; codes [N / 16, K / 32, 256 (bits 4) or 512] uint8; scales [N / 16, K / 32, 32 / sub, 16] float32
// or float16; mins [N / 16, K / 32, 16] of the scales' dtype (unsigned form) or None (signed); isa "amx",
// "avx512vnni" or "avx2" -> [M, N] float32.
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
  const bool half = scales.scalar_type() == torch::kHalf;
  TORCH_CHECK((half || scales.scalar_type() == torch::kFloat32) && scales.is_contiguous() &&
                  scales.numel() == tiles * blocks * block_scales(form),
              "block_linear: scales must be contiguous float32 or float16 [N / 16, K / 32, 32 / sub, 16]");
  if (mins.has_value()) {
    TORCH_CHECK(mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() &&
                    mins->numel() == tiles * blocks * TILE,
                "block_linear: mins must be contiguous [N / 16, K / 32, 16] of the scales' dtype");
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
  if (half) {
    const auto as_half = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
    run_with(chosen, form, Weights<uint16_t>{codes.data_ptr<uint8_t>(), as_half(scales),
                                             mins.has_value() ? as_half(*mins) : nullptr, tiles}, a, M, out);
  } else {
    run_with(chosen, form, Weights<float>{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                          mins.has_value() ? mins->data_ptr<float>() : nullptr, tiles}, a, M, out);
  }
  return out;
}
