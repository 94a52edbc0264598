"""Train the demo target and draft models on the Python standard library's source.

One command, reproducible, resumable (re-run it after an interruption and it continues from
the last checkpoint in ``--work``):

    python -m workers.demo.train --out models

The shipped draft alone, distilled further from the shipped target (no tokenizer or target
training; the teacher is the target exactly as it is served, bfloat16 weights), starting from
the draft already there:

    python -m workers.demo.train --out models --draft-only --draft-init models/demo-draft \
        --draft-steps 600 --draft-lr 1e-3 --precision float32

Stages: (1) a byte-level BPE tokenizer, (2) the target on next-token cross-entropy, (3) the
draft distilled from the target's logits (forward KL at temperature 1), so its proposals are
accepted often. Each stage is skipped when its output already exists.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from workers.demo.corpus import (
    ASSISTANT_TOKEN,
    END_TOKEN,
    EOT_TOKEN,
    SPECIAL_TOKENS,
    SYSTEM_TOKEN,
    USER_TOKEN,
    docstring_chats,
    heldout_prompts,
    stdlib_sources,
)
from workers.engines.embedded.config import ModelConfig
from workers.engines.embedded.llama import LlamaForCausalLM

VOCAB_SIZE = 4096
SEQ_LEN = 256
MAX_POSITIONS = 1024

TARGET = ModelConfig(vocab_size=VOCAB_SIZE, hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                     num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                     eos_token_id=[0, 4])
DRAFT = replace(TARGET, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4)

# Training joins documents with <|endoftext|> (build_stream), so every document the models
# saw starts right after it: it is the BOS of every prompt, text and chat alike. The model
# directory says so in the tokenizer's post-processor and the chat template, so every engine
# and tokenizer (specgate's, vLLM's, transformers') encodes a prompt the same way.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Stage:
    name: str
    steps: int
    batch: int
    lr: float
    warmup: int = 50
    # bfloat16 autocast is fast only where the CPU computes bfloat16 (avx512_bf16, AMX); on an
    # AVX2-only CPU oneDNN's bfloat16 path is many times slower than float32.
    autocast: bool = True


def train_tokenizer(texts: list[str], out: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    return tok


def declare_bos(tok: Tokenizer) -> None:
    """Text prompts start with BOS: the tokenizer adds it when asked for special tokens."""
    tok.post_processor = processors.TemplateProcessing(single=f"{EOT_TOKEN} $A", pair=f"{EOT_TOKEN} $A {EOT_TOKEN} $B",
                                                       special_tokens=[(EOT_TOKEN, 0)])


def write_tokenizer_metadata(out: Path) -> None:
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT_TOKEN, "eos_token": END_TOKEN, "pad_token": EOT_TOKEN, "unk_token": None,
        "additional_special_tokens": [SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN],
        "model_max_length": MAX_POSITIONS, "add_bos_token": True, "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 0, "eos_token_id": [0, 4], "pad_token_id": 0}, indent=2) + "\n")


def build_stream(tok: Tokenizer, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train tokens, held-out tokens): documents joined by <|endoftext|>."""
    sources = stdlib_sources()
    rng = random.Random(seed)
    train_docs = [s.text for s in sources if not s.heldout]
    train_docs += [c for s in sources if not s.heldout for c in docstring_chats(s)]
    rng.shuffle(train_docs)
    heldout_docs = [s.text for s in sources if s.heldout]

    def encode(docs: list[str]) -> torch.Tensor:
        ids: list[int] = []
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            ids.append(0)
            ids.extend(enc.ids)
        return torch.tensor(ids, dtype=torch.int16 if VOCAB_SIZE < 32768 else torch.int32)

    return encode(train_docs), encode(heldout_docs)


def batch_at(stream: torch.Tensor, step: int, batch: int, seed: int) -> torch.Tensor:
    # The batch depends only on (seed, step), so a resumed run sees the same data.
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (batch,), generator=gen)
    return torch.stack([stream[s:s + SEQ_LEN + 1] for s in starts.tolist()]).long()


def lr_at(stage: Stage, step: int) -> float:
    if step < stage.warmup:
        return stage.lr * (step + 1) / stage.warmup
    progress = (step - stage.warmup) / max(1, stage.steps - stage.warmup)
    return stage.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, stream: torch.Tensor, autocast: bool, batches: int = 8) -> float:
    losses = []
    for i in range(batches):
        xy = batch_at(stream, i, 8, seed=12345)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model.forward_train(xy[:, :-1])
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), xy[:, 1:].flatten()).item())
    return sum(losses) / len(losses)


def run_stage(stage: Stage, model: LlamaForCausalLM, teacher: LlamaForCausalLM | None, stream: torch.Tensor,
              heldout: torch.Tensor, work: Path, seed: int) -> dict[str, float]:
    ckpt = work / f"{stage.name}.pt"
    opt = torch.optim.AdamW(model.parameters(), lr=stage.lr, betas=(0.9, 0.95), weight_decay=0.1)
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        print(f"[{stage.name}] resumed at step {start}", flush=True)
    model.train()
    t0 = time.perf_counter()
    for step in range(start, stage.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(stage, step)
        xy = batch_at(stream, step, stage.batch, seed)
        x, y = xy[:, :-1], xy[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=stage.autocast):
            logits = model.forward_train(x).float()
            if teacher is None:
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            else:
                with torch.no_grad():
                    teacher_logp = F.log_softmax(teacher.forward_train(x).float(), dim=-1)
                loss = F.kl_div(F.log_softmax(logits, dim=-1), teacher_logp, log_target=True,
                                reduction="batchmean") / x.shape[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 25 == 0 or step + 1 == stage.steps:
            rate = (step + 1 - start) * stage.batch * SEQ_LEN / (time.perf_counter() - t0)
            print(f"[{stage.name}] step {step + 1}/{stage.steps} loss {loss.item():.3f} "
                  f"lr {lr_at(stage, step):.2e} {rate:.0f} tok/s", flush=True)
        if (step + 1) % 100 == 0 or step + 1 == stage.steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, ckpt)
    model.eval()
    return {"heldout_loss": heldout_loss(model, heldout, stage.autocast), "steps": stage.steps,
            "tokens_seen": stage.steps * stage.batch * SEQ_LEN}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("models"))
    parser.add_argument("--work", type=Path, default=Path("models/.train"), help="checkpoints for resuming")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=1000)
    parser.add_argument("--draft-steps", type=int, default=800)
    parser.add_argument("--draft-lr", type=float, default=3e-3, help="the draft's peak learning rate")
    parser.add_argument("--draft-init", type=Path, default=None,
                        help="start the draft from this checkpoint directory instead of random weights")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--precision", choices=["bfloat16", "float32"], default="bfloat16",
                        help="training compute: bfloat16 autocast (the shipped target's) or float32")
    parser.add_argument("--draft-only", action="store_true",
                        help="distil only the draft, from the target already in --out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    autocast = args.precision == "bfloat16"
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    target_dir, draft_dir = args.out / "demo-target", args.out / "demo-draft"
    target_dir.mkdir(parents=True, exist_ok=True)
    draft_dir.mkdir(parents=True, exist_ok=True)

    tok_path = args.work / "tokenizer.json"
    if args.draft_only:
        tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    elif tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
    else:
        sources = [s for s in stdlib_sources() if not s.heldout]
        tok = train_tokenizer([s.text for s in sources] + [c for s in sources for c in docstring_chats(s)], args.work)
    stream, heldout = build_stream(tok, args.seed)
    print(f"corpus: {len(stream)} train tokens, {len(heldout)} held-out tokens", flush=True)
    report: dict[str, object] = {"corpus": "Python standard library source (held out: 1 file in 10)",
                                 "train_tokens": len(stream), "heldout_tokens": len(heldout),
                                 "seq_len": SEQ_LEN, "batch": args.batch, "seed": args.seed}

    # What the models already in --out were trained with, where this run builds on them.
    previous = (json.loads((args.out / "training_report.json").read_text())
                if args.draft_only or args.draft_init is not None else {})
    if args.draft_only:
        # The served target as the teacher: the bfloat16 weights every engine loads.
        target = LlamaForCausalLM.from_pretrained(target_dir, packed=False)
        report["target"] = previous["target"]
    else:
        target = LlamaForCausalLM(TARGET)
        target.init_weights(args.seed)
        report["target"] = run_stage(Stage("target", args.target_steps, args.batch, 3e-3, autocast=autocast), target,
                                     None, stream, heldout, args.work, args.seed)
    target.requires_grad_(False)
    draft = LlamaForCausalLM(DRAFT)
    if args.draft_init is None:
        draft.init_weights(args.seed + 1)
    else:
        draft.load_state_dict(LlamaForCausalLM.from_pretrained(args.draft_init, packed=False).state_dict())
    draft_report: dict[str, object] = {
        **run_stage(Stage("draft", args.draft_steps, args.batch, args.draft_lr, warmup=20 if args.draft_init else 50,
                          autocast=autocast), draft, target, stream, heldout, args.work, args.seed + 1),
        "precision": args.precision, "lr": args.draft_lr}
    if args.draft_init is not None:
        draft_report["continued_from"] = previous["draft"]
    if args.draft_only:
        draft_report["teacher"] = "the shipped target (bfloat16 weights)"
    report["draft"] = draft_report

    declare_bos(tok)
    for directory, model in ((target_dir, target), (draft_dir, draft))[int(args.draft_only):]:
        model.save_pretrained(directory)
        tok.save(str(directory / "tokenizer.json"))
        write_tokenizer_metadata(directory)
    prompts = heldout_prompts(64, seed=args.seed)
    (args.work / "heldout_prompts.json").write_text(json.dumps(prompts))
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
