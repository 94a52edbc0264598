"""The draft distillation's training loop, its loss, checkpoints and the greedy-agreement evaluation.

``Trainer`` owns the student, the optimizer and the teacher-target cache's ``done`` flags; a step's data is a
function of (seed, step) only (``models.distill_data.epoch_order``), and a checkpoint holds everything else
(weights, AdamW state, step, done flags, time spent), so a resumed run continues exactly where an
uninterrupted one would have been.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from models.checkpoints import load_checkpoint, save_checkpoint
from models.distill_data import Generation, TargetCache, Teacher, epoch_order
from models.draft_format import DraftLlama

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class Settings:
    """What a training run depends on. The fields up to ``gen_repeat`` decide the data and the schedule; a
    work directory refuses to resume under other values of them."""

    seed: int = 0
    seq_len: int = 512
    batch: int = 8
    draft_vocab: int = 8192
    top_k: int = 32
    epochs: int = 3
    lr: float = 2e-3
    warmup: int = 100
    gen_repeat: int = 4
    # Not part of the recipe: how this run spends its time.
    autocast: bool = True  # bfloat16 autocast for the student (fast only with avx512_bf16 / AMX)
    log_every: int = 10
    checkpoint_minutes: float = 5.0

    def recipe(self) -> dict[str, Any]:
        fields = asdict(self)
        return {k: fields[k] for k in ("seed", "seq_len", "batch", "draft_vocab", "top_k", "epochs", "lr",
                                       "warmup", "gen_repeat")}


@dataclass
class Data:
    """Training rows (ids, (N, seq_len + 1), generation rows first) and the head's subset (ascending ids)."""

    rows: npt.NDArray[np.int32]
    subset: npt.NDArray[np.int64]
    gen_rows: int
    corpus_rows: int


def distill_loss(student_logits: torch.Tensor, top_idx: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Forward KL at temperature 1 from the teacher's cached top-k (subset rows ``top_idx``, log-probabilities
    ``top_logp`` over the whole vocabulary) to the student's softmax over its head, per position, averaged.

    sum_j p_j (log p_j - log q_j) over the cached entries: the teacher mass outside them (the rest of the
    vocabulary, "other") is a constant the student cannot match, so it weighs nothing; a position where the
    teacher puts little mass on the subset weighs little."""
    log_q = F.log_softmax(student_logits.float(), dim=-1).gather(-1, top_idx)
    p = top_logp.exp()
    return (p * (top_logp - log_q)).sum(-1).mean()


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine down to a tenth of the peak at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    """One student trained against one teacher on one ``Data``; checkpoints under ``work``."""

    def __init__(self, settings: Settings, data: Data, teacher: Teacher, student: DraftLlama, work: Path) -> None:
        self.settings, self.data, self.teacher, self.student, self.work = settings, data, teacher, student, work
        self.subset = torch.from_numpy(data.subset)
        self.cache = TargetCache(work / "teacher", len(data.rows), settings.seq_len, settings.top_k)
        self.opt = torch.optim.AdamW(student.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.per_epoch = (data.gen_rows * settings.gen_repeat + data.corpus_rows) // settings.batch
        if self.per_epoch == 0:
            raise ValueError(f"{len(data.rows)} rows make no batch of {settings.batch}")
        self.total = self.per_epoch * settings.epochs
        self.step = 0
        self.done = torch.zeros(len(data.rows), dtype=torch.bool)  # rows whose soft targets are cached
        self.spent = {"train_s": 0.0, "teacher_s": 0.0, "student_s": 0.0, "teacher_tokens": 0.0, "tokens": 0.0}
        self._order: tuple[int, npt.NDArray[np.int64]] | None = None

    # -- data --------------------------------------------------------------------------------------------------
    def batch_rows(self, step: int) -> list[int]:
        epoch, at = divmod(step, self.per_epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.data.gen_rows, self.data.corpus_rows, self.settings.gen_repeat,
                                              self.settings.seed, epoch))
        b = self.settings.batch
        return [int(r) for r in self._order[1][at * b:(at + 1) * b]]

    def targets(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' soft targets, from the cache, asking the teacher for rows not cached yet."""
        missing = sorted({r for r in rows if not self.done[r]})
        if missing:
            t0 = time.perf_counter()
            tokens = torch.from_numpy(self.data.rows[missing].astype(np.int64))
            self.cache.put(missing, *self.teacher.soft_targets(tokens, self.subset, self.settings.top_k))
            self.done[missing] = True
            self.spent["teacher_s"] += time.perf_counter() - t0
            self.spent["teacher_tokens"] += len(missing) * self.settings.seq_len
        return self.cache.get(rows)

    # -- steps -------------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        rows = self.batch_rows(self.step)
        top_idx, top_logp, argmax = self.targets(rows)
        t0 = time.perf_counter()
        lr = lr_at(self.step, self.total, self.settings.lr, self.settings.warmup)
        for group in self.opt.param_groups:
            group["lr"] = lr
        tokens = torch.from_numpy(self.data.rows[rows].astype(np.int64))
        self.student.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.settings.autocast):
            logits = self.student(tokens[:, :-1])
        loss = distill_loss(logits, top_idx, top_logp)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        torch.nn.utils.clip_grad_norm_(self.student.parameters(), 1.0)
        self.opt.step()
        agree = (self.subset[logits.detach().argmax(-1)] == argmax).float().mean()
        self.spent["student_s"] += time.perf_counter() - t0
        self.spent["tokens"] += tokens[:, :-1].numel()
        self.step += 1
        return {"loss": float(loss.detach()), "agree": float(agree), "lr": lr}

    def run(self, until: int, deadline: float, log: Path | None = None) -> None:
        """Train up to step ``until`` (at most the schedule's total), checkpointing every few minutes and at the
        end, stopping early at ``deadline`` (time.monotonic())."""
        until = min(until, self.total)
        start, t0 = time.monotonic(), time.perf_counter()
        last_save, spent0 = start, dict(self.spent)
        while self.step < until and time.monotonic() < deadline:
            metrics = self.train_step()
            if self.step % self.settings.log_every == 0 or self.step == until:
                self._log(metrics, spent0, time.perf_counter() - t0, log)
            if time.monotonic() - last_save > 60 * self.settings.checkpoint_minutes:
                self.spent["train_s"] += time.monotonic() - last_save
                last_save = time.monotonic()
                self.save()
        self.spent["train_s"] += time.monotonic() - last_save
        self.save()

    def _log(self, metrics: dict[str, float], spent0: dict[str, float], elapsed: float, log: Path | None) -> None:
        s = self.spent
        teacher_s, student_s = s["teacher_s"] - spent0["teacher_s"], s["student_s"] - spent0["student_s"]
        record = {"step": self.step, "of": self.total, "epoch": round(self.step / self.per_epoch, 4), **metrics,
                  "teacher_tok_s": (s["teacher_tokens"] - spent0["teacher_tokens"]) / max(teacher_s, 1e-9),
                  "student_tok_s": (s["tokens"] - spent0["tokens"]) / max(student_s, 1e-9),
                  "tok_s": (s["tokens"] - spent0["tokens"]) / max(elapsed, 1e-9), "elapsed_s": elapsed,
                  "cached_rows": int(self.done.sum())}
        print(f"step {self.step}/{self.total} loss {metrics['loss']:.4f} agree {metrics['agree']:.3f} "
              f"lr {metrics['lr']:.2e} teacher {record['teacher_tok_s']:.0f} tok/s student "
              f"{record['student_tok_s']:.0f} tok/s overall {record['tok_s']:.0f} tok/s elapsed {elapsed:.0f}s",
              flush=True)
        if log is not None:
            with log.open("a") as f:
                f.write(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in record.items()}) + "\n")

    # -- checkpoints -------------------------------------------------------------------------------------------
    def save(self) -> None:
        """Atomically: the cache's rows are flushed first, so every row marked done is on disk."""
        self.cache.flush()
        path = self.work / CHECKPOINT
        state = {"student": self.student.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                 "done": self.done.clone(), "spent": dict(self.spent), "recipe": self.settings.recipe()}
        save_checkpoint(state, path)

    def load(self) -> bool:
        """Resume from the work directory's checkpoint; False when there is none."""
        state = load_checkpoint(self.work / CHECKPOINT, "recipe", self.settings.recipe())
        if state is None:
            return False
        self.student.load_state_dict(state["student"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.done, self.spent = int(state["step"]), state["done"], dict(state["spent"])
        return True


@torch.no_grad()
def agreement(teacher: Teacher, student: DraftLlama, subset: torch.Tensor, generations: Sequence[Generation],
              text_rows: npt.NDArray[np.int64]) -> dict[str, Any]:
    """Teacher-forced greedy agreement: the share of positions where the student's argmax, mapped to a target
    id, equals the teacher's argmax over the whole vocabulary. Chat positions are those that predict the
    reply (the last prompt token onwards); ``text`` (held-out stdlib rows) counts every position."""
    student.eval()
    counts: dict[str, list[int]] = {}  # class -> [matches, positions, teacher argmax in subset]
    in_subset = torch.zeros(teacher.vocab_size, dtype=torch.bool)
    in_subset[subset] = True

    def score(cls: str, tokens: torch.Tensor, first: int) -> None:
        t_arg = teacher.logits(tokens).argmax(-1)[:, first:]
        s_arg = subset[student(tokens).float().argmax(-1)][:, first:]
        c = counts.setdefault(cls, [0, 0, 0])
        c[0] += int((t_arg == s_arg).sum())
        c[1] += t_arg.numel()
        c[2] += int(in_subset[t_arg].sum())

    for g in generations:
        score(g.cls, torch.tensor([g.prompt + g.reply[:-1]]), len(g.prompt) - 1)
    for row in text_rows:
        score("text", torch.from_numpy(row[None, :-1].astype(np.int64)), 0)
    by_class = {cls: {"agreement": m / max(n, 1), "positions": n, "target_argmax_in_subset": s / max(n, 1)}
                for cls, (m, n, s) in sorted(counts.items())}
    chat = [c for cls, c in counts.items() if cls != "text"]
    matches, positions = sum(c[0] for c in chat), sum(c[1] for c in chat)
    return {"agreement": matches / max(positions, 1), "positions": positions, "by_class": by_class}
