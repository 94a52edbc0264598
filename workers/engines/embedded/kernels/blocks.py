"""The GGUF's own blocks laid out for the kernels (quant_blocks.h): Q4_1 projections and the Q8_0
tied embedding, read as stored, never widened to a float32 copy.

A GGUF row of K weights is K/32 blocks: Q4_1's are 20 bytes (fp16 d, fp16 m, 16 bytes whose low
nibbles are weights 0-15 and high nibbles 16-31; w = d q + m), Q8_0's 34 (fp16 d, 32 signed
bytes; w = d q). ``pack_blocks`` regroups whole rows into panels of 8 output columns, the layout
the float32 kernel streams, with each block's 8 scales first (quant_blocks.h spells it out); a
block whose scale or minimum is not finite is refused, at install and at load, naming the weight.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from workers.engines.embedded.kernels.rowgemm import Panels

# Where models/gguf_panels.py writes a converted model's panels (inside its directory: vLLM reads
# only the top level's safetensors), and the layout they are in (bump with quant_blocks.h's).
PANELS_DIR = "gguf-panels"
PANELS_FILE = "model.safetensors"
LAYOUT = "specgate-block-panels/1"

# bytes per 32-weight block: in the GGUF, and in a panel of 8 columns (quant_blocks.h)
GGUF_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
PANEL_BLOCK_BYTES = {"q4_1": 160, "q8_0": 272}
BLOCK = 32

U8 = npt.NDArray[np.uint8]


class BlockError(ValueError):
    """Blocks the kernels cannot take; the message names the weight."""


def block_rows(raw: U8, kind: str, name: str) -> tuple[int, int]:
    """(N, K) of GGUF block rows ``raw`` (N, K/32 * block bytes), checked."""
    if kind not in GGUF_BLOCK_BYTES:
        raise BlockError(f"{name}: {kind} blocks are not read by the kernels (they read {sorted(GGUF_BLOCK_BYTES)})")
    size = GGUF_BLOCK_BYTES[kind]
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % size:
        raise BlockError(f"{name}: {raw.dtype} {raw.shape} is not rows of {kind} blocks ({size} bytes each)")
    n, k = raw.shape[0], raw.shape[1] // size * BLOCK
    if n % 8:
        raise BlockError(f"{name}: {n} output rows, not a multiple of 8 (the kernels' panels)")
    return n, k


def _check_scales(fields: U8, kind: str, name: str, unit: str) -> None:
    """Every block's scale (and Q4_1's minimum) finite: a NaN or infinite one is a corrupt file,
    refused rather than served as NaN logits. ``fields`` (units, blocks, bytes): each block's fp16
    scale fields, in the order Q4_1 keeps d and m (GGUF: d, m; panels: 8 d, then 8 m)."""
    scales = np.ascontiguousarray(fields).view(np.float16)
    bad = ~np.isfinite(scales)
    if bad.any():
        where, block, which = (int(i[0]) for i in np.nonzero(bad))
        per = scales.shape[2] // (2 if kind == "q4_1" else 1)
        field = "minimum" if which >= per else "scale"
        raise BlockError(f"{name}: block {block} of {unit} {where} has a non-finite {field} "
                         f"({scales[where, block, which]}): corrupt file?")


def panel_bytes(raw: U8, kind: str, name: str) -> U8:
    """GGUF block rows (N, K/32 * bytes) as the kernels' panels: (N/8, K/32 * panel bytes) uint8."""
    n, k = block_rows(raw, kind, name)
    nb = k // BLOCK
    _check_scales(raw.reshape(n, nb, GGUF_BLOCK_BYTES[kind])[..., : 4 if kind == "q4_1" else 2], kind, name, "row")
    blocks = raw.reshape(n // 8, 8, nb, GGUF_BLOCK_BYTES[kind]).transpose(0, 2, 1, 3)  # (panel, block, col, bytes)
    if kind == "q4_1":
        scales = blocks[..., 0:4].reshape(n // 8, nb, 8, 2, 2).transpose(0, 1, 3, 2, 4)  # (.., d|m, col, 2 bytes)
        packed = blocks[..., 4:20]
        q = np.concatenate([packed & 0xF, packed >> 4], axis=-1)  # (.., col, k): weight k of the block
        q = q.transpose(0, 1, 3, 2).reshape(n // 8, nb, 16, 2, 8)  # (.., pair, k % 2, col)
        nibbles = (q[..., 0, :] | (q[..., 1, :] << 4)).astype(np.uint8)
        panel = np.concatenate([scales.reshape(n // 8, nb, 32), nibbles.reshape(n // 8, nb, 128)], axis=-1)
    else:
        scales = blocks[..., 0:2].reshape(n // 8, nb, 16)
        q = blocks[..., 2:34].transpose(0, 1, 3, 2).reshape(n // 8, nb, 256)  # (.., k, col)
        panel = np.concatenate([scales, q], axis=-1)
    return np.ascontiguousarray(panel.reshape(n // 8, nb * PANEL_BLOCK_BYTES[kind]))


def pack_blocks(raw: U8, kind: str, name: str) -> Panels:
    """GGUF block rows as the kernels' ``Panels``."""
    data = panel_bytes(raw, kind, name)
    return Panels(torch.from_numpy(data), data.shape[1] // PANEL_BLOCK_BYTES[kind] * BLOCK, kind)


def panels_from_bytes(data: torch.Tensor, kind: str, k: int, name: str) -> Panels:
    """Panels as ``panel_bytes`` wrote them (read back from a file), checked: the shape K implies,
    and every block's scale finite (a corrupt file is refused at load)."""
    if kind not in PANEL_BLOCK_BYTES:
        raise BlockError(f"{name}: {kind} blocks are not read by the kernels")
    if k <= 0 or k % BLOCK or data.dtype != torch.uint8 or data.dim() != 2 \
            or data.shape[1] != k // BLOCK * PANEL_BLOCK_BYTES[kind]:
        raise BlockError(f"{name}: {data.dtype} {tuple(data.shape)} is not {kind} panels of {k} inputs")
    array = data.numpy().reshape(data.shape[0], k // BLOCK, PANEL_BLOCK_BYTES[kind])
    _check_scales(array[..., : 32 if kind == "q4_1" else 16], kind, name, "panel")
    return Panels(data.contiguous(), k, kind)


def concat_rows(parts: list[U8]) -> U8:
    """Block rows of several weights with the same K stacked (a fused QKV or gate/up)."""
    return np.ascontiguousarray(np.concatenate(parts, axis=0))
