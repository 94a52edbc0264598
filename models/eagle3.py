"""Train an EAGLE-3 head for the SmolLM2 target on the CPU, in vLLM's ``speculators`` eagle3 format, resumably:

    python -m models.eagle3 --data                  # cache the target's hidden states (resumable)
    python -m models.eagle3 --tokens 124000         # train on that many tokens; rerun to resume
    python -m models.eagle3 --curve 31000,62000,124000,380000   # the learning curve: one run per size
    python -m models.eagle3 --export 124000         # models/smollm2-eagle3/ from that run

Data: the target's own replies to the distillation prompts (``models/distill_generations/``: greedy and
T=0.8, a fixed shuffle so that a smaller size is a sample of the larger), then windows of the Python
stdlib's sources for sizes beyond them; the held-out prompts' greedy replies for evaluation. The hidden
states are the embedded engine's target's (float32), cached under ``models/.eagle3/<target>/``. Each size
trains in a directory of its own (``run-<tokens>/``: checkpoint, log, report.json). The head's format is
models/eagle3_format.py's.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from models.checkpoints import add_time
from models.distill import cpu_info
from models.distill_data import Teacher, corpus_stream, read_generations
from models.eagle3_data import (
    SHARD_SEQUENCES,
    CachedSequence,
    Item,
    build_shards,
    corpus_items,
    generation_items,
    read_shards,
)
from models.eagle3_format import DEFAULT_LAYER_IDS, draft_vocab, new_head, save_head
from models.eagle3_train import HeadTrainer, TrainSettings

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = REPO / "models" / "smollm2-135m-instruct-q4_1"
DEFAULT_VOCAB_FROM = REPO / "models" / "smollm2-draft"  # its draft_vocab_ids: the same 8,192-token subset
DEFAULT_OUT = REPO / "models" / "smollm2-eagle3"
GENERATIONS = REPO / "models" / "distill_generations"
CORPUS_WINDOW = 512


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    p.add_argument("--work", type=Path, default=None, help="default models/.eagle3/<target directory name>")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-minutes", type=float, default=float("inf"), help="stop (checkpointed) after this long")
    p.add_argument("--data", action="store_true", help="cache the hidden states and exit")
    p.add_argument("--corpus-tokens", type=int, default=262144, help="stdlib tokens cached beyond the replies")
    p.add_argument("--tokens", type=int, default=None, help="train one run on this many tokens")
    p.add_argument("--curve", type=str, default=None, help="comma-separated sizes: a run each, then the table")
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ttt-steps", type=int, default=4)
    p.add_argument("--export", type=int, default=None, metavar="TOKENS", help="write the head of that run")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def data_items(teacher: Teacher, corpus_tokens: int) -> dict[str, list[Item]]:
    train = generation_items(read_generations(GENERATIONS / "generations.jsonl"))
    random.Random(0).shuffle(train)
    evals = generation_items(read_generations(GENERATIONS / "eval_generations.jsonl"))
    stream = corpus_stream(teacher, heldout=False).tolist()
    corpus = corpus_items(stream, CORPUS_WINDOW, corpus_tokens // CORPUS_WINDOW)
    return {"train": train, "eval": evals, "corpus": corpus}


def cache_data(args: argparse.Namespace, work: Path, deadline: float,
               splits: tuple[str, ...] = ("train", "eval", "corpus")) -> bool:
    teacher = Teacher(args.target, "float32")
    started, done = time.perf_counter(), True
    for name, items in data_items(teacher, args.corpus_tokens).items():
        if name not in splits:
            continue
        count = build_shards(teacher.model, items, DEFAULT_LAYER_IDS, work / name, deadline)
        (work / name / "count.json").write_text(json.dumps({"shards": count, "sequences": len(items)}) + "\n")
        done = done and count * SHARD_SEQUENCES >= len(items)
    add_time(work, "data_s", time.perf_counter() - started)
    return done


def load_split(work: Path, name: str) -> list[CachedSequence]:
    path = work / name / "count.json"
    if not path.is_file():
        raise SystemExit(f"{work / name}: no cached hidden states; run python -m models.eagle3 --data first")
    return list(read_shards(work / name, json.loads(path.read_text())["shards"]))


def sized(train: list[CachedSequence], corpus: list[CachedSequence], tokens: int) -> list[CachedSequence]:
    """The first sequences of the replies (then of the corpus windows) up to ``tokens``."""
    chosen, total = [], 0
    for seq in [*train, *corpus]:
        if total >= tokens:
            break
        chosen.append(seq)
        total += len(seq.tokens) - 1
    if total < tokens:
        raise SystemExit(f"only {total} tokens cached; raise --corpus-tokens and rerun --data")
    return chosen


def train_size(args: argparse.Namespace, work: Path, tokens: int, deadline: float) -> dict[str, Any] | None:
    """One size's run, resumed; its report once the schedule is done (None: stopped at the deadline)."""
    run = work / f"run-{tokens}"
    report_path = run / "report.json"
    if report_path.is_file():
        report: dict[str, Any] = json.loads(report_path.read_text())
        return report
    run.mkdir(parents=True, exist_ok=True)
    train = load_split(work, "train")
    corpus: list[CachedSequence] = []
    if sum(len(s.tokens) - 1 for s in train) < tokens:
        if not (work / "corpus" / "count.json").is_file() and not cache_data(args, work, deadline, ("corpus",)):
            return None
        corpus = load_split(work, "corpus")
    data = sized(train, corpus, tokens)
    settings = TrainSettings(tokens=tokens, epochs=args.epochs, lr=args.lr, ttt_steps=args.ttt_steps)
    head = new_head(args.target, draft_vocab(DEFAULT_VOCAB_FROM), settings.ttt_steps)
    trainer = HeadTrainer(head, settings, data, run)
    if trainer.load():
        print(f"run-{tokens}: resumed at step {trainer.step}/{trainer.total}", flush=True)
    if not trainer.run(deadline, run / "log.jsonl"):
        return None
    t0 = time.perf_counter()
    held_out = trainer.evaluate(load_split(work, "eval"))
    report = {"tokens": tokens, "sequences": len(data), "steps": trainer.total, "settings": settings.__dict__,
              "training_hours": round(trainer.spent_s / 3600, 3), "threads": args.threads, "cpu": cpu_info(),
              "eval_seconds": round(time.perf_counter() - t0, 1), "held_out": held_out}
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    torch.save(trainer.model.state_dict(), run / "head.pt")
    return report


def export(args: argparse.Namespace, work: Path, tokens: int) -> None:
    run = work / f"run-{tokens}"
    if not (run / "report.json").is_file():
        raise SystemExit(f"{run}: not trained to the end; run python -m models.eagle3 --tokens {tokens}")
    report = json.loads((run / "report.json").read_text())
    head = new_head(args.target, draft_vocab(DEFAULT_VOCAB_FROM), report["settings"]["ttt_steps"])
    head.load_state_dict(torch.load(run / "head.pt", weights_only=True))
    curve = sorted((json.loads(p.read_text()) for p in work.glob("run-*/report.json")), key=lambda r: r["tokens"])
    save_head(head, args.out, {"exported": report, "learning_curve": curve,
                               "data_seconds": json.loads((work / "times.json").read_text()).get("data_s")})
    print(json.dumps({"exported": str(args.out), "tokens": tokens}))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    work = args.work or REPO / "models" / ".eagle3" / args.target.name
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + 60 * args.max_minutes
    if args.export is not None:
        export(args, work, args.export)
        return
    if args.data:
        cache_data(args, work, deadline)
        return
    # The replies first; the stdlib windows only once a size reaches past them (sized()).
    cached = all((work / split / "count.json").is_file() for split in ("train", "eval"))
    if not cached and not cache_data(args, work, deadline, ("train", "eval")):
        return
    sizes = [args.tokens] if args.tokens else [int(s) for s in (args.curve or "").split(",") if s]
    for tokens in sizes:
        report = train_size(args, work, tokens, deadline)
        if report is None:
            print(json.dumps({"stopped": f"run-{tokens}", "rerun": "to resume"}))
            return
        print(json.dumps({"tokens": tokens, "held_out": report["held_out"]["all"],
                          "training_hours": report["training_hours"]}), flush=True)


if __name__ == "__main__":
    main()
