/* The float32 kernels of workers/engines/embedded/rowgemm.py (which compiles this file at first use). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* y (M, N) = x (M, K) . W^T; W in panels (N/8, K + pad, 8): float32 below, or bfloat16 in pairs of
   k (PAIR_TILE). Every output accumulates over k = 0, 1, 2, ... in one FMA chain whatever the
   tile, so a row's result does not depend on the rows beside it. */
#define UNROLL _Pragma("GCC unroll 16")
#define TILE(MR, NB) \
static void tile_##MR##_##NB(const float* x, int64_t K, int64_t KS, const float* p, float* y, int64_t N) { \
  __m256 acc[MR][NB]; \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_setzero_ps(); \
  _Pragma("GCC unroll 4") for (int64_t k = 0; k < K; ++k) { \
    __m256 w[NB]; \
    UNROLL for (int b = 0; b < NB; ++b) w[b] = _mm256_loadu_ps(p + (b * KS + k) * 8); \
    UNROLL for (int m = 0; m < MR; ++m) { \
      __m256 xv = _mm256_broadcast_ss(x + m * K + k); \
      UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_fmadd_ps(xv, w[b], acc[m][b]); \
    } \
  } \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) \
    _mm256_storeu_ps(y + m * N + b * 8, acc[m][b]); \
}

#define RUN(MR, NB) do { \
  int64_t b = b0; \
  for (; b + NB <= b1; b += NB) tile_##MR##_##NB(xm, K, KS, p + b * KS * 8, ym + b * 8, N); \
  for (; b < b1; ++b) tile_##MR##_1(xm, K, KS, p + b * KS * 8, ym + b * 8, N); } while (0)

TILE(4, 3) TILE(3, 4) TILE(2, 6) TILE(1, 8) TILE(4, 1) TILE(3, 1) TILE(2, 1) TILE(1, 1)

/* Output blocks [lo, blocks): rows in tiles of 4, the last 1-3 together. The weight is streamed
   once: every row tile works through a chunk of 24 panels (under 300 KB, in L2) before the
   next chunk is read. */
static void f32_range(const float* x, const float* p, float* y, int64_t M, int64_t K, int64_t KS, int64_t N,
                      int64_t lo, int64_t blocks) {
  int64_t chunk = M <= 4 ? blocks - lo : 24; /* a multiple of every tile's NB */
  for (int64_t b0 = lo; b0 < blocks; b0 += chunk) {
    int64_t b1 = b0 + chunk < blocks ? b0 + chunk : blocks, m = 0;
    for (; m + 4 <= M; m += 4) { const float* xm = x + m * K; float* ym = y + m * N; RUN(4, 3); }
    const float* xm = x + m * K; float* ym = y + m * N;
    switch (M - m) {
      case 3: RUN(3, 4); break;
      case 2: RUN(2, 6); break;
      case 1: RUN(1, 8); break;
      default: break;
    }
  }
}

/* bfloat16 panels in pairs of k: the 32-bit word (pair q, column c) holds w[2q][c] in its low half
   and w[2q+1][c] in its high half, so one load gives 16 weights and two integer ops (a shift, an
   and) widen them to float32: half the work of widening 8 at a time, which bounded a row's speed
   (2x for one row). The FMAs run in the same order, k = 0, 1, 2, ..., as everywhere here. */
/* A weight larger than the caches streams from memory; the hardware prefetcher alone kept a
   tile of 2-5 rows waiting on it (4 rows cost 1.85x one row on Zen 3 over 28 MB of weights).
   Asking for the data 12 KB ahead, into L2, overlaps the stream with the FMAs: 1.3x. */
#ifndef PREFETCH_BYTES /* bench.kernels builds a variant with -DPREFETCH_BYTES=0 to measure what it buys */
#define PREFETCH_BYTES 12288
#endif
#define PAIR_TILE(MR, NB) \
static void ptile_##MR##_##NB(const float* x, int64_t K, int64_t KS, const uint16_t* p, float* y, int64_t N) { \
  __m256 acc[MR][NB]; \
  const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u); \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_setzero_ps(); \
  int64_t k = 0; \
  for (; k + 2 <= K; k += 2) { \
    __m256 lo[NB], hi[NB]; \
    UNROLL for (int b = 0; b < NB; ++b) { \
      const uint16_t* at = p + (b * KS + k) * 8; \
      if (PREFETCH_BYTES) _mm_prefetch((const char*)at + PREFETCH_BYTES, _MM_HINT_T1); \
      __m256i v = _mm256_loadu_si256((const __m256i*)at); \
      lo[b] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); \
      hi[b] = _mm256_castsi256_ps(_mm256_and_si256(v, high)); \
    } \
    UNROLL for (int m = 0; m < MR; ++m) { \
      __m256 xv = _mm256_broadcast_ss(x + m * K + k); \
      UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_fmadd_ps(xv, lo[b], acc[m][b]); \
      xv = _mm256_broadcast_ss(x + m * K + k + 1); \
      UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_fmadd_ps(xv, hi[b], acc[m][b]); \
    } \
  } \
  if (k < K) { /* odd K: the last pair's low halves */ \
    UNROLL for (int b = 0; b < NB; ++b) { \
      __m256 w = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(p + (b * KS + k) * 8)), 16)); \
      UNROLL for (int m = 0; m < MR; ++m) acc[m][b] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * K + k), w, acc[m][b]); \
    } \
  } \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) \
    _mm256_storeu_ps(y + m * N + b * 8, acc[m][b]); \
}

PAIR_TILE(4, 2) PAIR_TILE(5, 2) PAIR_TILE(3, 2) PAIR_TILE(2, 3) PAIR_TILE(1, 6)
PAIR_TILE(4, 1) PAIR_TILE(5, 1) PAIR_TILE(3, 1) PAIR_TILE(2, 1) PAIR_TILE(1, 1)

#ifndef WIDE_TILES
#ifdef __AVX512F__
#define WIDE_TILES 1
#else
#define WIDE_TILES 0
#endif
#endif
#if WIDE_TILES
/* With AVX-512 (built where the CPU has it: rowgemm.py), two panels side by side fill a 512-bit
   register: the same pairs layout, the same widening, and per column the same FMA chain in
   the same order, so the same bits as the 8-wide tiles above, in half the FMAs (a 4-token
   verification cost 1.6x one token on AVX2 there: bound by the FMAs, not by the weights). */
#define WIDE_TILE(MR, NB) \
static void wtile_##MR##_##NB(const float* x, int64_t K, int64_t KS, const uint16_t* p, float* y, int64_t N) { \
  __m512 acc[MR][NB]; \
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u); \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps(); \
  int64_t k = 0; \
  for (; k + 2 <= K; k += 2) { \
    __m512 lo[NB], hi[NB]; \
    UNROLL for (int b = 0; b < NB; ++b) { \
      const uint16_t* at = p + (2 * b * KS + k) * 8; \
      if (PREFETCH_BYTES) { \
        _mm_prefetch((const char*)at + PREFETCH_BYTES, _MM_HINT_T1); \
        _mm_prefetch((const char*)(at + KS * 8) + PREFETCH_BYTES, _MM_HINT_T1); \
      } \
      __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)at)), \
                                     _mm256_loadu_si256((const __m256i*)(at + KS * 8)), 1); \
      lo[b] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); \
      hi[b] = _mm512_castsi512_ps(_mm512_and_si512(v, high)); \
    } \
    UNROLL for (int m = 0; m < MR; ++m) { \
      __m512 xv = _mm512_set1_ps(x[m * K + k]); \
      UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_fmadd_ps(xv, lo[b], acc[m][b]); \
      xv = _mm512_set1_ps(x[m * K + k + 1]); \
      UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_fmadd_ps(xv, hi[b], acc[m][b]); \
    } \
  } \
  if (k < K) { /* odd K: the last pair's low halves */ \
    UNROLL for (int b = 0; b < NB; ++b) { \
      const uint16_t* at = p + (2 * b * KS + k) * 8; \
      __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)at)), \
                                     _mm256_loadu_si256((const __m256i*)(at + KS * 8)), 1); \
      __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); \
      UNROLL for (int m = 0; m < MR; ++m) acc[m][b] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), w, acc[m][b]); \
    } \
  } \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) { \
    _mm256_storeu_ps(y + m * N + b * 16, _mm512_castps512_ps256(acc[m][b])); \
    _mm256_storeu_ps(y + m * N + b * 16 + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m][b]), 1))); \
  } \
}

/* Tile widths in pairs of panels per row count, from one-pass timings of the demo target's
   projections on a 2-core Xeon with AMX (builds taking turns, medians of 40): 5 rows 2.05 ms
   as 5 x 3 pairs against 2.26 as 5 x 2; 6-7 rows 3 pairs against 2 (2.26 / 2.43, 2.52 / 2.63);
   8-9 rows 2 pairs against 1 (2.80 / 3.68, 3.14 / 4.16). The 4-row tile of taller matrices
   (above 9 rows, in L2-sized chunks) stays 4 x 3. With 32 registers a tile of up to 9 rows
   fits, so a verification of up to 8 drafts streams the weight once, as one token does: with
   4-row tiles 6 rows had cost 1.63x one row, and 9 rows 2.09x. */
WIDE_TILE(1, 6) WIDE_TILE(2, 4) WIDE_TILE(3, 4) WIDE_TILE(4, 4) WIDE_TILE(4, 3) WIDE_TILE(5, 3)
WIDE_TILE(6, 3) WIDE_TILE(7, 3) WIDE_TILE(8, 2) WIDE_TILE(9, 2)
WIDE_TILE(1, 1) WIDE_TILE(2, 1) WIDE_TILE(3, 1) WIDE_TILE(4, 1) WIDE_TILE(5, 1)
WIDE_TILE(6, 1) WIDE_TILE(7, 1) WIDE_TILE(8, 1) WIDE_TILE(9, 1)
PAIR_TILE(6, 1) PAIR_TILE(7, 1) PAIR_TILE(8, 1) PAIR_TILE(9, 1)
#define ONE_PASS_ROWS 9

/* NB pairs of panels at a time, then single pairs, then an odd last panel 8 wide. (PRUN
   expands its arguments before PRUN_ pastes them into names.) */
#define PRUN(MR, NB, WB) PRUN_(MR, NB, WB)
#define PRUN_(MR, NB, WB) do { \
  int64_t b = b0; \
  for (; b + 2 * WB <= b1; b += 2 * WB) wtile_##MR##_##WB(xm, K, KS, p + b * KS * 8, ym + b * 8, N); \
  for (; b + 2 <= b1; b += 2) wtile_##MR##_1(xm, K, KS, p + b * KS * 8, ym + b * 8, N); \
  for (; b < b1; ++b) ptile_##MR##_1(xm, K, KS, p + b * KS * 8, ym + b * 8, N); } while (0)
#else
#define ONE_PASS_ROWS 5
#define PRUN(MR, NB, WB) do { \
  int64_t b = b0; \
  for (; b + NB <= b1; b += NB) ptile_##MR##_##NB(xm, K, KS, p + b * KS * 8, ym + b * 8, N); \
  for (; b < b1; ++b) ptile_##MR##_1(xm, K, KS, p + b * KS * 8, ym + b * 8, N); } while (0)
#endif

/* Output blocks [lo, blocks): up to ONE_PASS_ROWS rows in one tile; more in tiles of 4, the
   last 1-5 together (tile shapes measured fastest on Zen 3), each row tile working through a
   chunk of 24 panels (in L2) before the next chunk is read, so the weight is streamed once. */
static void b16_range(const float* x, const uint16_t* p, float* y, int64_t M, int64_t K, int64_t KS, int64_t N,
                      int64_t lo, int64_t blocks) {
  int64_t chunk = M <= ONE_PASS_ROWS ? blocks - lo : 24; /* a multiple of every tile's NB */
  for (int64_t b0 = lo; b0 < blocks; b0 += chunk) {
    int64_t b1 = b0 + chunk < blocks ? b0 + chunk : blocks, m = 0;
    if (M > ONE_PASS_ROWS)
      for (; M - m > 5; m += 4) { const float* xm = x + m * K; float* ym = y + m * N; PRUN(4, 2, 3); }
    const float* xm = x + m * K; float* ym = y + m * N;
    switch (M - m) {
#if WIDE_TILES
      case 9: PRUN(9, 1, 2); break;
      case 8: PRUN(8, 1, 2); break;
      case 7: PRUN(7, 1, 3); break;
      case 6: PRUN(6, 1, 3); break;
#endif
      case 5: PRUN(5, 2, 3); break;
      case 4: PRUN(4, 2, 4); break;
      case 3: PRUN(3, 2, 4); break;
      case 2: PRUN(2, 3, 4); break;
      case 1: PRUN(1, 6, 6); break;
      default: break;
    }
  }
}

#include "rowgemm_pool.h"
#include "quant_blocks.h"

#if WIDE_TILES && defined(__AVX512BF16__)
#define DOT_PRODUCTS 1
/* bfloat16 products (kind 2, built where the CPU has AVX512-BF16): the same panels, and the
   row's inputs rounded to bfloat16 once per call (round to nearest even), in pairs of k like
   the weights. One vdpbf16ps then adds x[2q] w[2q][c] + x[2q+1] w[2q+1][c] to column c's
   float32 sum, where kind 1 widens the pair (a shift, an and, shared by a tile's rows) and runs
   two FMAs a row: a quarter of the instructions at one row, half at many. The same
   instruction chain over q = 0, 1, 2, ... for every column whatever the tile, so a row's
   result still does not depend on the rows beside it. Each product of two bfloat16 values is
   exact in float32; the inputs' rounding is what differs from kind 1 (as in oneDNN's and
   AMX's bfloat16). */
#define DOT_TILE(MR, NB) \
static void dtile_##MR##_##NB(const uint32_t* x, int64_t Q, int64_t KS, const uint16_t* p, float* y, int64_t N) { \
  __m512 acc[MR][NB]; \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps(); \
  for (int64_t q = 0; q < Q; ++q) { \
    __m512bh w[NB]; \
    UNROLL for (int b = 0; b < NB; ++b) { \
      const uint16_t* at = p + (2 * b * KS + 2 * q) * 8; \
      if (PREFETCH_BYTES) { \
        _mm_prefetch((const char*)at + PREFETCH_BYTES, _MM_HINT_T1); \
        _mm_prefetch((const char*)(at + KS * 8) + PREFETCH_BYTES, _MM_HINT_T1); \
      } \
      w[b] = (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)at)), \
                                          _mm256_loadu_si256((const __m256i*)(at + KS * 8)), 1); \
    } \
    UNROLL for (int m = 0; m < MR; ++m) { \
      __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[m * Q + q]); \
      UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, w[b]); \
    } \
  } \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) _mm512_storeu_ps(y + m * N + b * 16, acc[m][b]); \
}
DOT_TILE(1, 6) DOT_TILE(2, 4) DOT_TILE(3, 4) DOT_TILE(4, 4) DOT_TILE(4, 3) DOT_TILE(5, 3)
DOT_TILE(6, 3) DOT_TILE(7, 3) DOT_TILE(8, 2) DOT_TILE(9, 2)
DOT_TILE(1, 1) DOT_TILE(2, 1) DOT_TILE(3, 1) DOT_TILE(4, 1) DOT_TILE(5, 1)
DOT_TILE(6, 1) DOT_TILE(7, 1) DOT_TILE(8, 1) DOT_TILE(9, 1)

/* An odd last panel, 8 columns: the same instruction on a register whose upper half is zero. */
static void dtile_tail(const uint32_t* x, int64_t M, int64_t Q, const uint16_t* p, float* y, int64_t N) {
  for (int64_t m = 0; m < M; ++m) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t q = 0; q < Q; ++q) {
      __m512bh w = (__m512bh)_mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)(p + 2 * q * 8)));
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)x[m * Q + q]), w);
    }
    _mm256_storeu_ps(y + m * N, _mm512_castps512_ps256(acc));
  }
}

#define DRUN(MR, WB) do { \
  int64_t b = b0; \
  for (; b + 2 * WB <= b1; b += 2 * WB) dtile_##MR##_##WB(xm, Q, KS, p + b * KS * 8, ym + b * 8, N); \
  for (; b + 2 <= b1; b += 2) dtile_##MR##_1(xm, Q, KS, p + b * KS * 8, ym + b * 8, N); \
  if (b < b1) dtile_tail(xm, MR, Q, p + b * KS * 8, ym + b * 8, N); } while (0)

/* b16_range's plan with bfloat16 products: x is (M, Q) pairs of bfloat16 inputs. */
static void dot_range(const uint32_t* x, const uint16_t* p, float* y, int64_t M, int64_t Q, int64_t KS, int64_t N,
                      int64_t lo, int64_t blocks) {
  int64_t chunk = M <= ONE_PASS_ROWS ? blocks - lo : 24;
  for (int64_t b0 = lo; b0 < blocks; b0 += chunk) {
    int64_t b1 = b0 + chunk < blocks ? b0 + chunk : blocks, m = 0;
    if (M > ONE_PASS_ROWS)
      for (; M - m > 5; m += 4) { const uint32_t* xm = x + m * Q; float* ym = y + m * N; DRUN(4, 3); }
    const uint32_t* xm = x + m * Q; float* ym = y + m * N;
    switch (M - m) {
      case 9: DRUN(9, 2); break;
      case 8: DRUN(8, 2); break;
      case 7: DRUN(7, 3); break;
      case 6: DRUN(6, 3); break;
      case 5: DRUN(5, 3); break;
      case 4: DRUN(4, 4); break;
      case 3: DRUN(3, 4); break;
      case 2: DRUN(2, 4); break;
      case 1: DRUN(1, 6); break;
      default: break;
    }
  }
}

/* Rows of K float32 inputs -> rows of Q = ceil(K/2) bfloat16 pairs (the odd K's last pair padded
   with +0, whose products with the panels' zero padding add nothing). Elementwise rounding: a
   value's bfloat16 does not depend on its row or position. */
static void to_pairs(const float* x, int64_t M, int64_t K, uint32_t* out) {
  int64_t Q = (K + 1) / 2;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    uint16_t* om = (uint16_t*)(out + m * Q);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
      _mm512_storeu_si512(om + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xm + k + 16), _mm512_loadu_ps(xm + k)));
    if (k < K) {
      __mmask16 lo = (__mmask16)(K - k >= 16 ? 0xFFFF : (1u << (K - k)) - 1);
      __mmask16 hi = (__mmask16)(K - k <= 16 ? 0 : (1u << (K - k - 16)) - 1);
      __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, xm + k + 16), _mm512_maskz_loadu_ps(lo, xm + k));
      _mm512_mask_storeu_epi16(om + k, (__mmask32)((((uint64_t)1) << (2 * Q - k)) - 1), v);
    }
  }
}
#else
#define DOT_PRODUCTS 0
#endif

int64_t rowgemm_dot_products(void) { return DOT_PRODUCTS; }

/* align: output blocks a part's range is cut on, whole tiles (6 for bfloat16, 24 for float32) */
typedef struct { const float* x; const void* w; int64_t kind; float* y; int64_t M, K, KS, N, align; } gemm_t;

static void gemm_part(const void* ctx, int64_t part, int64_t parts) {
  const gemm_t* g = ctx;
  int64_t lo, hi;
  part_range(g->N / 8, g->align, part, parts, &lo, &hi);
  if (lo >= hi) return;
#if DOT_PRODUCTS
  if (g->kind == 2) { dot_range((const uint32_t*)g->x, (const uint16_t*)g->w, g->y, g->M, (g->K + 1) / 2, g->KS,
                                g->N, lo, hi); return; }
#endif
  if (g->kind >= 3) quant_range(g->x, (const uint8_t*)g->w, g->kind, g->y, g->M, g->K, g->KS, g->N, lo, hi);
  else if (g->kind == 1) b16_range(g->x, (const uint16_t*)g->w, g->y, g->M, g->K, g->KS, g->N, lo, hi);
  else f32_range(g->x, (const float*)g->w, g->y, g->M, g->K, g->KS, g->N, lo, hi);
}

static void gemm_any(const float* x, const void* w, int64_t kind, float* y, int64_t M, int64_t K, int64_t KS,
                     int64_t N) {
  gemm_t g = {x, w, kind, y, M, K, KS, N, kind == 0 ? 24 : kind >= 3 ? 12 : 6};
#if !DOT_PRODUCTS
  if (kind == 2) abort(); /* rowgemm.py asks for kind 2 only where rowgemm_dot_products() */
#else
  /* The inputs as bfloat16 pairs, once per call, in the calling thread's buffer (grown, never
     freed: a forward's largest input); the parts read it. */
  static _Thread_local uint32_t* pairs = NULL;
  static _Thread_local int64_t room = 0;
  if (kind == 2) {
    int64_t need = M * ((K + 1) / 2);
    if (need > room) {
      uint32_t* grown = realloc(pairs, (size_t)need * sizeof(uint32_t));
      if (grown == NULL) abort(); /* no fallback: a silent float32 product would change the bits */
      pairs = grown;
      room = need;
    }
    to_pairs(x, M, K, pairs);
    g.x = (const float*)pairs;
  }
#endif
  parallel_for(gemm_part, &g, parts_for((N / 8 + g.align - 1) / g.align));
}

void rowgemm_f32(const float* x, const float* p, float* y, int64_t M, int64_t K, int64_t KS, int64_t N) {
  gemm_any(x, p, 0, y, M, K, KS, N);
}

void rowgemm_b16(const float* x, const uint16_t* p, float* y, int64_t M, int64_t K, int64_t KS, int64_t N) {
  gemm_any(x, p, 1, y, M, K, KS, N);
}

/* kind 3: Q4_1 blocks, kind 4: Q8_0 blocks (quant_blocks.h); PS: bytes a panel. */
void rowgemm_quant(const float* x, const uint8_t* p, int64_t kind, float* y, int64_t M, int64_t K, int64_t PS,
                   int64_t N) {
  gemm_any(x, p, kind, y, M, K, PS, N);
}

/* kind 2: bfloat16 products (only where rowgemm_dot_products(); gemm_any aborts elsewhere). */
void rowgemm_dot(const float* x, const uint16_t* p, float* y, int64_t M, int64_t K, int64_t KS, int64_t N) {
  gemm_any(x, p, 2, y, M, K, KS, N);
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* y = x / sqrt(mean(x^2) + eps) * w, row by row (K a multiple of 8). */
void rmsnorm(const float* x, const float* w, float* y, int64_t M, int64_t K, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    __m256 ss = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) { __m256 v = _mm256_loadu_ps(xm + k); ss = _mm256_fmadd_ps(v, v, ss); }
    __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum(ss) / (float)K + eps));
    for (int64_t k = 0; k < K; k += 8)
      _mm256_storeu_ps(y + m * K + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xm + k), r), _mm256_loadu_ps(w + k)));
  }
}

/* exp(x) for 8 floats: Cephes' range reduction and degree-5 polynomial (under 2 ulp), the same
   instructions for every lane and call, so a value's result does not depend on its neighbours.
   libm's scalar expf cost a step more than the FMAs around it (softmax, SwiGLU). */
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* h = silu(g) * u for gu = [g | u] rows of 2I. */
void swiglu(const float* gu, float* h, int64_t M, int64_t I) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t m = 0; m < M; ++m) {
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
      __m256 g = _mm256_loadu_ps(gu + m * 2 * I + i);
      __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
      _mm256_storeu_ps(h + m * I + i, _mm256_mul_ps(silu, _mm256_loadu_ps(gu + m * 2 * I + I + i)));
    }
    for (; i < I; ++i) {
      float g = gu[m * 2 * I + i];
      h[m * I + i] = g / (1.0f + expf(-g)) * gu[m * 2 * I + I + i];
    }
  }
}

/* The 8 sums of a[0..7]'s lanes, in order: one reduction tree for 8 dot products. */
static inline __m256 hsum8(const __m256* a) {
  __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

static inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

typedef struct {
  const float *qkv, *cos_t, *sin_t, *kc, *vc;
  const int64_t *slots, *starts, *lengths, *offs;
  int64_t B, L, H, Hkv, D, P;
  float scale;
  float *out, *scratch;
  const int64_t* tree; /* NULL, or TREE_STRIDE int64 per packed token (see forward_tree) */
} attend_t;

/* Token trees (forward_tree): per packed token, its logical position (rotary; it attends to
   logical + 1 keys), how many of its top logical keys are mapped (0..TREE_DEPTH), and their
   cache positions (its ancestors, itself last). policies/tree.py's MAX_TREE_DEPTH; rowgemm.py
   checks it against rowgemm_tree_depth() and checks every index before the call. */
#define TREE_DEPTH 8
#define TREE_STRIDE (TREE_DEPTH + 2)
int64_t rowgemm_tree_depth(void) { return TREE_DEPTH; }

static void attend_part(const void* ctx, int64_t part, int64_t parts);
static void attend_part_tree(const void* ctx, int64_t part, int64_t parts);
#define QT 8  /* queries attended together: each key and value row is read once for all of them */
#define VT 32 /* value rows per pass over a tile's queries (8 KB at D = 64: in L1) */

/* One cached attention layer for B sequences of up to L new tokens (row b has lengths[b]):
   rotary on q and k (rotate-half layout, tables (P, D)), k and v written to the cache at
   slot slots[b], positions starts[b] + l, then every query attends to its own prefix of keys
   (causal). Token l of sequence b is row offs[b] + l of qkv (rows of (H + 2 Hkv) D) and of out
   (rows of H D): offs[b] = b L for padded rows, or the lengths' running sum for packed ones
   (forward); a padded row's out is not written. caches (slots, Hkv, P, D). Each query's
   arithmetic depends on its own row and the cache only.
   Queries in tiles of up to QT that share a KV head (a sequence's rows and the heads of one
   group), so each key and value row is read once per tile instead of once per query; tiles in
   parts across the pool's threads. Each query's arithmetic is the same whatever its tile, its
   part and the thread count. scratch holds rowgemm_score_rows() rows of P scores.
   tree (NULL for ordinary forwards): token l is still written at starts[b] + l, but rotated at
   its logical position, and its keys are read through its map (attend_tree_part). */
static void rope_attend_impl(const float* qkv, const float* cos_t, const float* sin_t, float* kc, float* vc,
                             const int64_t* slots, const int64_t* starts, const int64_t* lengths,
                             const int64_t* offs, int64_t B, int64_t L, int64_t H, int64_t Hkv, int64_t D,
                             int64_t P, float scale, float* out, float* scratch, const int64_t* tree) {
  int64_t W = (H + 2 * Hkv) * D, half = D / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < lengths[b]; ++l) {
      int64_t pos = starts[b] + l, rot = tree ? tree[(offs[b] + l) * TREE_STRIDE] : pos;
      const float* row = qkv + (offs[b] + l) * W;
      const float* c = cos_t + rot * D; const float* s = sin_t + rot * D;
      for (int64_t h = 0; h < Hkv; ++h) {
        const float* k = row + (H + h) * D; const float* v = row + (H + Hkv + h) * D;
        float* kd = kc + ((slots[b] * Hkv + h) * P + pos) * D;
        float* vd = vc + ((slots[b] * Hkv + h) * P + pos) * D;
        for (int64_t i = 0; i < half; ++i) {
          kd[i] = k[i] * c[i] - k[i + half] * s[i];
          kd[i + half] = k[i + half] * c[i + half] + k[i] * s[i + half];
        }
        for (int64_t i = 0; i < D; ++i) vd[i] = v[i];
      }
    }
  attend_t a = {qkv, cos_t, sin_t, kc, vc, slots, starts, lengths, offs, B, L, H, Hkv, D, P, scale, out, scratch,
                tree};
  parallel_for(tree ? attend_part_tree : attend_part, &a, parts_for(B * Hkv * ((L * (H / Hkv) + QT - 1) / QT)));
}

void rope_attend(const float* qkv, const float* cos_t, const float* sin_t, float* kc, float* vc,
                 const int64_t* slots, const int64_t* starts, const int64_t* lengths, const int64_t* offs,
                 int64_t B, int64_t L, int64_t H, int64_t Hkv, int64_t D, int64_t P, float scale, float* out,
                 float* scratch) {
  rope_attend_impl(qkv, cos_t, sin_t, kc, vc, slots, starts, lengths, offs, B, L, H, Hkv, D, P, scale, out, scratch,
                   NULL);
}

/* Rows of P scores rope_attend's scratch must hold: QT per part (each part's tile). */
int64_t rowgemm_score_rows(void) { return parts_for(MAX_PARTS) * QT; }

/* A query's key at logical index j: its cache row, through its map where j is one of its top
   mapped keys (lo <= j < lo + count), else row j (a prefix key, or one past the query, masked). */
static inline int64_t key_row(int64_t j, int64_t lo, int64_t count, const int64_t* map) {
  return j >= lo && j < lo + count ? map[j - lo] : j;
}

/* attend_part and attend_part_tree: one body, TREE a constant, so the ordinary forward's
   compiled code is what it was (the tree branches fold away). Keys are scored and summed by
   logical index j, in the same 8-key blocks and VT-row passes as for an ordinary query at that
   position: only where key j is read from changes, so a tree node's output is a plain decode
   step's at its logical position, bit for bit. */
static inline __attribute__((always_inline)) void attend_impl(const void* ctx, int64_t part, int64_t parts,
                                                              const int TREE) {
  const attend_t* a = ctx;
  int64_t L = a->L, H = a->H, Hkv = a->Hkv, D = a->D, P = a->P, group = H / Hkv;
  int64_t W = (H + 2 * Hkv) * D, half = D / 2, queries = L * group, per_head = (queries + QT - 1) / QT, lo, hi;
  float* scores = a->scratch + part * QT * P;
  part_range(a->B * Hkv * per_head, 1, part, parts, &lo, &hi);
  for (int64_t unit = lo; unit < hi; ++unit) {
    /* A KV head's queries in per_head tiles of near-equal size (12 as 6 + 6, not 8 + 4). */
    int64_t b = unit / (Hkv * per_head), g = unit / per_head % Hkv, tile = unit % per_head;
    int64_t first = queries * tile / per_head, last = queries * (tile + 1) / per_head;
    const float* kb = a->kc + (a->slots[b] * Hkv + g) * P * D;
    const float* vb = a->vc + (a->slots[b] * Hkv + g) * P * D;
    /* The tile's queries: (row l, head h) for query index l * group + (h - g * group). */
    float q[QT][256]; /* D <= 256 (RowGemm.supports) */
    float* o[QT];
    int64_t keys[QT], padded[QT], n = 0, most = 0;
    int64_t mlo[QT], mcount[QT]; /* tree: the first mapped logical key and how many are mapped */
    const int64_t* mmap[QT];
    __m256 vmax[QT], tail[QT];
    for (int64_t i = first; i < last; ++i) {
      int64_t l = i / group, h = g * group + i % group;
      if (l >= a->lengths[b]) continue; /* padding: no query */
      float* out = a->out + (a->offs[b] + l) * H * D + h * D;
      int64_t pos = a->starts[b] + l;
      if (TREE) {
        const int64_t* t = a->tree + (a->offs[b] + l) * TREE_STRIDE;
        pos = t[0];
        mcount[n] = t[1];
        mlo[n] = pos - t[1] + 1;
        mmap[n] = t + 2;
      }
      const float* qs = a->qkv + (a->offs[b] + l) * W + h * D;
      const float* c = a->cos_t + pos * D; const float* s = a->sin_t + pos * D;
      for (int64_t d = 0; d < half; ++d) {
        q[n][d] = (qs[d] * c[d] - qs[d + half] * s[d]) * a->scale;
        q[n][d + half] = (qs[d + half] * c[d + half] + qs[d] * s[d + half]) * a->scale;
      }
      o[n] = out;
      keys[n] = pos + 1;
      padded[n] = (keys[n] + 7) & ~(int64_t)7;
      tail[n] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(keys[n] - (padded[n] - 8))),
                                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
      vmax[n] = _mm256_set1_ps(-INFINITY);
      if (padded[n] > most) most = padded[n];
      ++n;
    }
    /* Scores 8 keys at a time (the last block's keys past pos are read, P being a multiple of
       8, and masked); which keys share a block depends on pos alone. */
    for (int64_t j0 = 0; j0 < most; j0 += 8)
      for (int64_t t = 0; t < n; ++t) {
        if (j0 >= padded[t]) continue;
        /* Eight independent chains, each a key's dot product over d in order. */
        __m256 dots[8];
        for (int64_t k = 0; k < 8; ++k) dots[k] = _mm256_setzero_ps();
        if (TREE && mcount[t] && j0 + 8 > mlo[t]) {
          /* A block holding mapped keys: the same FMAs, each key's row read through the map. */
          const float* kr[8];
          for (int64_t k = 0; k < 8; ++k) kr[k] = kb + key_row(j0 + k, mlo[t], mcount[t], mmap[t]) * D;
          for (int64_t d = 0; d < D; d += 8) {
            __m256 qd = _mm256_loadu_ps(q[t] + d);
            for (int64_t k = 0; k < 8; ++k) dots[k] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kr[k] + d), dots[k]);
          }
        } else
        for (int64_t d = 0; d < D; d += 8) {
          __m256 qd = _mm256_loadu_ps(q[t] + d);
          for (int64_t k = 0; k < 8; ++k) dots[k] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kb + (j0 + k) * D + d), dots[k]);
        }
        __m256 sc8 = hsum8(dots);
        if (j0 + 8 > keys[t]) sc8 = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc8, tail[t]);
        _mm256_storeu_ps(scores + t * P + j0, sc8);
        vmax[t] = _mm256_max_ps(vmax[t], sc8);
      }
    float inv[QT];
    for (int64_t t = 0; t < n; ++t) {
      float* sc = scores + t * P;
      __m256 mx8 = _mm256_set1_ps(hmax(vmax[t])), tot8 = _mm256_setzero_ps();
      for (int64_t j0 = 0; j0 < padded[t]; j0 += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j0), mx8));
        if (j0 + 8 > keys[t]) e = _mm256_and_ps(e, tail[t]);
        _mm256_storeu_ps(sc + j0, e);
        tot8 = _mm256_add_ps(tot8, e);
      }
      inv[t] = 1.0f / hsum(tot8);
      for (int64_t d = 0; d < D; ++d) o[t][d] = 0.0f; /* the output row holds the sums until the end */
    }
    /* Values VT rows at a time for every query of the tile, each query's sums over j in order. */
    for (int64_t j1 = 0; j1 < most; j1 += VT)
      for (int64_t t = 0; t < n; ++t) {
        int64_t end = j1 + VT < keys[t] ? j1 + VT : keys[t];
        if (j1 >= end) continue;
        __m256 acc[32];
        for (int64_t d = 0; d < D / 8; ++d) acc[d] = _mm256_loadu_ps(o[t] + d * 8);
        for (int64_t j = j1; j < end; ++j) {
          __m256 p = _mm256_set1_ps(scores[t * P + j]);
          const float* vr = vb + (TREE ? key_row(j, mlo[t], mcount[t], mmap[t]) : j) * D;
          for (int64_t d = 0; d < D / 8; ++d) acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + d * 8), acc[d]);
        }
        for (int64_t d = 0; d < D / 8; ++d) _mm256_storeu_ps(o[t] + d * 8, acc[d]);
      }
    for (int64_t t = 0; t < n; ++t) {
      __m256 iv = _mm256_set1_ps(inv[t]);
      for (int64_t d = 0; d < D / 8; ++d) _mm256_storeu_ps(o[t] + d * 8, _mm256_mul_ps(_mm256_loadu_ps(o[t] + d * 8), iv));
    }
  }
}

static void attend_part(const void* ctx, int64_t part, int64_t parts) { attend_impl(ctx, part, parts, 0); }
static void attend_part_tree(const void* ctx, int64_t part, int64_t parts) { attend_impl(ctx, part, parts, 1); }

/* A projection's panels: weights, panel stride (k-rows; bytes for blocks), element kind (0 float32,
   1 bfloat16, 2 bfloat16 products, 3 Q4_1 blocks, 4 Q8_0 blocks). The embedding is one too: kind 0
   a row-major float32 table (ks unused), kind 4 the tied head's Q8_0 panels (q8_0_rows). */
typedef struct { const void* w; int64_t ks; int64_t kind; } lin_t;

static void gemm(const float* x, const lin_t* l, float* y, int64_t M, int64_t K, int64_t N) {
  gemm_any(x, l->w, l->kind, y, M, K, l->ks, N);
}

static void embed_row(const lin_t* e, int64_t token, int64_t hid, float* out) {
  if (e->kind == 4) { q8_0_rows((const uint8_t*)e->w, e->ks, hid, &token, 1, out); return; }
  const float* row = (const float*)e->w + token * hid;
  for (int64_t i = 0; i < hid; ++i) out[i] = row[i];
}

static void add_into(float* x, const float* t, int64_t n) { for (int64_t i = 0; i < n; ++i) x[i] += t[i]; }

/* A whole cached forward of B rows x L new tokens, as LlamaForCausalLM._forward_native runs it
   op by op: embedding, per layer RMSNorm, QKV, rotary + cache write + attention, O, residual,
   RMSNorm, gate/up, SwiGLU, down, residual; then the final norm and the LM head for the rows
   logit_idx (indices into B*L; a padding position's logits are 0). norms: 2 per layer + the
   final one; lins: QKV, O, gate/up, down per layer + the head. The same kernels in the same
   order, so the same bits. The rows' real tokens are packed (row b's lengths[b] tokens, then
   the next row's): a step where some sequences verify K + 1 tokens and the others one costs
   their tokens, not B (K + 1), and every kernel is row-invariant, so packing changes no bit.
   tree: NULL, or forward_tree's per-token tree arrays. */
static void forward_impl(const int64_t* tokens, int64_t B, int64_t L, const lin_t* embed, int64_t hid,
                         int64_t inter, int64_t layers, const float* const* norms, const lin_t* lins,
                         float* const* kc, float* const* vc, int64_t P, const float* cos_t, const float* sin_t,
                         const int64_t* slots, const int64_t* starts, const int64_t* lengths, int64_t H,
                         int64_t Hkv, int64_t D, float eps, float scale, const int64_t* logit_idx, int64_t n_logits,
                         int64_t vocab, float* logits, float* scratch, const int64_t* tree, float* aux,
                         const int64_t* aux_ids, int64_t n_aux) {
  int64_t offs[B + 1], W = (H + 2 * Hkv) * D, cap = B * L; /* the scratch holds B * L rows */
  offs[0] = 0;
  for (int64_t b = 0; b < B; ++b) offs[b + 1] = offs[b] + lengths[b];
  int64_t M = offs[B];
  float *x = scratch, *h = x + cap * hid, *qkv = h + cap * hid, *att = qkv + cap * W, *tmp = att + cap * H * D;
  float *gu = tmp + cap * hid, *act = gu + cap * 2 * inter, *sc = act + cap * inter;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < lengths[b]; ++l)
      embed_row(embed, tokens[b * L + l], hid, x + (offs[b] + l) * hid);
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t a = 0; a < n_aux; ++a) /* the residual stream after l layers, for an EAGLE-3 head */
      if (aux_ids[a] == l)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t i = 0; i < hid; ++i) aux[(m * n_aux + a) * hid + i] = x[m * hid + i];
    rmsnorm(x, norms[2 * l], h, M, hid, eps);
    gemm(h, &lins[4 * l], qkv, M, hid, W);
    rope_attend_impl(qkv, cos_t, sin_t, kc[l], vc[l], slots, starts, lengths, offs, B, L, H, Hkv, D, P, scale, att,
                     sc, tree);
    gemm(att, &lins[4 * l + 1], tmp, M, H * D, hid);
    add_into(x, tmp, M * hid);
    rmsnorm(x, norms[2 * l + 1], h, M, hid, eps);
    gemm(h, &lins[4 * l + 2], gu, M, hid, 2 * inter);
    swiglu(gu, act, M, inter);
    gemm(act, &lins[4 * l + 3], tmp, M, inter, hid);
    add_into(x, tmp, M * hid);
  }
  int64_t padded = 0; /* logit rows asked for at padding positions */
  for (int64_t r = 0; r < n_logits; ++r) {
    int64_t b = logit_idx[r] / L, l = logit_idx[r] % L;
    if (l < lengths[b]) for (int64_t i = 0; i < hid; ++i) tmp[r * hid + i] = x[(offs[b] + l) * hid + i];
    else { ++padded; for (int64_t i = 0; i < hid; ++i) tmp[r * hid + i] = 0.0f; }
  }
  rmsnorm(tmp, norms[2 * layers], h, n_logits, hid, eps);
  gemm(h, &lins[4 * layers], logits, n_logits, hid, vocab);
  if (padded)
    for (int64_t r = 0; r < n_logits; ++r)
      if (logit_idx[r] % L >= lengths[logit_idx[r] / L])
        for (int64_t v = 0; v < vocab; ++v) logits[r * vocab + v] = 0.0f;
}

void forward(const int64_t* tokens, int64_t B, int64_t L, const lin_t* embed, int64_t hid, int64_t inter,
             int64_t layers, const float* const* norms, const lin_t* lins, float* const* kc, float* const* vc,
             int64_t P, const float* cos_t, const float* sin_t, const int64_t* slots, const int64_t* starts,
             const int64_t* lengths, int64_t H, int64_t Hkv, int64_t D, float eps, float scale,
             const int64_t* logit_idx, int64_t n_logits, int64_t vocab, float* logits, float* scratch) {
  forward_impl(tokens, B, L, embed, hid, inter, layers, norms, lins, kc, vc, P, cos_t, sin_t, slots, starts, lengths,
               H, Hkv, D, eps, scale, logit_idx, n_logits, vocab, logits, scratch, NULL, NULL, NULL, 0);
}

/* forward, also copying the residual stream before each layer in aux_ids (n_aux of them) into
   aux: (packed tokens, n_aux, hid), row b's lengths[b] tokens then the next row's. An EAGLE-3
   head reads them (the target's "auxiliary hidden states"); the logits are forward's (tree NULL)
   or forward_tree's, bit for bit. */
void forward_aux(const int64_t* tokens, int64_t B, int64_t L, const lin_t* embed, int64_t hid, int64_t inter,
                 int64_t layers, const float* const* norms, const lin_t* lins, float* const* kc, float* const* vc,
                 int64_t P, const float* cos_t, const float* sin_t, const int64_t* slots, const int64_t* starts,
                 const int64_t* lengths, int64_t H, int64_t Hkv, int64_t D, float eps, float scale,
                 const int64_t* logit_idx, int64_t n_logits, int64_t vocab, float* logits, float* scratch,
                 const int64_t* tree, float* aux, const int64_t* aux_ids, int64_t n_aux) {
  forward_impl(tokens, B, L, embed, hid, inter, layers, norms, lins, kc, vc, P, cos_t, sin_t, slots, starts, lengths,
               H, Hkv, D, eps, scale, logit_idx, n_logits, vocab, logits, scratch, tree, aux, aux_ids, n_aux);
}

/* forward with token trees (issue #36): tree holds TREE_STRIDE int64 per packed token (row b's
   lengths[b] tokens, then the next row's): its logical position, the count of mapped keys,
   then their cache positions (TREE_DEPTH slots, the first count used). An ordinary token is
   {starts[b] + l, 0}. Each token is written at starts[b] + l as in forward; rotary and
   attention follow its logical position and map. rowgemm.py checks every index first. */
void forward_tree(const int64_t* tokens, int64_t B, int64_t L, const lin_t* embed, int64_t hid, int64_t inter,
                  int64_t layers, const float* const* norms, const lin_t* lins, float* const* kc, float* const* vc,
                  int64_t P, const float* cos_t, const float* sin_t, const int64_t* slots, const int64_t* starts,
                  const int64_t* lengths, int64_t H, int64_t Hkv, int64_t D, float eps, float scale,
                  const int64_t* logit_idx, int64_t n_logits, int64_t vocab, float* logits, float* scratch,
                  const int64_t* tree) {
  forward_impl(tokens, B, L, embed, hid, inter, layers, norms, lins, kc, vc, P, cos_t, sin_t, slots, starts, lengths,
               H, Hkv, D, eps, scale, logit_idx, n_logits, vocab, logits, scratch, tree, NULL, NULL, 0);
}

/* Greedy drafting in one call: `steps` forwards of B rows, each row's argmax (the first
   highest logit, as torch.argmax picks) fed back as its one new token in the next forward.
   The first forward is `forward`'s (rows padded to L, a row's logits at idx0[b]); every later
   one writes one token per row after the last. starts and lengths are updated in place. out
   holds the drafts step-major: out[s * B + b]. Bit for bit the forwards the engine would run
   one at a time, without the interpreter between them (at batch 1 that was a third of a
   draft step). */
void draft_greedy(const int64_t* tokens, int64_t B, int64_t L, const lin_t* embed, int64_t hid, int64_t inter,
                  int64_t layers, const float* const* norms, const lin_t* lins, float* const* kc,
                  float* const* vc, int64_t P, const float* cos_t, const float* sin_t, const int64_t* slots,
                  int64_t* starts, int64_t* lengths, int64_t H, int64_t Hkv, int64_t D, float eps, float scale,
                  const int64_t* idx0, int64_t vocab, float* logits, float* scratch, int64_t steps,
                  int64_t* out) {
  int64_t idx[B];
  for (int64_t b = 0; b < B; ++b) idx[b] = b;
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t* in = s == 0 ? tokens : out + (s - 1) * B;
    forward_impl(in, B, s == 0 ? L : 1, embed, hid, inter, layers, norms, lins, kc, vc, P, cos_t, sin_t, slots,
                 starts, lengths, H, Hkv, D, eps, scale, s == 0 ? idx0 : idx, B, vocab, logits, scratch, NULL, NULL,
                 NULL, 0);
    for (int64_t b = 0; b < B; ++b) {
      const float* row = logits + b * vocab;
      int64_t best = 0;
      for (int64_t v = 1; v < vocab; ++v)
        if (row[v] > row[best]) best = v;
      out[s * B + b] = best;
      starts[b] += lengths[b];
      lengths[b] = 1;
    }
  }
}
