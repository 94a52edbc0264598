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
checks it at start-up, and ``tests/unit/engine/test_rowgemm.py`` here).

The C source is compiled with the system C compiler (``cc``, or ``$CC``) into
``~/.cache/specgate/rowgemm`` (``SPECGATE_ROWGEMM_DIR``) once per source and compiler, about a
second; a CPU without AVX2/FMA, a missing compiler or a failed build leaves ``load()`` None, and
the model runs ``F.linear`` as before. ``SPECGATE_ROWGEMM=0`` disables it. Whether a worker
serves with it is a measured choice (``workers/engines/embedded/measurement/measure.py``), not this module's.
A whole forward in one call into the library: ``fused_forward.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

# The C sources, next to this module (rowgemm.c includes the pool's header); their text is part
# of the build key (_compile).
_SOURCES = {name: (Path(__file__).parent / name).read_text()
            for name in ("rowgemm.c", "rowgemm_pool.h", "quant_blocks.h")}
# -ffp-contract=off: a multiply and an add stay two roundings (quant_blocks.h: the GGUF's blocks
# widen to exactly the float32 conversion's weights only so); every FMA in the source is written
# out. -mf16c: the blocks' fp16 scales (every AVX2 CPU has F16C).
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-shared", "-fPIC", "-pthread")
_ARGTYPES = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4


# GGUF block types the kernels read as weights, by the kind the C source names them with.
BLOCK_KINDS = {"q4_1": 3, "q8_0": 4}


class Panels(NamedTuple):
    """A weight laid out for the kernel: (N/8, K + pad, 8), and K, the inputs it takes; or, with
    ``blocks`` ("q4_1", "q8_0"), the GGUF's blocks in panels of 8 columns (uint8 (N/8, bytes a
    panel): kernels/blocks.py lays them out, quant_blocks.h reads them)."""

    weights: torch.Tensor
    k: int
    blocks: str | None = None

    @property
    def kind(self) -> int:
        """The element kind the C source dispatches on (float32 FMAs; dot products are kind 2)."""
        if self.blocks is not None:
            return BLOCK_KINDS[self.blocks]
        return 1 if self.weights.dtype == torch.bfloat16 else 0


class RowGemm:
    """The compiled kernel: ``pack`` a weight once, then ``linear`` any number of rows."""

    def __init__(self, lib: ctypes.CDLL, build: str = "") -> None:
        self._lib = lib
        # Which source, compiler and flags built it: costs measured on another build are stale.
        self.build = build
        self._f32 = lib.rowgemm_f32
        self._b16 = lib.rowgemm_b16
        self._dot = lib.rowgemm_dot
        for fn in (self._f32, self._b16, self._dot):
            fn.argtypes, fn.restype = _ARGTYPES, None
        self._quant = lib.rowgemm_quant
        self._quant.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] + [ctypes.c_int64] * 4
        self._quant.restype = None
        self._q8_rows = lib.q8_0_rows
        self._q8_rows.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int64,
                                                                              ctypes.c_void_p]
        self._q8_rows.restype = None
        lib.rowgemm_dot_products.restype = ctypes.c_int64
        # Whether this build has bfloat16 products (AVX512-BF16): bfloat16 panels times inputs
        # rounded to bfloat16, summed in float32 (``linear(..., dot=True)``, kind 2 in the source).
        self.dot_products = bool(lib.rowgemm_dot_products())
        self._rmsnorm = lib.rmsnorm
        self._rmsnorm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
        self._rmsnorm.restype = None
        self._swiglu = lib.swiglu
        self._swiglu.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        self._swiglu.restype = None
        self._attend = lib.rope_attend
        self._attend.argtypes = ([ctypes.c_void_p] * 9 + [ctypes.c_int64] * 6 + [ctypes.c_float]
                                 + [ctypes.c_void_p] * 2)
        self._attend.restype = None
        self._set_threads = lib.rowgemm_set_threads
        self._set_threads.argtypes, self._set_threads.restype = [ctypes.c_int], ctypes.c_int
        self.threads = 1
        self._score_rows = lib.rowgemm_score_rows
        self._score_rows.argtypes, self._score_rows.restype = [], ctypes.c_int64

    def set_threads(self, threads: int) -> None:
        """Projections split their output columns, and attention its query tiles, across
        ``threads`` (``workers.threads``; 1 at load). Each output is still one thread's FMA
        chain: the split changes no bit (tests/unit/engine/test_rowgemm.py)."""
        self.threads = self._set_threads(threads)

    @property
    def score_rows(self) -> int:
        """Attention's scratch: rows of scores, one tile per part. Asked of the library each
        time: its thread pool is one per loaded library, shared by every RowGemm on it (a second
        load() after a cache_clear), so a count kept here could be stale and the scratch short."""
        rows: int = self._score_rows()
        return rows

    @staticmethod
    def supports(hidden: int, head_dim: int) -> bool:
        """Whether a model of this shape can run the norm and attention kernels."""
        return hidden % 8 == 0 and head_dim % 8 == 0 and head_dim <= 256

    @staticmethod
    def packable(weight: torch.Tensor) -> bool:
        return weight.dtype == torch.float32 and weight.dim() == 2 and weight.shape[0] % 8 == 0

    @staticmethod
    def pack(weight: torch.Tensor) -> Panels:
        """(N, K) float32 -> (N/8, K + pad, 8) panels: in bfloat16 when that loses nothing (the
        checkpoints are bfloat16), half the bytes to stream, else float32.

        Each panel is padded by one cache line: panels K·8 elements apart sit a multiple of
        4 KB apart for the usual K, and a tile's streams would then share an L1 set.
        """
        n, k = weight.shape
        weight = weight.detach().float()
        panels = weight.contiguous().view(n // 8, 8, k).transpose(1, 2)
        dtype = torch.bfloat16 if torch.equal(panels.to(torch.bfloat16).float(), panels) else torch.float32
        pad = 64 // (8 * dtype.itemsize)
        if dtype == torch.bfloat16:
            # In pairs of k (see PAIR_TILE in the source): (N/8, K/2, 8, 2), padded to even K.
            even = k + k % 2
            pairs = torch.zeros((n // 8, even, 8), dtype=dtype)
            pairs[:, :k] = panels
            out = torch.zeros((n // 8, even + pad, 8), dtype=dtype)
            out[:, :even] = pairs.view(n // 8, even // 2, 2, 8).transpose(2, 3).reshape(n // 8, even, 8)
            return Panels(out, k)
        out = torch.zeros((n // 8, k + pad, 8), dtype=dtype)
        out[:, :k] = panels
        return Panels(out, k)

    def can_dot(self, packed: Panels) -> bool:
        """Whether these panels can multiply as bfloat16 products here (AVX512-BF16, bfloat16 panels)."""
        return self.dot_products and packed.weights.dtype == torch.bfloat16

    def linear(self, x: torch.Tensor, packed: Panels, dot: bool = False) -> torch.Tensor:
        """x (..., K) float32 -> (..., N) float32. ``dot``: bfloat16 products (the inputs rounded to
        bfloat16; bfloat16 panels, where ``dot_products``), else float32 FMAs of the same weights."""
        weights = packed.weights
        blocks, stride = weights.shape[:2]  # for block weights the stride is in bytes
        k, n = x.shape[-1], blocks * 8
        if k != packed.k:  # the C side would read past each row of x, or short of the weight
            raise ValueError(f"projection takes {packed.k} inputs, got {k}")
        x = x.contiguous()
        y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
        if packed.blocks is not None:
            if dot:
                raise ValueError("block weights multiply in float32 only")
            self._quant(x.data_ptr(), weights.data_ptr(), packed.kind, y.data_ptr(), x.numel() // k, k, stride, n)
            return y
        if dot and not self.can_dot(packed):
            raise ValueError("bfloat16 products need AVX512-BF16 and bfloat16 panels")
        fn = self._dot if dot else self._b16 if weights.dtype == torch.bfloat16 else self._f32
        fn(x.data_ptr(), weights.data_ptr(), y.data_ptr(), x.numel() // k, k, stride, n)
        return y

    def embedding_rows(self, table: Panels, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape, checked in range) of a Q8_0 panel weight (a tied embedding)
        as float32 (..., K): the values its products use."""
        if table.blocks != "q8_0":
            raise ValueError("embedding rows are read from Q8_0 panels")
        flat = ids.reshape(-1).to(torch.long).contiguous()
        rows = table.weights.shape[0] * 8
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows):
            raise ValueError(f"token id outside the vocabulary of {rows}")
        out = torch.empty((flat.numel(), table.k), dtype=torch.float32)
        self._q8_rows(table.weights.data_ptr(), table.weights.shape[1], table.k, flat.data_ptr(), flat.numel(),
                      out.data_ptr())
        return out.view(*ids.shape, table.k)

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
        # Padded rows here (sequence b's tokens from row b * length); padding rows' outputs 0.
        out = torch.zeros((b, length, heads * head_dim), dtype=torch.float32)
        offsets = torch.arange(0, b * length, length, dtype=torch.long)
        scratch = torch.empty(self.score_rows * positions, dtype=torch.float32)
        self._attend(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                     rows[0].data_ptr(), rows[1].data_ptr(), rows[2].data_ptr(), offsets.data_ptr(), b, length,
                     heads, kv_heads, head_dim, positions, 1.0 / head_dim ** 0.5, out.data_ptr(), scratch.data_ptr())
        return out




def _cpu_supported() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """This CPU's model name and flags (/proc/cpuinfo's first processor)."""
    name, flags = "", frozenset[str]()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                return name, frozenset(value.split())
    return name, flags


def wide_tiles() -> bool:
    """Whether the bfloat16 tiles are built 16 columns wide here (AVX-512)."""
    return bool(_wide_flags())


def _wide_flags() -> tuple[str, ...]:
    """-mavx512f where this CPU has AVX-512: the bfloat16 tiles then run 16 columns wide, the
    same FMA chains (the same bits) in half the instructions (a build with ``WIDE_TILES=0``
    keeps the 8-wide ones: bench.kernels compares the two). -mavx512bf16 too where it has
    AVX512-BF16: the kernels then also build bfloat16 products (``RowGemm.dot_products``)."""
    flags = _cpuinfo()[1]
    if "avx512f" not in flags:
        return ()
    return ("-mavx512f", "-mavx512bf16") if "avx512_bf16" in flags else ("-mavx512f",)


def _compile(directory: Path, defines: tuple[str, ...] = ()) -> Path | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("rowgemm: no C compiler; float32 projections run F.linear")
        return None
    flags = (*_FLAGS, *_wide_flags(), *(f"-D{d}" for d in defines))
    digest = hashlib.sha256("\0".join((*_SOURCES.values(), compiler, *flags)).encode()).hexdigest()[:16]
    target = directory / f"rowgemm-{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        for name, text in _SOURCES.items():
            (Path(tmp) / name).write_text(text)
        source = Path(tmp) / "rowgemm.c"
        built = Path(tmp) / "rowgemm.so"
        result = subprocess.run([compiler, *flags, "-o", str(built), str(source), "-lm"], capture_output=True,
                                text=True, timeout=120, check=False)
        if result.returncode != 0:
            log.warning("rowgemm: compiling failed (%s); float32 projections run F.linear: %s", compiler,
                        result.stderr.strip()[-500:])
            return None
        os.replace(built, target)  # atomic: a concurrent worker sees the whole file or none
    return target


def set_threads(threads: int) -> None:
    """The kernels' threads, where they run (``RowGemm.set_threads``)."""
    kernel = load()
    if kernel is not None:
        kernel.set_threads(threads)


# The builds load() chooses between by measurement: software prefetching of the weight stream
# 12 KB ahead (1.3x on Zen 3, whose prefetcher alone left a tile waiting), or none (15-30%
# faster on a Xeon with AMX, where the prefetch instructions only take load slots). Both give
# the same bits: prefetching moves data, not arithmetic.
PREFETCH_CHOICES = (("PREFETCH_BYTES=12288",), ("PREFETCH_BYTES=0",))


@functools.cache
def load() -> RowGemm | None:
    """The kernel, compiled (or found compiled) on this machine, in the build that measured
    fastest here (``PREFETCH_CHOICES``); None where it cannot run."""
    if not _enabled():
        return None
    directory = _build_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        choice = directory / f"choice-{_choice_key()}.json"
        with (directory / "choice.lock").open("a") as lock:
            # Sibling workers starting together: one measures, the others read its answer.
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                defines = _read_choice(choice)
                if defines is None:
                    defines = _measure_choice(choice)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    except OSError as exc:
        log.warning("rowgemm: could not record the build choice (%s); serving the first build", exc)
        defines = PREFETCH_CHOICES[0]
    return load_variant(defines)


def _choice_key() -> str:
    name, flags = _cpuinfo()
    material = "\0".join((*_SOURCES.values(), *_FLAGS, *_wide_flags(), name, *sorted(flags)))
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def _read_choice(path: Path) -> tuple[str, ...] | None:
    try:
        defines = tuple(json.loads(path.read_text())["defines"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return defines if defines in PREFETCH_CHOICES else None


def _measure_choice(path: Path) -> tuple[str, ...]:
    """Times each build of ``PREFETCH_CHOICES`` on 1 and 4 rows through 28 MB of bfloat16
    weights (the demo target's projections' shapes, more than a core's L2), taking turns, and
    records the fastest (median of 21 passes each: a noisy neighbour's second lands on both;
    about a second with the packing, once per machine)."""
    kernels = [k for k in (load_variant(d) for d in PREFETCH_CHOICES) if k is not None]
    if len(kernels) < len(PREFETCH_CHOICES):
        return PREFETCH_CHOICES[0]
    gen = torch.Generator().manual_seed(0)
    shapes = [(1280, 384), (384, 384), (2048, 384), (384, 1024)] * 8 + [(4096, 384)]
    weights = [torch.randn(n, k, generator=gen).to(torch.bfloat16).float() for n, k in shapes]
    panels = [kernels[0].pack(w) for w in weights]  # one layout for every build
    inputs = {(m, k): torch.randn(m, k, generator=gen) for m in (1, 4) for k in (384, 1024)}
    passes: list[list[float]] = [[] for _ in kernels]
    for _ in range(21):
        for i, kernel in enumerate(kernels):
            started = time.perf_counter()
            for m in (1, 4):
                for p, (_, k) in zip(panels, shapes, strict=True):
                    kernel.linear(inputs[(m, k)], p)
            passes[i].append(time.perf_counter() - started)
    best = [statistics.median(t) for t in passes]
    chosen = PREFETCH_CHOICES[best.index(min(best))]
    ms = {" ".join(d): round(1000 * t, 3) for d, t in zip(PREFETCH_CHOICES, best, strict=True)}
    log.info("rowgemm: %s measured fastest here (ms per pass: %s)", " ".join(chosen), ms)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"defines": list(chosen), "pass_ms": ms}))
    os.replace(tmp, path)
    return chosen


def chosen_build() -> dict[str, object] | None:
    """What ``load()`` chose and the passes it timed (published with the cost model)."""
    kernel = load()
    if kernel is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        return {"build": kernel.build, **json.loads((_build_dir() / f"choice-{_choice_key()}.json").read_text())}
    return {"build": kernel.build}


def _enabled() -> bool:
    return os.environ.get("SPECGATE_ROWGEMM", "1") != "0" and _cpu_supported()


def _build_dir() -> Path:
    return Path(os.environ.get("SPECGATE_ROWGEMM_DIR") or Path.home() / ".cache/specgate/rowgemm")


def load_variant(defines: tuple[str, ...]) -> RowGemm | None:
    """The kernel built with extra preprocessor ``defines`` (``NAME=VALUE``): ``load()``'s
    candidates, and benchmarks of what one of its choices buys (bench.kernels). Its panels are
    laid out as ``load()``'s."""
    if not _enabled():
        return None
    directory = _build_dir()
    try:
        path = _compile(directory, defines)
        return None if path is None else RowGemm(ctypes.CDLL(str(path)), path.stem)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("rowgemm: unavailable (%s); float32 projections run F.linear", exc)
        return None
