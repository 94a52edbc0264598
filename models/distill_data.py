"""The draft distillation's data: the teacher (the target), its generations, the training rows, the head's
vocabulary subset and the cache of the teacher's soft targets.

Two sources, both present on any machine with the target: (a) the target's own replies to the training
prompts of ``models/distill_prompts.jsonl``, greedy and sampled, rendered with the target's chat template
exactly as a worker renders a request (``workers.text.TextCodec``), and (b) the Python standard library's
source (``workers.demo.corpus``: the same train / held-out split by path hash as the demo models). Each is a
token stream cut into rows of ``seq_len + 1`` tokens; the schedule repeats the generation rows
``gen_repeat`` times per epoch, because they are what the draft is served on and cost 100× more to make.

Soft targets are the teacher's top-k log-probabilities among the head's subset (normalized over the whole
vocabulary, so the mass outside the subset or the top k is simply not matched), cached to disk the first
time a row is trained on. Why a cache and not the full subset distribution computed every step: on 2 CPU
cores the 135M teacher's forward costs 25× the 5M student's forward and backward, so every epoch after
the first would pay the teacher again; k = 32 entries of (int16 row, float16 log-prob) are 128 bytes a
token (a 3M-token epoch is 0.4 GB), against 16 kB a token for the whole 8192-entry subset.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from models.distill_prompts import Prompt
from models.draft_format import special_ids
from workers.api.wire import ChatMessage
from workers.demo.corpus import stdlib_sources
from workers.engines.embedded.kv_cache import CacheBatch, KVCache, padded_span
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.projections import TORCH_DTYPES, bf16_prepacking_available
from workers.text import TextCodec

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Generation:
    """One teacher reply: ``prompt`` and ``reply`` token ids (the reply ends with a stop id unless cut)."""

    id: str
    cls: str
    temperature: float
    prompt: list[int]
    reply: list[int]

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "class": self.cls, "temperature": self.temperature,
                           "prompt": self.prompt, "reply": self.reply})

    @classmethod
    def from_json(cls, line: str) -> Generation:
        raw = json.loads(line)
        return cls(raw["id"], raw["class"], float(raw["temperature"]), raw["prompt"], raw["reply"])


def read_generations(path: Path) -> list[Generation]:
    if not path.is_file():
        return []
    return [Generation.from_json(line) for line in path.read_text().splitlines() if line.strip()]


class Teacher:
    """The target as the distillation's teacher: chat rendering, batched generation, soft targets."""

    def __init__(self, target_dir: Path, precision: str) -> None:
        self.dir = target_dir
        self.precision = precision
        self.dtype = TORCH_DTYPES[precision]
        # bfloat16 on oneDNN's prepacked weights where the CPU has them (generation at batch 16 measured 134
        # against 83 tok/s unpacked on one AMX core; full forwards about the same); float32 on plain F.linear,
        # which compiles nothing (the engine's float32 kernels are built for batch-1 decoding).
        packed = self.dtype == torch.bfloat16 and bf16_prepacking_available()
        self.model = LlamaForCausalLM.from_pretrained(target_dir, dtype=self.dtype, packed=packed)
        self.codec = TextCodec.from_model_dir(target_dir)
        stops = set(self.model.cfg.eos_token_ids)
        gen_config = target_dir / "generation_config.json"
        if gen_config.is_file():
            eos = json.loads(gen_config.read_text()).get("eos_token_id", [])
            stops.update(eos if isinstance(eos, list) else [eos])
        self.stops = frozenset(int(s) for s in stops)
        self.seconds = 0.0  # teacher compute, for the tokens/s the log reports
        self.tokens = 0

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def chat_ids(self, user: str) -> list[int]:
        return self.codec.encode_chat([ChatMessage(role="user", content=user)])

    @torch.no_grad()
    def generate(self, prompts: Sequence[list[int]], max_new: int, temperature: float, seed: int) -> list[list[int]]:
        """Replies to ``prompts`` decoded together on one KV cache; each stops at a stop id or ``max_new``."""
        cap = padded_span(max(map(len, prompts)) + max_new)
        cache = KVCache.allocate(replace(self.model.cfg, max_position_embeddings=cap), len(prompts), self.dtype)
        gen = torch.Generator().manual_seed(seed)
        lengths = [len(p) for p in prompts]
        tokens = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
        for row, p in enumerate(prompts):
            tokens[row, :len(p)] = torch.tensor(p)
        rows = list(range(len(prompts)))
        batch = CacheBatch.build(rows, [0] * len(rows), lengths, max(lengths), cap, row_invariant=False)
        logits = self.model.forward_cached(tokens, cache, batch, torch.tensor(rows), torch.tensor(lengths) - 1)
        replies: list[list[int]] = [[] for _ in prompts]
        active, positions = rows, list(lengths)
        while True:
            picked = self._pick(logits, temperature, gen).tolist()
            still = []
            for row, token in zip(active, picked, strict=True):
                replies[row].append(token)
                if token not in self.stops and len(replies[row]) < max_new:
                    still.append(row)
            if not still:
                break
            batch = CacheBatch.build(still, [positions[r] for r in still], [1] * len(still), 1, cap,
                                     row_invariant=False)
            step = torch.tensor([[replies[r][-1]] for r in still])
            logits = self.model.forward_cached(step, cache, batch)[:, -1]
            for r in still:
                positions[r] += 1
            active = still
        return replies

    @staticmethod
    def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=gen)[:, 0]

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) -> float32 logits (B, T, V), full causal forward."""
        return self.model.forward_train(tokens).float()

    @torch.no_grad()
    def soft_targets(self, rows: torch.Tensor, subset: torch.Tensor, k: int, chunk: int = 2
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For rows (B, T+1) of ids: the top ``k`` subset rows by the teacher's log-probability at each of the
        T positions (int16 (B, T, k)), those log-probabilities (float16, normalized over the whole vocabulary),
        and the teacher's argmax over the whole vocabulary (int32 (B, T)). ``chunk`` rows at a time bounds
        the (chunk, T, V) float32 logits."""
        idx, logp, argmax = [], [], []
        for start in range(0, rows.shape[0], chunk):
            logits = self.logits(rows[start:start + chunk, :-1])
            top = torch.log_softmax(logits, dim=-1)[..., subset].topk(k, dim=-1)
            idx.append(top.indices.to(torch.int16))
            logp.append(top.values.to(torch.float16))
            # max().indices: half the time of argmax() over 49152 columns here.
            argmax.append(logits.flatten(0, 1).max(-1).indices.view(logits.shape[:2]).to(torch.int32))
        return torch.cat(idx), torch.cat(logp), torch.cat(argmax)


def generate_missing(teacher: Teacher, prompts: Sequence[Prompt], temperatures: Sequence[float], path: Path,
                     max_new: int, batch: int, seed: int, deadline: float) -> bool:
    """Append to ``path`` the replies it lacks, ``batch`` prompts at a time; True when none is missing, False
    when ``deadline`` (time.monotonic()) passed first.

    Each batch is a fixed group of the work list with a seed of its own, written whole, so a resumed run
    makes the same replies as an uninterrupted one."""
    done = {(g.id, g.temperature) for g in read_generations(path)}
    work = [(p, t) for t in temperatures for p in prompts]
    for start in range(0, len(work), batch):
        group = work[start:start + batch]
        todo = [(p, t) for p, t in group if (p.id, t) not in done]
        if not todo:
            continue
        if time.monotonic() > deadline:
            return False
        by_temperature: dict[float, list[Prompt]] = {}
        for p, t in todo:
            by_temperature.setdefault(t, []).append(p)
        t0 = time.perf_counter()
        lines = []
        for t, group_prompts in sorted(by_temperature.items()):
            ids = [teacher.chat_ids(p.user) for p in group_prompts]
            replies = teacher.generate(ids, max_new, t, seed * 1_000_003 + start)
            lines += [Generation(p.id, p.cls, t, i, r).to_json() for p, i, r in zip(group_prompts, ids, replies,
                                                                                    strict=True)]
            teacher.tokens += sum(map(len, replies))
        teacher.seconds += time.perf_counter() - t0
        with path.open("a") as f:
            f.write("".join(line + "\n" for line in lines))
    return True


def separator_id(teacher: Teacher) -> int:
    """The id between documents in a stream: <|endoftext|> where the vocabulary has it, else BOS."""
    found = teacher.codec.tokenizer.token_to_id("<|endoftext|>")
    return int(found) if found is not None else int(teacher.model.cfg.bos_token_id)


def corpus_stream(teacher: Teacher, heldout: bool) -> IntArray:
    """The stdlib's train (or held-out) files as one stream of ids, documents joined by ``separator_id``."""
    texts = [s.text for s in stdlib_sources() if s.heldout == heldout]
    encoded = teacher.codec.tokenizer.encode_batch(texts, add_special_tokens=False)
    sep = separator_id(teacher)
    return np.fromiter((i for e in encoded for i in (sep, *e.ids)), dtype=np.int64)


def generation_stream(generations: Sequence[Generation], sep: int) -> IntArray:
    return np.fromiter((i for g in generations for i in (sep, *g.prompt, *g.reply)), dtype=np.int64)


def cut_rows(stream: IntArray, seq_len: int) -> IntArray:
    """Rows of seq_len + 1 ids, each starting where the last one's inputs end: every id is a target once."""
    count = (len(stream) - 1) // seq_len
    if count <= 0:
        return np.zeros((0, seq_len + 1), dtype=np.int64)
    rows: IntArray = stream[np.arange(count)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]]
    return rows


def choose_subset(counts: npt.NDArray[Any], size: int, always: Sequence[int]) -> IntArray:
    """The ``size`` ids of the highest counts or weights (ties: lower id first), always including ``always``;
    ascending."""
    if len(set(always)) > size:
        raise ValueError(f"{len(set(always))} special ids do not fit in a head of {size} rows")
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count descending, then id ascending
    chosen = set(int(i) for i in always)
    for i in order:
        if len(chosen) >= size:
            break
        chosen.add(int(i))
    return np.array(sorted(chosen), dtype=np.int64)


def build_rows(teacher: Teacher, generations: Sequence[Generation], seq_len: int, draft_vocab: int,
               gen_repeat: int) -> dict[str, Any]:
    """Rows (generation rows first), the head's subset and how many rows each source has.

    The subset weighs each source's token frequencies equally: counted by tokens the stdlib (code) would
    pick nearly all 8192 ids, and chat replies need everyday words. On the smoke run's data (64 prompts) the
    share of held-out chat replies' tokens in the subset went from 0.845 (counts) to 0.881 (equal shares);
    stdlib prose (pydoc_data.topics, 113k tokens) as a third source added nothing (0.883)."""
    sep = separator_id(teacher)
    gen_stream, corpus = generation_stream(generations, sep), corpus_stream(teacher, heldout=False)
    gen_counts = np.bincount(gen_stream, minlength=teacher.vocab_size)
    corpus_counts = np.bincount(corpus, minlength=teacher.vocab_size)
    weights = gen_counts / max(1, gen_counts.sum()) + corpus_counts / max(1, corpus_counts.sum())
    gen_rows, corpus_rows = cut_rows(gen_stream, seq_len), cut_rows(corpus, seq_len)
    subset = choose_subset(weights, draft_vocab, special_ids(teacher.dir))
    return {"rows": np.concatenate([gen_rows, corpus_rows]).astype(np.int32), "subset": subset,
            "gen_rows": len(gen_rows), "corpus_rows": len(corpus_rows), "gen_tokens": len(gen_stream),
            "corpus_tokens": len(corpus), "subset_weighting": "generations and stdlib text half each",
            "subset_gen_coverage": float(gen_counts[subset].sum() / max(1, gen_counts.sum())),
            "subset_corpus_coverage": float(corpus_counts[subset].sum() / max(1, corpus_counts.sum()))}


def epoch_order(gen_rows: int, corpus_rows: int, gen_repeat: int, seed: int, epoch: int) -> IntArray:
    """The row ids of one epoch: every corpus row once and every generation row ``gen_repeat`` times, in an
    order fixed by (seed, epoch), so the data of a step never depends on when the run was interrupted."""
    base = np.concatenate([np.tile(np.arange(gen_rows), gen_repeat), gen_rows + np.arange(corpus_rows)])
    order: IntArray = np.random.default_rng([seed, epoch]).permutation(base)
    return order


class TargetCache:
    """The teacher's soft targets per row, in memory-mapped .npy files under ``directory``. Which rows are
    filled is the caller's (it saves ``done`` with its checkpoint, so a resumed run recomputes exactly the
    rows the interrupted one had not checkpointed)."""

    def __init__(self, directory: Path, rows: int, seq_len: int, k: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        shapes = {"idx": ((rows, seq_len, k), np.int16), "logp": ((rows, seq_len, k), np.float16),
                  "argmax": ((rows, seq_len), np.int32)}
        self.arrays: dict[str, np.memmap[Any, Any]] = {}
        for name, (shape, dtype) in shapes.items():
            path = directory / f"teacher_{name}.npy"
            mode = "r+" if path.is_file() else "w+"
            array = np.lib.format.open_memmap(path, mode=mode, dtype=dtype, shape=shape if mode == "w+" else None)
            if array.shape != shape or array.dtype != dtype:
                raise ValueError(f"{path}: shape {array.shape} {array.dtype}, expected {shape} {dtype}; "
                                 "remove the work directory to rebuild the data")
            self.arrays[name] = array

    def put(self, rows: Sequence[int], idx: torch.Tensor, logp: torch.Tensor, argmax: torch.Tensor) -> None:
        self.arrays["idx"][rows] = idx.numpy()
        self.arrays["logp"][rows] = logp.numpy()
        self.arrays["argmax"][rows] = argmax.numpy()

    def get(self, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(idx int64, logp float32, argmax int64) of ``rows``."""
        return (torch.from_numpy(self.arrays["idx"][rows].astype(np.int64)),
                torch.from_numpy(self.arrays["logp"][rows].astype(np.float32)),
                torch.from_numpy(self.arrays["argmax"][rows].astype(np.int64)))

    def flush(self) -> None:
        for array in self.arrays.values():
            array.flush()
