"""The Llama layers with no projection: RMSNorm, rotary position embedding in the Hugging Face
rotate-half layout, and row-invariant attention (llama.py builds the model from these and ``projections``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.engines.embedded.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotary_tables(cfg: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (max_pos, head_dim) in the Hugging Face rotate-half layout."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, L, H, D); cos/sin: (B, L, 1, D)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attend_per_query(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention computed for every query as if it were decoded alone.

    q (B, H, L, D); keys/values (B, Hkv, S, D); mask (B, 1, L, S), True where allowed.
    The fused kernel picks its blocking from the number of queries, so a token scored inside
    a (K+1)-token verification would round differently from the same token decoded alone, and
    greedy speculative output would drift from plain output at near-ties (often, in bfloat16).
    Feeding it one query per call row makes each row's arithmetic independent of its
    neighbours; the key span is padded to whole KEY_BLOCKs (masked) so that it also does not
    depend on how far the longest row in the call reaches.
    """
    b, _, length, _ = q.shape
    if length == 1:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    if b == 1:
        # The L queries become L batch rows over the same keys (expand is a view, not a copy).
        rows = F.scaled_dot_product_attention(
            q.transpose(0, 2), keys.expand(length, -1, -1, -1), values.expand(length, -1, -1, -1),
            attn_mask=mask.transpose(0, 2), enable_gqa=True)
        return rows.transpose(0, 2)
    # Several sequences: one call per query column keeps every row a single-query problem
    # without copying each sequence's keys once per query.
    return torch.cat([F.scaled_dot_product_attention(q[:, :, i:i + 1], keys, values, attn_mask=mask[:, :, i:i + 1],
                                                     enable_gqa=True) for i in range(length)], dim=2)
