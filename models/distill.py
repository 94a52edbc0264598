"""Distil a small draft model for a Llama target (SmolLM2-135M-Instruct) on the CPU, resumably:

    python -m models.distill --target models/smollm2-135m-instruct-q4_1 --max-minutes 60   # train; rerun to resume
    python -m models.distill --target ... --eval              # greedy agreement on held-out prompts, one JSON line
    python -m models.distill --target ... --export            # models/smollm2-draft/ (bf16), training_report.json

Stages, each picked up where it stopped: (1) the target's replies to the training prompts of
``models/distill_prompts.jsonl`` (greedy and at temperature 0.8) and its greedy replies to the held-out ones;
(2) the rows, the head's vocabulary subset (the 8192 most frequent target ids of the training data, plus every
special id); (3) training, the teacher's top-k soft targets computed the first time a row comes up and cached
(see models/distill_data.py for why), checkpoints every few minutes. Everything lives in a git-ignored work
directory, ``models/.distill/<target directory name>/``; the same command resumes, ``--max-minutes`` bounds a
run. The draft's format is models/draft_format.py's.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.checkpoints import add_time
from models.distill_data import (
    Generation,
    Teacher,
    build_rows,
    corpus_stream,
    cut_rows,
    generate_missing,
    read_generations,
)
from models.distill_prompts import CLASSES, Prompt, load_prompts
from models.distill_train import CHECKPOINT, Data, Settings, Trainer, agreement
from models.draft_format import (
    DraftLlama,
    DraftShape,
    draft_config,
    load_draft,
    model_config,
    read_target_embedding,
    save_draft,
    sha256_of,
)
from workers.engines.embedded.projections import bf16_prepacking_available

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = REPO / "models" / "smollm2-135m-instruct-q4_1"
DEFAULT_WORK = REPO / "models" / ".distill"
DEFAULT_OUT = REPO / "models" / "smollm2-draft"
TEMPERATURES = (0.0, 0.8)  # each training prompt's replies: greedy, and one sampled as requests sample


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=DEFAULT_TARGET, help="the target's Hugging Face directory")
    p.add_argument("--work", type=Path, default=None, help="checkpoints and data (default models/.distill/<target>)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--max-minutes", type=float, default=float("inf"), help="stop (and checkpoint) after this long")
    p.add_argument("--steps", type=int, default=None, help="stop at this step (default: the schedule's end)")
    p.add_argument("--eval", action="store_true", help="measure greedy agreement on held-out prompts and exit")
    p.add_argument("--draft", type=Path, default=None, help="--eval this exported draft instead of the checkpoint")
    p.add_argument("--export", type=Path, nargs="?", const=DEFAULT_OUT, default=None,
                   help=f"write the draft directory (default {DEFAULT_OUT.relative_to(REPO)}) and exit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--gen-prompts", type=int, default=None, help="training prompts to generate from (default all)")
    p.add_argument("--gen-tokens", type=int, default=256, help="longest training reply")
    p.add_argument("--gen-batch", type=int, default=16, help="replies decoded together")
    p.add_argument("--gen-repeat", type=int, default=4, help="times each generation row is trained on per epoch")
    p.add_argument("--eval-prompts", type=int, default=20, help="held-out prompts per class")
    p.add_argument("--eval-tokens", type=int, default=128, help="longest held-out reply")
    p.add_argument("--eval-text-rows", type=int, default=8, help="held-out stdlib rows scored as class 'text'")
    p.add_argument("--teacher-precision", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 where the CPU has bfloat16 hardware (as a worker serves the target)")
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    return p.parse_args(argv)


def cpu_info() -> dict[str, Any]:
    """The CPU's model name and bfloat16 flags (what `grep -o -w -E 'amx_bf16|avx512_bf16' /proc/cpuinfo` shows)."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags.update(value.split())
    except OSError:
        pass
    return {"model": model, "bf16_flags": sorted(flags & {"amx_bf16", "avx512_bf16"})}


def balanced(prompts: Sequence[Prompt], count: int | None) -> list[Prompt]:
    """The first ``count`` of ``prompts`` taken round-robin over the classes, so a cut keeps every class."""
    by_class = [[p for p in prompts if p.cls == cls] for cls in CLASSES]
    longest = max(map(len, by_class), default=0)
    order = [group[i] for i in range(longest) for group in by_class if i < len(group)]
    return order if count is None else order[:count]


def check_meta(work: Path, meta: dict[str, Any]) -> None:
    """A work directory serves one recipe: the first run records it, later runs must ask for the same."""
    path = work / "meta.json"
    if path.is_file():
        found = json.loads(path.read_text())
        if found != meta:
            diff = sorted(k for k in set(found) | set(meta) if found.get(k) != meta.get(k))
            raise SystemExit(f"{path}: this work directory was made with other settings ({', '.join(diff)}); "
                             "rerun with the same ones or pass another --work")
    else:
        work.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta, indent=2) + "\n")


def prepare(args: argparse.Namespace, settings: Settings, teacher: Teacher, work: Path, deadline: float
            ) -> tuple[Data, list[Generation]] | None:
    """Generations, then rows and subset; None when the deadline came first (rerun to continue)."""
    prompts = load_prompts()
    train = balanced([p for p in prompts if p.split == "train"], args.gen_prompts)
    heldout = balanced([p for p in prompts if p.split == "heldout"], args.eval_prompts * len(CLASSES))
    t0, before = time.perf_counter(), teacher.tokens
    complete = (generate_missing(teacher, heldout, (0.0,), work / "eval_generations.jsonl", args.eval_tokens,
                                 args.gen_batch, args.seed + 7, deadline)
                and generate_missing(teacher, train, TEMPERATURES, work / "generations.jsonl", args.gen_tokens,
                                     args.gen_batch, args.seed, deadline))
    if teacher.tokens > before:
        seconds = time.perf_counter() - t0
        print(f"generation: {teacher.tokens - before} tokens in {seconds:.0f}s "
              f"({(teacher.tokens - before) / seconds:.1f} tok/s)", flush=True)
        add_time(work, "generation_s", seconds)
    if not complete:
        return None
    if not (work / "rows.npy").is_file():
        built = build_rows(teacher, read_generations(work / "generations.jsonl"), settings.seq_len,
                           settings.draft_vocab, settings.gen_repeat)
        np.save(work / "subset.npy", built.pop("subset"))
        np.save(work / "rows.npy", built.pop("rows"))
        (work / "data.json").write_text(json.dumps(built, indent=2) + "\n")
    stats = json.loads((work / "data.json").read_text())
    data = Data(np.load(work / "rows.npy"), np.load(work / "subset.npy"), stats["gen_rows"], stats["corpus_rows"])
    return data, read_generations(work / "eval_generations.jsonl")


def new_student(target: Path, subset: np.ndarray[Any, Any], sha: str, seed: int) -> DraftLlama:
    raw = json.loads((target / "config.json").read_text())
    shape = DraftShape(draft_vocab_size=len(subset))
    student = DraftLlama(model_config(draft_config(raw, shape, sha)), len(subset), read_target_embedding(target))
    student.draft_vocab_ids.copy_(torch.from_numpy(subset))
    student.init_weights(seed)
    return student


def run_eval(args: argparse.Namespace, trainer: Trainer, work: Path, evals: list[Generation]) -> dict[str, Any]:
    student, subset, source = trainer.student, trainer.subset, f"checkpoint step {trainer.step}"
    if args.draft is not None:
        student, subset = load_draft(args.draft, args.target)
        source = str(args.draft)
    stream = corpus_stream(trainer.teacher, heldout=True)
    text = cut_rows(stream, args.seq_len)
    text = text[np.linspace(0, len(text) - 1, min(args.eval_text_rows, len(text))).astype(int)] if len(text) else text
    t0 = time.perf_counter()
    result = {"mode": "eval", "draft": source, "step": trainer.step, "target": str(args.target),
              "teacher_precision": trainer.teacher.precision,
              **agreement(trainer.teacher, student, subset, evals, text),
              "seconds": round(time.perf_counter() - t0, 1)}
    (work / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def export(args: argparse.Namespace, trainer: Trainer, work: Path, sha: str, out: Path) -> dict[str, Any]:
    save_draft(trainer.student, out, args.target, sha)
    load_draft(out, args.target)  # the written directory must load, checks included
    times = json.loads((work / "times.json").read_text()) if (work / "times.json").is_file() else {}
    spent = trainer.spent
    report = {
        "target": str(args.target), "target_sha256": sha, "steps": trainer.step, "of": trainer.total,
        "epochs": trainer.step / trainer.per_epoch, "recipe": trainer.settings.recipe(),
        "data": json.loads((work / "data.json").read_text()), "tokens_seen": spent["tokens"],
        "teacher_tokens": spent["teacher_tokens"], "training_hours": spent["train_s"] / 3600,
        "teacher_seconds": spent["teacher_s"], "student_seconds": spent["student_s"],
        "generation_seconds": times.get("generation_s", 0.0),
        "total_hours": (spent["train_s"] + times.get("generation_s", 0.0)) / 3600,
        "teacher_precision": trainer.teacher.precision,
        "student_precision": "bfloat16 autocast" if trainer.settings.autocast else "float32",
        "cpu": {**cpu_info(), "threads": args.threads}, "torch": torch.__version__,
        "eval": json.loads((work / "eval.json").read_text()) if (work / "eval.json").is_file() else None,
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    deadline = time.monotonic() + 60 * args.max_minutes
    precision = args.teacher_precision
    if precision == "auto":
        precision = "bfloat16" if bf16_prepacking_available() else "float32"
    sha = sha256_of(args.target / "model.safetensors")
    work = args.work or DEFAULT_WORK / args.target.name
    settings = Settings(seed=args.seed, seq_len=args.seq_len, batch=args.batch, top_k=args.top_k, epochs=args.epochs,
                        lr=args.lr, gen_repeat=args.gen_repeat, autocast=bool(cpu_info()["bf16_flags"]),
                        checkpoint_minutes=args.checkpoint_minutes)
    check_meta(work, {"target_sha256": sha, "teacher_precision": precision, "recipe": settings.recipe(),
                      "gen_prompts": args.gen_prompts, "gen_tokens": args.gen_tokens, "gen_batch": args.gen_batch,
                      "temperatures": list(TEMPERATURES), "eval_prompts": args.eval_prompts,
                      "eval_tokens": args.eval_tokens})
    teacher = Teacher(args.target, precision)
    prepared = prepare(args, settings, teacher, work, deadline)
    if prepared is None:
        print(f"stopped during generation after {args.max_minutes} minutes; rerun to continue", flush=True)
        return 0
    data, evals = prepared
    trainer = Trainer(settings, data, teacher, new_student(args.target, data.subset, sha, args.seed + 1), work)
    resumed = trainer.load()
    print(f"{'resumed at' if resumed else 'starting at'} step {trainer.step} of {trainer.total} "
          f"({trainer.per_epoch} per epoch; {len(data.rows)} rows of {args.seq_len + 1}, {data.gen_rows} from "
          f"generations); teacher {precision}, {args.threads} threads; work {work}", flush=True)
    if args.eval:
        print(json.dumps(run_eval(args, trainer, work, evals)), flush=True)
        return 0
    if args.export is not None:
        if not resumed:
            raise SystemExit(f"{work / CHECKPOINT}: no checkpoint to export")
        print(json.dumps(export(args, trainer, work, sha, args.export)), flush=True)
        return 0
    trainer.run(args.steps if args.steps is not None else trainer.total, deadline, work / "log.jsonl")
    print(f"checkpoint at step {trainer.step} in {work / CHECKPOINT}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
