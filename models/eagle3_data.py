"""The EAGLE-3 head's training data: the target's own hidden states and next-token distributions,
computed once by the embedded engine's target and cached on disk in shards (resumable).

For every sequence (a distillation prompt and the target's reply, ``models/distill_generations/``;
or a window of the stdlib corpus) the target runs one causal forward in float32 and keeps, per
position t:
- the residual stream after ``layer_ids`` layers (vLLM's ``aux_hidden_states``: the state at
  ``idx + 1``, i.e. before layer ``idx`` runs), float16, concatenated low/mid/high: (T, 3 * hidden);
- the last layer's output before the final norm (speculators' ``verifier_last_hidden_states``: its trainer
  computes the target's distribution over the draft vocabulary from it, through the target's own norm
  and head rows), float16 (T, hidden).

A shard is a ``.pt`` file of up to ``SHARD_SEQUENCES`` sequences; a rerun computes only missing shards.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from models.distill_data import Generation
from workers.engines.embedded.llama import LlamaForCausalLM

SHARD_SEQUENCES = 32


@dataclass(frozen=True)
class Item:
    """One training sequence: its ids and which positions' next token is the target's reply
    (``loss_from``: positions t >= loss_from predict reply tokens)."""

    id: str
    cls: str
    tokens: list[int]
    loss_from: int


def generation_items(generations: Sequence[Generation]) -> list[Item]:
    return [Item(g.id + f"@{g.temperature}", g.cls, [*g.prompt, *g.reply], len(g.prompt) - 1) for g in generations]


def corpus_items(stream: Sequence[int], length: int, count: int) -> list[Item]:
    """``count`` windows of ``length`` ids from a token stream (the stdlib's sources): every position is
    a training position (there is no prompt)."""
    step = max(1, (len(stream) - length) // max(1, count))
    return [Item(f"corpus-{i}", "corpus", list(stream[i * step:i * step + length]), 0) for i in range(count)
            if i * step + length <= len(stream)]


@torch.no_grad()
def target_states(model: LlamaForCausalLM, tokens: list[int], layer_ids: Sequence[int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One causal forward (float32): the aux states (T, len(layer_ids) * hidden) and the last layer's
    output before the final norm (T, hidden)."""
    ids = torch.tensor([tokens])
    length = len(tokens)
    cos = model.rope_cos[:length][None, :, None]
    sin = model.rope_sin[:length][None, :, None]
    x = model.model.embed_tokens(ids)
    aux: list[torch.Tensor] = []
    for i, layer in enumerate(model.model.blocks()):
        if i in layer_ids:
            aux.append(x[0].clone())
        x = layer.forward_train(x, cos, sin)
    return torch.cat(aux, dim=-1), x[0]


def shard_path(work: Path, index: int) -> Path:
    return work / f"shard-{index:04d}.pt"


def build_shards(model: LlamaForCausalLM, items: Sequence[Item], layer_ids: Sequence[int], work: Path,
                 deadline: float = float("inf")) -> int:
    """Computes the missing shards of ``items`` into ``work``; returns how many shards exist. Stops
    (resumable) once ``deadline`` (time.monotonic) has passed."""
    work.mkdir(parents=True, exist_ok=True)
    shards = (len(items) + SHARD_SEQUENCES - 1) // SHARD_SEQUENCES
    for s in range(shards):
        path = shard_path(work, s)
        if path.is_file():
            continue
        if time.monotonic() > deadline:
            return s
        started = time.perf_counter()
        part = items[s * SHARD_SEQUENCES:(s + 1) * SHARD_SEQUENCES]
        states, last = [], []
        for item in part:
            aux, final = target_states(model, item.tokens, layer_ids)
            if not (torch.isfinite(aux).all() and torch.isfinite(final).all()) or max(
                    float(aux.abs().max()), float(final.abs().max())) > 60000:
                raise ValueError(f"{item.id}: hidden states out of float16 range")
            states.append(aux.to(torch.float16))
            last.append(final.to(torch.float16))
        tmp = path.with_suffix(".tmp")
        torch.save({"ids": [i.id for i in part], "classes": [i.cls for i in part],
                    "tokens": [torch.tensor(i.tokens, dtype=torch.int32) for i in part],
                    "loss_from": [i.loss_from for i in part], "states": states, "last": last,
                    "layer_ids": list(layer_ids)}, tmp)
        tmp.rename(path)
        tokens = sum(len(i.tokens) for i in part)
        print(json.dumps({"shard": s, "of": shards, "tokens": tokens,
                          "tok_per_s": round(tokens / (time.perf_counter() - started), 1)}), flush=True)
    return shards


@dataclass(frozen=True)
class CachedSequence:
    """One cached sequence, as the trainer reads it."""

    id: str
    cls: str
    tokens: torch.Tensor  # (T,) int64
    loss_from: int
    states: torch.Tensor  # (T, 3 * hidden) float16: the aux states
    last: torch.Tensor  # (T, hidden) float16: the last layer's output, before the final norm


def read_shards(work: Path, count: int) -> Iterator[CachedSequence]:
    for s in range(count):
        raw = torch.load(shard_path(work, s), weights_only=True)
        for j, ident in enumerate(raw["ids"]):
            yield CachedSequence(ident, raw["classes"][j], raw["tokens"][j].long(), raw["loss_from"][j],
                                 raw["states"][j], raw["last"][j])
