/* The GGUF's own blocks as projection weights (included by rowgemm.c after its float32 tiles,
   which the many-row path below reuses; rowgemm.py compiles the library with -ffp-contract=off).

   Q4_1: per 32 weights of an output row, an fp16 scale d, an fp16 minimum m and 32 four-bit q,
   the weight fl(fl(d q) + m). Q8_0: per 32 weights an fp16 scale d and 32 signed bytes q, the
   weight fl(d q). These are the values models/gguf_llama.py's float32 conversion holds (gguf's
   numpy dequantizer computes them in float32, a multiply then an add): without contraction the
   compiler cannot fuse the multiply and the add into one FMA, which rounds once and would give
   another weight.

   The layout (rowgemm.py's pack_q4_1 / pack_q8_0 make it at load): the float32 kernel's panels
   of 8 output columns, each a run of blocks along k. A Q4_1 block of a panel is 160 bytes: the 8
   columns' d (fp16), their 8 m, then 16 groups of 8 bytes, group p holding column c's q for
   k = 2p in the low nibble of byte c and for k = 2p + 1 in the high one. A Q8_0 block is 272
   bytes: the 8 d, then 32 groups of 8 bytes, group k holding column c's q at byte c.

   One FMA makes a Q4_1 weight, and it is still the conversion's two roundings: d is an fp16
   number (an 11-bit significand) and q < 16 (4 bits), so d q needs at most 15 significant bits
   and fl(d q) = d q exactly; fl(fl(d q) + m) is then the one rounding of d q + m, which is what
   the FMA computes. (Q8_0's d q, |q| <= 128, is exact for the same reason: its one multiply is
   the conversion's.) tests/unit/engine/test_quant_blocks.py holds every value to the conversion's.

   Every output accumulates x[k] w[k] over k = 0, 1, 2, ... in one FMA chain from zero, as the
   float32 tiles do over float32 panels: the same weights in the same order, so the same bits as
   the float32 conversion on the float32 kernel, whatever the rows beside it (verification stays
   bit-identical to decoding one token at a time). Up to QROWS rows, a block is widened in
   registers once per tile of rows; a few more (a verification of K = 3..7 drafts) widen each block
   once into an L1 buffer and run float32 tiles over it (blocked_range); many (a prefill) widen a
   chunk of panels into L2 and run the float32 kernel's own plan over it (scratch_range). The
   float32 weights are never resident whole: at most one chunk of them, per thread. */
#ifndef QUANT_BLOCKS_H
#define QUANT_BLOCKS_H

#define Q41_BLOCK 160
#define Q80_BLOCK 272
#define QROWS 3 /* rows widened in registers; more take blocked_range, from SCRATCH_ROWS scratch_range */
/* From this many rows a chunk of panels widened whole into L2 and the float32 tiles over it beat
   widening a block at a time into L1 (AMD EPYC, AVX2: at 12 rows 1.33 against 1.8 cycles per 16
   weights a row, at 150 rows 1.15 against 1.6, the float32 kernel's own 1.1-1.2; at 4-6 rows the
   other way round: 1.8 against 2.3-3.3). */
#define SCRATCH_ROWS 9

static inline __m256 widen_ph(const uint16_t* h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h)); }

/* MR rows x NB panels of Q4_1: per block the 8 columns' d and m widened once, then per pair of k
   one load of 8 bytes; the weights fl(fl(d q) + m) of a panel are made once for all MR rows. */
#define Q41_TILE(MR, NB) \
static void q41tile_##MR##_##NB(const float* x, int64_t K, const uint8_t* p, int64_t PS, float* y, int64_t N) { \
  __m256 acc[MR][NB]; \
  const __m256i low = _mm256_set1_epi32(0xF); \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_setzero_ps(); \
  for (int64_t k0 = 0; k0 < K; k0 += 32) { \
    __m256 d[NB], mn[NB]; \
    const uint8_t* blk[NB]; \
    UNROLL for (int b = 0; b < NB; ++b) { \
      blk[b] = p + b * PS + (k0 / 32) * Q41_BLOCK; \
      if (PREFETCH_BYTES) { /* a block is 2.5 cache lines: ask for 3 */ \
        _mm_prefetch((const char*)blk[b] + PREFETCH_BYTES, _MM_HINT_T1); \
        _mm_prefetch((const char*)blk[b] + PREFETCH_BYTES + 64, _MM_HINT_T1); \
        _mm_prefetch((const char*)blk[b] + PREFETCH_BYTES + 128, _MM_HINT_T1); \
      } \
      d[b] = widen_ph((const uint16_t*)blk[b]); \
      mn[b] = widen_ph((const uint16_t*)blk[b] + 8); \
    } \
    _Pragma("GCC unroll 4") for (int64_t q = 0; q < 16; ++q) { \
      UNROLL for (int b = 0; b < NB; ++b) { \
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(blk[b] + 32 + q * 8))); \
        __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), d[b], mn[b]); \
        __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d[b], mn[b]); \
        UNROLL for (int m = 0; m < MR; ++m) { \
          acc[m][b] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * K + k0 + 2 * q), lo, acc[m][b]); \
          acc[m][b] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * K + k0 + 2 * q + 1), hi, acc[m][b]); \
        } \
      } \
    } \
  } \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) \
    _mm256_storeu_ps(y + m * N + b * 8, acc[m][b]); \
}

/* The same for Q8_0: per k one load of 8 signed bytes, the weights fl(d q). */
#define Q80_TILE(MR, NB) \
static void q80tile_##MR##_##NB(const float* x, int64_t K, const uint8_t* p, int64_t PS, float* y, int64_t N) { \
  __m256 acc[MR][NB]; \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_setzero_ps(); \
  for (int64_t k0 = 0; k0 < K; k0 += 32) { \
    __m256 d[NB]; \
    const uint8_t* blk[NB]; \
    UNROLL for (int b = 0; b < NB; ++b) { \
      blk[b] = p + b * PS + (k0 / 32) * Q80_BLOCK; \
      if (PREFETCH_BYTES) /* a block is 4.25 cache lines: ask for 5 */ \
        for (int l = 0; l < 5; ++l) _mm_prefetch((const char*)blk[b] + PREFETCH_BYTES + 64 * l, _MM_HINT_T1); \
      d[b] = widen_ph((const uint16_t*)blk[b]); \
    } \
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < 32; ++k) { \
      UNROLL for (int b = 0; b < NB; ++b) { \
        __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk[b] + 16 + k * 8))); \
        __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(v), d[b]); \
        UNROLL for (int m = 0; m < MR; ++m) \
          acc[m][b] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * K + k0 + k), w, acc[m][b]); \
      } \
    } \
  } \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) \
    _mm256_storeu_ps(y + m * N + b * 8, acc[m][b]); \
}

Q41_TILE(1, 4) Q41_TILE(2, 3) Q41_TILE(3, 2) Q41_TILE(1, 1) Q41_TILE(2, 1) Q41_TILE(3, 1)
Q80_TILE(1, 4) Q80_TILE(2, 3) Q80_TILE(3, 2) Q80_TILE(1, 1) Q80_TILE(2, 1) Q80_TILE(3, 1)

#define QRUN(KIND, MR, NB) do { \
  int64_t b = lo; \
  for (; b + NB <= hi; b += NB) KIND##tile_##MR##_##NB(x, K, p + b * PS, PS, y + b * 8, N); \
  for (; b < hi; ++b) KIND##tile_##MR##_1(x, K, p + b * PS, PS, y + b * 8, N); } while (0)

/* Many rows (a verification of 4 or more tokens, a prefill): per group of up to 3 panels and per
   block of 32 k, the group's weights are widened once into an L1 buffer (3 KB), then every tile
   of up to 4 rows runs the block's 32 FMAs a column on it, its sums carried in y between blocks
   (a float32 stored and loaded back is the same float32, so the chain is the one the float32
   tiles run). The widening is paid once per weight whatever the rows; 12 independent chains keep
   both FMA pipes busy. */
#define BTILE(MR, NB) \
static void btile_##MR##_##NB(const float* x, int64_t K, int64_t k0, const float* w, float* y, int64_t N, \
                              int first) { \
  __m256 acc[MR][NB]; \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) \
    acc[m][b] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m * N + b * 8); \
  _Pragma("GCC unroll 4") for (int64_t k = 0; k < 32; ++k) { \
    __m256 wk[NB]; \
    UNROLL for (int b = 0; b < NB; ++b) wk[b] = _mm256_load_ps(w + (b * 32 + k) * 8); \
    UNROLL for (int m = 0; m < MR; ++m) { \
      __m256 xv = _mm256_broadcast_ss(x + m * K + k0 + k); \
      UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_fmadd_ps(xv, wk[b], acc[m][b]); \
    } \
  } \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) \
    _mm256_storeu_ps(y + m * N + b * 8, acc[m][b]); \
}
BTILE(4, 3) BTILE(3, 3) BTILE(2, 3) BTILE(1, 3) BTILE(4, 1) BTILE(1, 1)

static inline void widen_q41_block(const uint8_t* blk, float* out) {
  const __m256i low = _mm256_set1_epi32(0xF);
  __m256 d = widen_ph((const uint16_t*)blk), mn = widen_ph((const uint16_t*)blk + 8);
  for (int64_t q = 0; q < 16; ++q) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 32 + q * 8)));
    _mm256_store_ps(out + 2 * q * 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), d, mn));
    _mm256_store_ps(out + (2 * q + 1) * 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d, mn));
  }
}

static inline void widen_q80_block(const uint8_t* blk, float* out) {
  __m256 d = widen_ph((const uint16_t*)blk);
  for (int64_t k = 0; k < 32; ++k) {
    __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 16 + k * 8)));
    _mm256_store_ps(out + k * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(v), d));
  }
}

#define BRUN(NB) do { \
  int64_t m = 0; \
  for (; m + 4 <= M; m += 4) btile_4_##NB(x + m * K, K, k0, buf, y + m * N + g * 8, N, k0 == 0); \
  switch (M - m) { \
    case 3: btile_3_##NB(x + m * K, K, k0, buf, y + m * N + g * 8, N, k0 == 0); break; \
    case 2: btile_2_##NB(x + m * K, K, k0, buf, y + m * N + g * 8, N, k0 == 0); break; \
    case 1: btile_1_##NB(x + m * K, K, k0, buf, y + m * N + g * 8, N, k0 == 0); break; \
    default: break; \
  } } while (0)

static void blocked_range(const float* x, const uint8_t* p, int64_t kind, float* y, int64_t M, int64_t K,
                          int64_t PS, int64_t N, int64_t lo, int64_t hi) {
  float buf[3 * 32 * 8] __attribute__((aligned(32)));
  int64_t bytes = kind == 3 ? Q41_BLOCK : Q80_BLOCK;
  for (int64_t g = lo; g < hi; g += 3) {
    int64_t nb = hi - g < 3 ? hi - g : 3;
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = p + (g + b) * PS + (k0 / 32) * bytes;
        if (kind == 3) widen_q41_block(blk, buf + b * 32 * 8);
        else widen_q80_block(blk, buf + b * 32 * 8);
      }
      if (nb == 3) BRUN(3);
      else for (int64_t b = 0; b < nb; ++b) {
        /* a group of 1-2 panels: one panel at a time (the buffer's panel b, output panel g + b) */
        const float* one = buf + b * 32 * 8;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) btile_4_1(x + m * K, K, k0, one, y + m * N + (g + b) * 8, N, k0 == 0);
        for (; m < M; ++m) btile_1_1(x + m * K, K, k0, one, y + m * N + (g + b) * 8, N, k0 == 0);
      }
    }
  }
}

static void widen_panel(const uint8_t* p, int64_t kind, int64_t K, float* out) {
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    if (kind == 3) widen_q41_block(p + (k0 / 32) * Q41_BLOCK, out + k0 * 8);
    else widen_q80_block(p + (k0 / 32) * Q80_BLOCK, out + k0 * 8);
  }
}

/* Many rows (a prefill): a chunk of panels widened whole into this thread's scratch (float32
   panels (K, 8), about 192 KB: in L2 with the rows' inputs), then f32_range's tiles over every row,
   the weights read from L2 as the float32 kernel reads its own. */
static void scratch_range(const float* x, const uint8_t* p, int64_t kind, float* y, int64_t M, int64_t K,
                          int64_t PS, int64_t N, int64_t lo, int64_t hi) {
  static _Thread_local float* panels = NULL;
  static _Thread_local int64_t room = 0;
  int64_t chunk = (192 * 1024 / 32) / K; /* panels of K floats x 8 in 192 KB */
  chunk = chunk < 3 ? 3 : chunk > 24 ? 24 : chunk - chunk % 3;
  if (chunk * K * 8 > room) { /* 32-byte aligned: the widening stores aligned vectors */
    free(panels);
    if (posix_memalign((void**)&panels, 64, (size_t)(chunk * K * 8) * sizeof(float)) != 0)
      abort(); /* as gemm_any's: no silent other arithmetic */
    room = chunk * K * 8;
  }
  for (int64_t c0 = lo; c0 < hi; c0 += chunk) {
    int64_t c1 = c0 + chunk < hi ? c0 + chunk : hi;
    for (int64_t b = c0; b < c1; ++b) widen_panel(p + b * PS, kind, K, panels + (b - c0) * K * 8);
    f32_range(x, panels, y + c0 * 8, M, K, K, N, 0, c1 - c0);
  }
}

/* Output panels [lo, hi) of a block weight (kind 3: Q4_1, 4: Q8_0; PS bytes a panel) for M rows. */
static void quant_range(const float* x, const uint8_t* p, int64_t kind, float* y, int64_t M, int64_t K, int64_t PS,
                        int64_t N, int64_t lo, int64_t hi) {
  switch (M > QROWS ? 0 : M * 2 + (kind == 4)) {
    case 2: QRUN(q41, 1, 4); break;
    case 4: QRUN(q41, 2, 3); break;
    case 6: QRUN(q41, 3, 2); break;
    case 3: QRUN(q80, 1, 4); break;
    case 5: QRUN(q80, 2, 3); break;
    case 7: QRUN(q80, 3, 2); break;
    default:
      if (M >= SCRATCH_ROWS) scratch_range(x, p, kind, y, M, K, PS, N, lo, hi);
      else blocked_range(x, p, kind, y, M, K, PS, N, lo, hi);
      break;
  }
}

/* Rows of a Q8_0 panel weight (the tied embedding) as float32: row ids[i] into out + i * K. */
void q8_0_rows(const uint8_t* p, int64_t PS, int64_t K, const int64_t* ids, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* panel = p + (ids[i] / 8) * PS;
    int64_t c = ids[i] % 8;
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      const uint8_t* blk = panel + (k0 / 32) * Q80_BLOCK;
      float d = _cvtsh_ss(((const uint16_t*)blk)[c]);
      for (int64_t k = 0; k < 32; ++k) out[i * K + k0 + k] = (float)(int8_t)blk[16 + k * 8 + c] * d;
    }
  }
}
#endif
