"""A row-invariant float32 projection kernel for AVX2 CPUs, compiled at start-up.

On a CPU without AVX512-BF16/AMX the float32 projections run MKL's ``F.linear``, and a step of
these small models is bound by streaming the weights from memory (the target's are 57 MB in
float32, more than the last-level cache). MKL repacks the weight on every call of 2 or more
rows, so verifying 9 tokens cost 2.0x one token, and it rounds a row differently depending on
how many rows there are, so float32 verification was not bit-identical to plain decoding.

This kernel computes ``y = x Wᵀ`` from a weight laid out once, at load, in panels of 8 output
columns (``(N/8, K, 8)``), stored in bfloat16 when that is lossless (the checkpoints are
bfloat16, so it always is for them): half the bytes to stream, and every product still a
float32 FMA of the same values. Every output element accumulates over K in the same order with
the same instructions whatever the number of rows, so a token's logits in a (K+1)-token
verification are those of the same token decoded alone, bit for bit (``verification_bit_identical``
checks it at start-up, and ``tests/test_rowgemm.py`` here).

The C source is compiled with the system C compiler (``cc``, or ``$CC``) into
``~/.cache/specgate/rowgemm`` (``SPECGATE_ROWGEMM_DIR``) once per source and compiler, about a
second; a CPU without AVX2/FMA, a missing compiler or a failed build leaves ``load()`` None, and
the model runs ``F.linear`` as before. ``SPECGATE_ROWGEMM=0`` disables it. Whether a worker
serves with it is a measured choice (``workers/costs_measure.py``), not this module's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* y (M, N) = x (M, K) . W^T; W in panels (N/8, K + pad, 8), float32 (f32), bfloat16 (b16), or int8
   (i8) times a scale per output column (sc, else NULL). */
static inline __m256 load_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline __m256 load_b16(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

#define UNROLL _Pragma("GCC unroll 16")
#define TILE(T, MR, NB) \
static void tile_##T##_##MR##_##NB(const float* x, int64_t K, int64_t KS, const T##_t* p, const float* sc, \
                                   float* y, int64_t N) { \
  __m256 acc[MR][NB]; \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_setzero_ps(); \
  for (int64_t k = 0; k < K; ++k) { \
    __m256 w[NB]; \
    UNROLL for (int b = 0; b < NB; ++b) w[b] = load_##T(p + (b * KS + k) * 8); \
    UNROLL for (int m = 0; m < MR; ++m) { \
      __m256 xv = _mm256_broadcast_ss(x + m * K + k); \
      UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_fmadd_ps(xv, w[b], acc[m][b]); \
    } \
  } \
  if (sc) UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) \
    acc[m][b] = _mm256_mul_ps(acc[m][b], _mm256_loadu_ps(sc + b * 8)); \
  UNROLL for (int m = 0; m < MR; ++m) UNROLL for (int b = 0; b < NB; ++b) \
    _mm256_storeu_ps(y + m * N + b * 8, acc[m][b]); \
}

#define RUN(T, MR, NB) do { \
  int64_t b = b0; \
  for (; b + NB <= b1; b += NB) tile_##T##_##MR##_##NB(xm, K, KS, p + b * KS * 8, sc ? sc + b * 8 : 0, ym + b * 8, N); \
  for (; b < b1; ++b) tile_##T##_##MR##_1(xm, K, KS, p + b * KS * 8, sc ? sc + b * 8 : 0, ym + b * 8, N); } while (0)

/* Rows in tiles of 4, the last 1-3 together. The weight is streamed once: every row tile
   works through a chunk of 24 panels (under 300 KB, in L2) before the next chunk is read. */
#define GEMM(T) \
TILE(T, 4, 3) TILE(T, 3, 4) TILE(T, 2, 6) TILE(T, 1, 8) \
TILE(T, 4, 1) TILE(T, 3, 1) TILE(T, 2, 1) TILE(T, 1, 1) \
void rowgemm_##T(const float* x, const T##_t* p, const float* sc, float* y, int64_t M, int64_t K, int64_t KS, \
                 int64_t N) { \
  int64_t blocks = N / 8; \
  int64_t chunk = M <= 4 ? blocks : 24; /* a multiple of every tile's NB */ \
  for (int64_t b0 = 0; b0 < blocks; b0 += chunk) { \
    int64_t b1 = b0 + chunk < blocks ? b0 + chunk : blocks, m = 0; \
    for (; m + 4 <= M; m += 4) { const float* xm = x + m * K; float* ym = y + m * N; RUN(T, 4, 3); } \
    const float* xm = x + m * K; float* ym = y + m * N; \
    switch (M - m) { \
      case 3: RUN(T, 3, 4); break; \
      case 2: RUN(T, 2, 6); break; \
      case 1: RUN(T, 1, 8); break; \
      default: break; \
    } \
  } \
}

typedef float f32_t;
typedef uint16_t b16_t;
typedef int8_t i8_t;
GEMM(f32)
GEMM(b16)
GEMM(i8)

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

/* h = silu(g) * u for gu = [g | u] rows of 2I. */
void swiglu(const float* gu, float* h, int64_t M, int64_t I) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; ++i) {
      float g = gu[m * 2 * I + i];
      h[m * I + i] = g / (1.0f + expf(-g)) * gu[m * 2 * I + I + i];
    }
}

/* One cached attention layer for B sequences of up to L new tokens (row b has lengths[b]):
   rotary on q and k (rotate-half layout, tables (P, D)), k and v written to the cache at
   slot slots[b], positions starts[b] + l, then every query attends to its own prefix of keys
   (causal). qkv (B, L, (H + 2 Hkv) D); caches (slots, Hkv, P, D); out (B, L, H D), padding
   rows 0. Each query's arithmetic depends on its own row and the cache only. */
void rope_attend(const float* qkv, const float* cos_t, const float* sin_t, float* kc, float* vc,
                 const int64_t* slots, const int64_t* starts, const int64_t* lengths, int64_t B, int64_t L,
                 int64_t H, int64_t Hkv, int64_t D, int64_t P, float scale, float* out, float* scratch) {
  int64_t W = (H + 2 * Hkv) * D, half = D / 2, group = H / Hkv;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < lengths[b]; ++l) {
      int64_t pos = starts[b] + l;
      const float* row = qkv + (b * L + l) * W;
      const float* c = cos_t + pos * D; const float* s = sin_t + pos * D;
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
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l) {
      float* o = out + (b * L + l) * H * D;
      if (l >= lengths[b]) { for (int64_t i = 0; i < H * D; ++i) o[i] = 0.0f; continue; }
      int64_t pos = starts[b] + l;
      const float* row = qkv + (b * L + l) * W;
      const float* c = cos_t + pos * D; const float* s = sin_t + pos * D;
      for (int64_t h = 0; h < H; ++h) {
        float q[256]; /* D <= 256 (RowGemm.supports) */
        const float* qs = row + h * D;
        for (int64_t i = 0; i < half; ++i) {
          q[i] = (qs[i] * c[i] - qs[i + half] * s[i]) * scale;
          q[i + half] = (qs[i + half] * c[i + half] + qs[i] * s[i + half]) * scale;
        }
        const float* kb = kc + (slots[b] * Hkv + h / group) * P * D;
        const float* vb = vc + (slots[b] * Hkv + h / group) * P * D;
        float mx = -INFINITY;
        for (int64_t j = 0; j <= pos; ++j) {
          __m256 acc = _mm256_setzero_ps();
          for (int64_t i = 0; i < D; i += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kb + j * D + i), acc);
          float sc = hsum(acc);
          scratch[j] = sc;
          if (sc > mx) mx = sc;
        }
        float total = 0.0f;
        for (int64_t j = 0; j <= pos; ++j) { scratch[j] = expf(scratch[j] - mx); total += scratch[j]; }
        __m256 acc[32];
        for (int64_t i = 0; i < D / 8; ++i) acc[i] = _mm256_setzero_ps();
        for (int64_t j = 0; j <= pos; ++j) {
          __m256 p = _mm256_set1_ps(scratch[j]);
          for (int64_t i = 0; i < D / 8; ++i) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vb + j * D + i * 8), acc[i]);
        }
        __m256 inv = _mm256_set1_ps(1.0f / total);
        for (int64_t i = 0; i < D / 8; ++i) _mm256_storeu_ps(o + h * D + i * 8, _mm256_mul_ps(acc[i], inv));
      }
    }
}

/* A projection's panels: weights, int8 scales or NULL, panel stride in k-rows, element kind. */
typedef struct { const void* w; const float* sc; int64_t ks; int64_t kind; } lin_t;

static void gemm(const float* x, const lin_t* l, float* y, int64_t M, int64_t K, int64_t N) {
  switch (l->kind) {
    case 0: rowgemm_f32(x, (const float*)l->w, l->sc, y, M, K, l->ks, N); break;
    case 1: rowgemm_b16(x, (const uint16_t*)l->w, l->sc, y, M, K, l->ks, N); break;
    default: rowgemm_i8(x, (const int8_t*)l->w, l->sc, y, M, K, l->ks, N); break;
  }
}

static void add_into(float* x, const float* t, int64_t n) { for (int64_t i = 0; i < n; ++i) x[i] += t[i]; }

/* A whole cached forward of B rows x L new tokens, as LlamaForCausalLM._forward_native runs it
   op by op: embedding, per layer RMSNorm, QKV, rotary + cache write + attention, O, residual,
   RMSNorm, gate/up, SwiGLU, down, residual; then the final norm and the LM head for the rows
   logit_idx (indices into B*L). norms: 2 per layer + the final one; lins: QKV, O, gate/up,
   down per layer + the head. The same kernels in the same order, so the same bits. */
void forward(const int64_t* tokens, int64_t B, int64_t L, const float* embed, int64_t hid, int64_t inter,
             int64_t layers, const float* const* norms, const lin_t* lins, float* const* kc, float* const* vc,
             int64_t P, const float* cos_t, const float* sin_t, const int64_t* slots, const int64_t* starts,
             const int64_t* lengths, int64_t H, int64_t Hkv, int64_t D, float eps, float scale,
             const int64_t* logit_idx, int64_t n_logits, int64_t vocab, float* logits, float* scratch) {
  int64_t M = B * L, W = (H + 2 * Hkv) * D;
  float *x = scratch, *h = x + M * hid, *qkv = h + M * hid, *att = qkv + M * W, *tmp = att + M * H * D;
  float *gu = tmp + M * hid, *act = gu + M * 2 * inter, *sc = act + M * inter;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < hid; ++i) x[m * hid + i] = embed[tokens[m] * hid + i];
  for (int64_t l = 0; l < layers; ++l) {
    rmsnorm(x, norms[2 * l], h, M, hid, eps);
    gemm(h, &lins[4 * l], qkv, M, hid, W);
    rope_attend(qkv, cos_t, sin_t, kc[l], vc[l], slots, starts, lengths, B, L, H, Hkv, D, P, scale, att, sc);
    gemm(att, &lins[4 * l + 1], tmp, M, H * D, hid);
    add_into(x, tmp, M * hid);
    rmsnorm(x, norms[2 * l + 1], h, M, hid, eps);
    gemm(h, &lins[4 * l + 2], gu, M, hid, 2 * inter);
    swiglu(gu, act, M, inter);
    gemm(act, &lins[4 * l + 3], tmp, M, inter, hid);
    add_into(x, tmp, M * hid);
  }
  for (int64_t r = 0; r < n_logits; ++r)
    for (int64_t i = 0; i < hid; ++i) tmp[r * hid + i] = x[logit_idx[r] * hid + i];
  rmsnorm(tmp, norms[2 * layers], h, n_logits, hid, eps);
  gemm(h, &lins[4 * layers], logits, n_logits, hid, vocab);
}
"""
_FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
_ARGTYPES = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4


class Panels(NamedTuple):
    """A weight laid out for the kernel: (N/8, K + pad, 8), and int8's scale per output column."""

    weights: torch.Tensor
    scales: torch.Tensor | None


class RowGemm:
    """The compiled kernel: ``pack`` a weight once, then ``linear`` any number of rows."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._f32 = lib.rowgemm_f32
        self._b16 = lib.rowgemm_b16
        self._i8 = lib.rowgemm_i8
        for fn in (self._f32, self._b16, self._i8):
            fn.argtypes, fn.restype = _ARGTYPES, None
        self._rmsnorm = lib.rmsnorm
        self._rmsnorm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
        self._rmsnorm.restype = None
        self._swiglu = lib.swiglu
        self._swiglu.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        self._swiglu.restype = None
        self._attend = lib.rope_attend
        self._attend.argtypes = ([ctypes.c_void_p] * 8 + [ctypes.c_int64] * 6 + [ctypes.c_float]
                                 + [ctypes.c_void_p] * 2)
        self._attend.restype = None

    @staticmethod
    def supports(hidden: int, head_dim: int) -> bool:
        """Whether a model of this shape can run the norm and attention kernels."""
        return hidden % 8 == 0 and head_dim % 8 == 0 and head_dim <= 256

    @staticmethod
    def packable(weight: torch.Tensor) -> bool:
        return weight.dtype == torch.float32 and weight.dim() == 2 and weight.shape[0] % 8 == 0

    @staticmethod
    def pack(weight: torch.Tensor, int8: bool = False) -> Panels:
        """(N, K) float32 -> (N/8, K + pad, 8) panels: in bfloat16 when that loses nothing,
        else float32; or, ``int8``, rounded to 8 bits with a scale per output column (a quarter
        of float32's bytes; for a draft, whose numerics never reach the output).

        Each panel is padded by one cache line: panels K·8 elements apart sit a multiple of
        4 KB apart for the usual K, and a tile's streams would then share an L1 set.
        """
        n, k = weight.shape
        weight = weight.detach().float()
        scales = None
        if int8:
            scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
            weight = (weight / scales[:, None]).round().clamp(-127, 127)
        panels = weight.contiguous().view(n // 8, 8, k).transpose(1, 2)
        if int8:
            dtype = torch.int8
        else:
            as_b16 = panels.to(torch.bfloat16)
            dtype = torch.bfloat16 if torch.equal(as_b16.float(), panels) else torch.float32
        pad = 64 // (8 * dtype.itemsize)
        out = torch.zeros((n // 8, k + pad, 8), dtype=dtype)
        out[:, :k] = panels
        return Panels(out, scales)

    def linear(self, x: torch.Tensor, packed: Panels) -> torch.Tensor:
        """x (..., K) float32 -> (..., N) float32."""
        weights, scales = packed
        blocks, stride, _ = weights.shape
        k, n = x.shape[-1], blocks * 8
        x = x.contiguous()
        y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
        fn = {torch.bfloat16: self._b16, torch.int8: self._i8}.get(weights.dtype, self._f32)
        fn(x.data_ptr(), weights.data_ptr(), None if scales is None else scales.data_ptr(), y.data_ptr(),
           x.numel() // k, k, stride, n)
        return y


    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of contiguous float32 ``x``, row by row."""
        k = x.shape[-1]
        y = torch.empty_like(x)
        self._rmsnorm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // k, k, eps)
        return y

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(..., 2I) [gate | up] -> (..., I) silu(gate) * up."""
        inner = gate_up.shape[-1] // 2
        h = torch.empty((*gate_up.shape[:-1], inner), dtype=torch.float32)
        self._swiglu(gate_up.data_ptr(), h.data_ptr(), gate_up.numel() // (2 * inner), inner)
        return h

    def rope_attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, rows: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
        """qkv (B, L, (H + 2 Hkv) D) -> attention output (B, L, H D); writes K/V to the caches.

        ``rows`` (3, B) int64: each sequence's cache slot, first position and real tokens.
        """
        b, length, width = qkv.shape
        head_dim = width // (heads + 2 * kv_heads)
        positions = k_cache.shape[2]
        out = torch.empty((b, length, heads * head_dim), dtype=torch.float32)
        scratch = torch.empty(positions, dtype=torch.float32)
        self._attend(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                     rows[0].data_ptr(), rows[1].data_ptr(), rows[2].data_ptr(), b, length, heads, kv_heads,
                     head_dim, positions, 1.0 / head_dim ** 0.5, out.data_ptr(), scratch.data_ptr())
        return out


def check_bounds(tokens: torch.Tensor, vocab: int, rows: tuple[tuple[int, ...], ...], slots: int,
                 positions: int) -> None:
    """Raises ValueError unless every token id is in the vocabulary and every row's cache span
    lies inside the cache. The C side indexes with these unchecked: the engine's own limits
    (admission, K capped at the context's end) keep them in range, and this keeps a bug there
    an exception instead of a write past the cache."""
    slot_ids, starts, lengths = rows
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"token id outside the vocabulary of {vocab}")
    if len(slot_ids) != tokens.shape[0] or any(
            not (0 <= slot < slots and start >= 0 and 0 <= n <= tokens.shape[1] and start + n <= positions)
            for slot, start, n in zip(slot_ids, starts, lengths, strict=True)):
        raise ValueError(f"cache rows out of range: {rows} for {slots} slots x {positions} positions")


class _Lin(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("sc", ctypes.c_void_p), ("ks", ctypes.c_int64), ("kind", ctypes.c_int64)]


_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


class FusedForward:
    """A model's whole cached forward in one call of the kernel (``forward`` in the C source):
    the per-op path's kernels in the same order, without a Python call per op. Built once per
    model; holds references to every tensor the C side reads."""

    def __init__(self, kernel: RowGemm, *, embed: torch.Tensor, norms: list[torch.Tensor], panels: list[Panels],
                 hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> None:
        self._fn = kernel._lib.forward
        self._fn.restype = None
        self._keep = (embed, norms, panels, cos, sin)
        self.embed, self.cos, self.sin = embed, cos, sin
        self.norms = (ctypes.c_void_p * len(norms))(*[n.data_ptr() for n in norms])
        self.lins = (_Lin * len(panels))(*[
            _Lin(p.weights.data_ptr(), None if p.scales is None else p.scales.data_ptr(), p.weights.shape[1],
                 _KINDS[p.weights.dtype]) for p in panels])
        self.layers = (len(panels) - 1) // 4
        self.hidden, self.inter, self.heads, self.kv_heads, self.head_dim = hidden, inter, heads, kv_heads, head_dim
        self.vocab = panels[-1].weights.shape[0] * 8
        self.eps, self.scale = eps, 1.0 / head_dim ** 0.5

    def __call__(self, tokens: torch.Tensor, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                 rows: torch.Tensor, logit_idx: torch.Tensor) -> torch.Tensor:
        """tokens (B, L); rows (3, B) slots/starts/lengths; logit_idx (N,) into B*L -> logits (N, V)."""
        b, length = tokens.shape
        m, n = b * length, logit_idx.shape[0]
        if n and (int(logit_idx.min()) < 0 or int(logit_idx.max()) >= m):
            raise ValueError(f"logit rows out of range for {m} tokens")
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        size = m * (3 * self.hidden + width + self.heads * self.head_dim + 3 * self.inter) + k_cache[0].shape[2]
        scratch = torch.empty(max(size, n * self.hidden + 1), dtype=torch.float32)
        logits = torch.empty((n, self.vocab), dtype=torch.float32)
        tokens, logit_idx = tokens.contiguous(), logit_idx.contiguous()
        kc = (ctypes.c_void_p * self.layers)(*[t.data_ptr() for t in k_cache])
        vc = (ctypes.c_void_p * self.layers)(*[t.data_ptr() for t in v_cache])
        c_int, c_ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn(c_ptr(tokens.data_ptr()), c_int(b), c_int(length), c_ptr(self.embed.data_ptr()),
                 c_int(self.hidden), c_int(self.inter), c_int(self.layers), self.norms, self.lins, kc, vc,
                 c_int(k_cache[0].shape[2]), c_ptr(self.cos.data_ptr()), c_ptr(self.sin.data_ptr()),
                 c_ptr(rows[0].data_ptr()), c_ptr(rows[1].data_ptr()), c_ptr(rows[2].data_ptr()),
                 c_int(self.heads), c_int(self.kv_heads), c_int(self.head_dim), ctypes.c_float(self.eps),
                 ctypes.c_float(self.scale), c_ptr(logit_idx.data_ptr()), c_int(n), c_int(self.vocab),
                 c_ptr(logits.data_ptr()), c_ptr(scratch.data_ptr()))
        return logits


def _cpu_supported() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _compile(directory: Path) -> Path | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("rowgemm: no C compiler; float32 projections run F.linear")
        return None
    digest = hashlib.sha256("\0".join((_SOURCE, compiler, *_FLAGS)).encode()).hexdigest()[:16]
    target = directory / f"rowgemm-{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        source = Path(tmp) / "rowgemm.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / "rowgemm.so"
        result = subprocess.run([compiler, *_FLAGS, "-o", str(built), str(source), "-lm"], capture_output=True,
                                text=True, timeout=120, check=False)
        if result.returncode != 0:
            log.warning("rowgemm: compiling failed (%s); float32 projections run F.linear: %s", compiler,
                        result.stderr.strip()[-500:])
            return None
        os.replace(built, target)  # atomic: a concurrent worker sees the whole file or none
    return target


@functools.cache
def load() -> RowGemm | None:
    """The kernel, compiled (or found compiled) on this machine; None where it cannot run."""
    if os.environ.get("SPECGATE_ROWGEMM", "1") == "0" or not _cpu_supported():
        return None
    directory = Path(os.environ.get("SPECGATE_ROWGEMM_DIR") or Path.home() / ".cache/specgate/rowgemm")
    try:
        path = _compile(directory)
        return None if path is None else RowGemm(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("rowgemm: unavailable (%s); float32 projections run F.linear", exc)
        return None
