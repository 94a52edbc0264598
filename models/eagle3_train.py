"""Training the EAGLE-3 head on the CPU with ``speculators``' own model and loss (``Eagle3DraftModel``:
training-time test over ``ttt_steps``, the KL divergence to the target's distribution over the draft
vocabulary, its per-step accuracies), in a loop of our own: speculators' trainer (``speculators.train``)
is built around torch.distributed and CUDA devices and its data loaders read a vLLM server's hidden-state
dumps (docs/eagle3.md says what runs where).

One sequence a forward (no packing: documents never attend across), gradients accumulated to
``batch_tokens`` a step, AdamW with warmup and cosine decay, checkpoints every few minutes; a rerun with
the same settings resumes where the last one stopped, and data order is a function of (seed, epoch).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from speculators.losses.utils import resolve_loss_config
from speculators.models.eagle3 import Eagle3DraftModel

from models.checkpoints import load_checkpoint, save_checkpoint
from models.eagle3_data import CachedSequence

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainSettings:
    tokens: int  # training tokens (the data size of this run)
    epochs: float = 4.0
    lr: float = 1e-3
    warmup: int = 20
    batch_tokens: int = 2048
    ttt_steps: int = 4
    ttt_step_loss_decay: float = 0.8
    seed: int = 0
    checkpoint_minutes: float = 5.0


def sequence_inputs(seq: CachedSequence) -> dict[str, torch.Tensor]:
    """speculators' ``shift_batch`` for one sequence: column t holds (g_t, x_{t+1}) and the target's last
    hidden state at t+1 (which predicts x_{t+2}); the loss counts where x_{t+2} is a reply token."""
    n = len(seq.tokens)
    loss = torch.arange(n) >= seq.loss_from  # position t's next token is the reply's
    return {"input_ids": seq.tokens[1:][None], "hidden_states": seq.states[:-1].float()[None],
            "verifier_last_hidden_states": seq.last[1:].float()[None], "loss_mask": loss[1:][None],
            "document_ids": torch.zeros(1, n - 1, dtype=torch.long),
            "position_ids": torch.arange(1, n)[None]}


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def accuracy_totals(metrics: dict[str, torch.Tensor], steps: int, into: dict[str, float]) -> None:
    for j in range(steps):
        for kind in ("full_acc", "cond_acc"):
            for part in ("sum", "total"):
                key = f"{kind}_{j}_{part}"
                into[key] = into.get(key, 0.0) + float(metrics[key])


def accuracies(totals: dict[str, float], steps: int) -> dict[str, list[float]]:
    """Per TTT step: ``full_acc`` (the head's argmax equals the target's, teacher-forced) and ``cond_acc``
    (the same, among positions whose earlier steps were all right: the acceptance of a chain's j-th draft)."""
    return {kind: [round(totals[f"{kind}_{j}_sum"] / max(1.0, totals[f"{kind}_{j}_total"]), 4) for j in range(steps)]
            for kind in ("full_acc", "cond_acc")}


class HeadTrainer:
    def __init__(self, model: Eagle3DraftModel, settings: TrainSettings, data: list[CachedSequence],
                 work: Path) -> None:
        self.model, self.settings, self.data, self.work = model, settings, data, work
        self.loss_config = resolve_loss_config("kl_div", "eager")  # "fused" needs Triton (a GPU)
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
        data_tokens = sum(len(s.tokens) - 1 for s in data)
        self.per_epoch = max(1, math.ceil(data_tokens / settings.batch_tokens))
        self.total = max(1, round(self.per_epoch * settings.epochs))
        self.step, self.position, self.spent_s = 0, 0, 0.0
        self._order: tuple[int, list[int]] = (-1, [])

    def order(self, epoch: int) -> list[int]:
        """The epoch's sequence order, a function of (seed, epoch): shuffled once an epoch, not per sequence."""
        if self._order[0] != epoch:
            ids = list(range(len(self.data)))
            random.Random(self.settings.seed * 1000 + epoch).shuffle(ids)
            self._order = (epoch, ids)
        return self._order[1]

    def forward(self, seq: CachedSequence) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        s = self.settings
        _, loss, metrics = self.model(**sequence_inputs(seq), ttt_steps=s.ttt_steps,
                                      ttt_step_loss_decay=s.ttt_step_loss_decay, loss_config=self.loss_config)
        return loss, metrics

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over the next ``batch_tokens`` of the epoch order (``position`` counts
        sequences taken since the run began, so a resumed run takes the same ones)."""
        s = self.settings
        lr = lr_at(self.step, self.total, s.lr, s.warmup)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        taken, loss_sum, totals = 0, 0.0, dict[str, float]()
        while taken < s.batch_tokens:
            epoch, index = divmod(self.position, len(self.data))
            seq = self.data[self.order(epoch)[index]]
            self.position += 1
            loss, metrics = self.forward(seq)
            weight = (len(seq.tokens) - 1) / s.batch_tokens
            (loss * weight).backward()  # type: ignore[no-untyped-call]
            taken += len(seq.tokens) - 1
            loss_sum += float(loss.detach()) * weight
            accuracy_totals(metrics, s.ttt_steps, totals)
        torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], 1.0)
        self.opt.step()
        self.step += 1
        return {"step": self.step, "of": self.total, "loss": round(loss_sum, 4), "lr": lr, "tokens": taken,
                **accuracies(totals, s.ttt_steps)}

    @torch.no_grad()
    def evaluate(self, data: list[CachedSequence]) -> dict[str, Any]:
        """Teacher-forced accuracies per TTT step on held-out sequences, overall and per class."""
        self.model.eval()  # type: ignore[no-untyped-call]
        by_class: dict[str, dict[str, float]] = {}
        for seq in data:
            _, metrics = self.forward(seq)
            accuracy_totals(metrics, self.settings.ttt_steps, by_class.setdefault("all", {}))
            accuracy_totals(metrics, self.settings.ttt_steps, by_class.setdefault(seq.cls, {}))
        return {cls: accuracies(t, self.settings.ttt_steps) for cls, t in by_class.items()}

    def run(self, deadline: float, log: Path) -> bool:
        """Train to the schedule's end or ``deadline`` (time.monotonic); True when the schedule is done."""
        last_save = time.monotonic()
        while self.step < self.total and time.monotonic() < deadline:
            t0 = time.perf_counter()
            record = self.train_step()
            record["tok_s"] = round(record["tokens"] / (time.perf_counter() - t0), 1)
            with log.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if self.step % 10 == 0 or self.step == self.total:
                print(json.dumps(record), flush=True)
            if time.monotonic() - last_save > 60 * self.settings.checkpoint_minutes:
                self.spent_s += time.monotonic() - last_save
                last_save = time.monotonic()
                self.save()
        self.spent_s += time.monotonic() - last_save
        self.save()
        return self.step >= self.total

    def save(self) -> None:
        path = self.work / CHECKPOINT
        state = {"model": {k: v for k, v in self.model.state_dict().items() if not k.startswith(
                     ("embed_tokens", "verifier_"))},
                 "opt": self.opt.state_dict(), "step": self.step, "position": self.position,
                 "spent_s": self.spent_s, "settings": asdict(self.settings)}
        save_checkpoint(state, path)

    def load(self) -> bool:
        state = load_checkpoint(self.work / CHECKPOINT, "settings", asdict(self.settings))
        if state is None:
            return False
        self.model.load_state_dict(state["model"], strict=False)
        self.opt.load_state_dict(state["opt"])
        self.step, self.position, self.spent_s = int(state["step"]), int(state["position"]), float(state["spent_s"])
        return True
