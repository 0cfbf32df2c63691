// block_linear's AMX variant (included by block_linear.cpp inside its namespace): sixteen rows of a tile of 16 output
// channels in one tile multiply per block.
//
// A block's eight group vectors as stored are the B operand of AMX's int8 tile multiply (8 rows of 16 channels x 4
// codes; 4-bit codes unpacked from their nibbles first, a tile's blocks at once), sixteen rows of activation codes its
// A operand (16 rows x 32 bytes). One multiply per block gives the exact int32 dots of 16 rows x 16 channels: signed
// activations times signed codes (tdpbssd) or unsigned ones (tdpbsud), so no offsets. They are stored and scaled row
// by row in the VNNI variant's float32 steps and order: the same integers and the same roundings, so the same bits.
// Sub-16 forms take two multiplies of 16 inputs. Four blocks are in flight (sub-16 forms: two): while one block's
// dots are scaled, the next ones' multiplies run. Rows go in groups of 16; the rest, and forwards of fewer rows than
// AMX pays for (amx_min_rows), go to the VNNI variant.
#pragma once

#define AMX __attribute__((target("avx512f,avx512bw,avx512vnni,f16c,amx-tile,amx-int8")))
#define AMX_INLINE AMX inline __attribute__((always_inline))

constexpr int AMX_ROWS = 16;
constexpr int GROUP_BYTES = TILE * 4;  // 16 channels x 4 codes: one row of the B operand, one of the dots

struct alignas(64) TileConfig {  // ldtilecfg's 64 bytes, palette 1
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile registers. Sub-32 forms keep four blocks in flight: slot S's dots in tmm S, its activations in tmm 4 + S % 2,
// its weights in tmm 6 + S % 2. Sub-16 forms keep two: slot S's halves' dots in tmm 2 S and 2 S + 1, their
// activations in tmm 4-5, their weights in tmm 6-7.
template <Form F>
constexpr int amx_slots() { return two_scales(F) ? 2 : 4; }

template <Form F>
AMX void configure_amx() {
  TileConfig config;
  const auto set = [&](int t, int rows, int bytes) {
    config.rows[t] = rows;
    config.colsb[t] = bytes;
  };
  constexpr int inputs = two_scales(F) ? BLOCK / 2 : BLOCK;
  for (int t = 0; t < 4; ++t) set(t, AMX_ROWS, GROUP_BYTES);
  for (int t = 4; t < 6; ++t) set(t, AMX_ROWS, inputs);
  for (int t = 6; t < 8; ++t) set(t, inputs / 4, GROUP_BYTES);
  asm volatile("" : : "r"(&config) : "memory");  // ldtilecfg reads all 64 bytes: gcc's intrinsic declares only 8
  _tile_loadconfig(&config);
}

AMX void release_amx() { _tile_release(); }

// Tile numbers are immediates: each slot's instructions are spelt out by these.
#define AMX_DOT(F, C, A, B)                                  \
  do {                                                       \
    if constexpr (is_signed(F)) _tile_dpbssd(C, A, B); else _tile_dpbsud(C, A, B); \
  } while (0)
#define AMX_BLOCK(F, C, A, B, X, CODES, DOTS)   \
  do {                                          \
    _tile_zero(C);                              \
    _tile_loadd(A, X, K);                       \
    _tile_loadd(B, CODES, GROUP_BYTES);         \
    AMX_DOT(F, C, A, B);                        \
    _tile_stored(C, DOTS, GROUP_BYTES);         \
  } while (0)

// One block's multiply into slot S's dots: activation rows at X (stride K), the block's 8 group vectors at CODES.
template <Form F, int S>
AMX_INLINE void multiply_block(const uint8_t* codes, const int8_t* x, int64_t K, int32_t (*dots)[AMX_ROWS][TILE]) {
  if constexpr (two_scales(F)) {
    if constexpr (S == 0) {
      AMX_BLOCK(F, 0, 4, 6, x, codes, dots[0]);
      AMX_BLOCK(F, 1, 5, 7, x + BLOCK / 2, codes + 4 * GROUP_BYTES, dots[1]);
    } else {
      AMX_BLOCK(F, 2, 4, 6, x, codes, dots[0]);
      AMX_BLOCK(F, 3, 5, 7, x + BLOCK / 2, codes + 4 * GROUP_BYTES, dots[1]);
    }
  } else if constexpr (S == 0) {
    AMX_BLOCK(F, 0, 4, 6, x, codes, dots[0]);
  } else if constexpr (S == 1) {
    AMX_BLOCK(F, 1, 5, 7, x, codes, dots[0]);
  } else if constexpr (S == 2) {
    AMX_BLOCK(F, 2, 4, 6, x, codes, dots[0]);
  } else {
    AMX_BLOCK(F, 3, 5, 7, x, codes, dots[0]);
  }
}

// acc[r] += block B's dots of rows row0 .. row0 + 15 in the VNNI variant's float32 steps.
template <Form F, typename S>
AMX_INLINE void scale_block(const Tile<S>& w, const Activations& a, int64_t row0, int64_t b,
                            int32_t (*dots)[AMX_ROWS][TILE], __m512* acc) {
  const S* scale = w.scales + b * block_scales(F);
  const __m512 scale0 = load16(scale);
  __m512 mins = _mm512_setzero_ps();
  if constexpr (!is_signed(F)) mins = load16(w.mins + b * TILE);
  for (int r = 0; r < AMX_ROWS; ++r) {
    const int64_t row = row0 + r;
    __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[0][r])), scale0);
    if constexpr (two_scales(F)) {
      t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[1][r])), load16(scale + TILE)));
    } else if constexpr (!is_signed(F)) {
      const __m512 sum = _mm512_set1_ps(a.sums[row * a.blocks + b]);
      t = _mm512_add_ps(t, _mm512_mul_ps(mins, sum));
    }
    acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(t, _mm512_set1_ps(a.scales[row * a.blocks + b])));
  }
}

// Slot SLOT's next block, b, where there is one.
template <Form F, int SLOT>
AMX_INLINE void multiply_next(const uint8_t* codes, const int8_t* x, const Activations& a, int64_t b,
                              int32_t (*dots)[2][AMX_ROWS][TILE]) {
  if (b < a.blocks) multiply_block<F, SLOT>(codes + b * 8 * GROUP_BYTES, x + b * BLOCK, a.K, dots[SLOT]);
}

// Block b (in slot SLOT, its multiply done) scaled into acc, then the slot's next block multiplied.
template <Form F, int SLOT, typename S>
AMX_INLINE void step(const Tile<S>& w, const uint8_t* codes, const Activations& a, int64_t row0, int64_t b,
                     int32_t (*dots)[2][AMX_ROWS][TILE], __m512* acc) {
  if (b >= a.blocks) return;
  scale_block<F>(w, a, row0, b, dots[SLOT], acc);
  multiply_next<F, SLOT>(codes, a.codes + row0 * a.K, a, b + amx_slots<F>(), dots);
}

// 16 rows of one tile from row0, its blocks' codes at CODES as the B operand (8 x 64 bytes a block); the tile
// configuration is loaded (all_tiles). Block b's dots are scaled while the next slots - 1 blocks multiply.
template <Form F, typename S>
AMX void tile_rows_amx(const Tile<S>& w, const uint8_t* codes, const Activations& a, int64_t row0, float* out,
                       int64_t ldo) {
  constexpr int slots = amx_slots<F>();
  alignas(64) int32_t dots[slots][2][AMX_ROWS][TILE];  // [slot][half]
  __m512 acc[AMX_ROWS];
  for (int r = 0; r < AMX_ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* x = a.codes + row0 * a.K;
  multiply_next<F, 0>(codes, x, a, 0, dots);
  multiply_next<F, 1>(codes, x, a, 1, dots);
  if constexpr (slots == 4) {
    multiply_next<F, 2>(codes, x, a, 2, dots);
    multiply_next<F, 3>(codes, x, a, 3, dots);
  }
  for (int64_t b = 0; b < a.blocks; b += slots) {
    step<F, 0>(w, codes, a, row0, b, dots, acc);
    step<F, 1>(w, codes, a, row0, b + 1, dots, acc);
    if constexpr (slots == 4) {
      step<F, 2>(w, codes, a, row0, b + 2, dots, acc);
      step<F, 3>(w, codes, a, row0, b + 3, dots, acc);
    }
  }
  for (int r = 0; r < AMX_ROWS; ++r) _mm512_storeu_ps(out + (row0 + r) * ldo, acc[r]);
}

// A tile's 4-bit codes as bytes, block by block in group order, as the VNNI variant unpacks them.
AMX void unpack_tile(const uint8_t* codes, int64_t blocks, uint8_t* unpacked) {
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i groups[8];
    load_vnni<Form::unsigned4>(codes + b * block_bytes(Form::unsigned4), groups);
    for (int j = 0; j < 8; ++j) _mm512_storeu_si512(unpacked + (b * 8 + j) * GROUP_BYTES, groups[j]);
  }
  asm volatile("" : : "r"(unpacked) : "memory");  // the tile loads read them: no store may sink past
}

// The fewest rows AMX pays for: 16 for signed codes; 32 for unsigned ones, whose scaling takes half as many float
// steps again (the minimums) and whose 4-bit codes are unpacked per tile, so that 16 rows cost no less than on VNNI.
template <Form F>
constexpr int64_t amx_min_rows() { return is_signed(F) ? AMX_ROWS : 2 * AMX_ROWS; }

// The rows of one tile AMX takes, 16 at a time; returns how many (the rest go to the VNNI variant).
template <Form F, typename S>
int64_t tile_amx(const Tile<S>& w, const Activations& a, int64_t M, float* out, int64_t ldo) {
  if (M < amx_min_rows<F>()) return 0;
  const uint8_t* codes = w.codes;
  if constexpr (F == Form::unsigned4) {
    thread_local std::vector<uint8_t> unpacked;
    unpacked.resize(a.blocks * 8 * GROUP_BYTES);
    unpack_tile(w.codes, a.blocks, unpacked.data());
    codes = unpacked.data();
  }
  int64_t row = 0;
  for (; row + AMX_ROWS <= M; row += AMX_ROWS) tile_rows_amx<F>(w, codes, a, row, out, ldo);
  return row;
}

// Whether this process may run AMX: the CPU has AMX-INT8 and Linux grants the tile data state (asked once).
bool amx_permitted() {
  static const bool permitted = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = edx & (1u << 24), int8 = edx & (1u << 25);
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return tile && int8 && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return permitted;
}
