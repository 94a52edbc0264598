"""Expand the distilled draft (``models/smollm2-draft``, reduced vocabulary) into a standard Hugging Face Llama
directory over the target's whole vocabulary, for vLLM, at install time (``make install-vllm``):

    python -m models.expand_draft --out models/smollm2-draft-full

vLLM's ``draft_model`` speculation loads a plain ``LlamaForCausalLM`` and wants the target's vocabulary on both
sides; the draft format (``models/draft_format.py``) has neither an embedding table (its input is the target's
table times ``embed_proj``) nor a full LM head. ``draft_format.expand_to_full_vocab`` writes both: the embedding
computed from the target's table, and a 49,152-row head with the draft's rows at its ``draft_vocab_ids`` and zero
rows elsewhere. Stored as float32 by default: the draft's bfloat16 weights widen exactly, and the computed
embedding is not rounded a second time (about 110 MB; the lane serves the pair in float32).

Idempotent, as ``models/convert_gguf.py``: the output's stamp records the sha256 of the draft's weights and
config and of the target's weights, the dtype and ``EXPANDER_VERSION``; when they match (and the files are
there) nothing is written. The expansion is written beside the output and renamed into place, so an
interrupted run never leaves a half-written directory under the output's name. The target must be the one the
draft was distilled from (``target_sha256`` in the draft's config), or nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from models.draft_format import DraftFormatError, expand_to_full_vocab, sha256_of

EXPANDER_VERSION = 1  # bump whenever the same draft and target would expand to different files
REPO = Path(__file__).resolve().parents[1]
DEFAULT_DRAFT = REPO / "models" / "smollm2-draft"
DEFAULT_TARGET = REPO / "models" / "smollm2-135m-instruct-q4_1"
DEFAULT_OUT = REPO / "models" / "smollm2-draft-full"
STAMP = "expansion_stamp.json"
OUTPUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def stamp_for(draft_dir: Path, target_dir: Path, dtype: str) -> dict[str, Any]:
    """What an expansion of ``draft_dir`` against ``target_dir`` records; every file it reads must exist."""
    for path in (draft_dir / "model.safetensors", draft_dir / "config.json", target_dir / "model.safetensors"):
        if not path.is_file():
            raise DraftFormatError(f"{path}: missing")
    return {"draft": draft_dir.name, "draft_sha256": sha256_of(draft_dir / "model.safetensors"),
            "draft_config_sha256": sha256_of(draft_dir / "config.json"),
            "target_sha256": sha256_of(target_dir / "model.safetensors"), "dtype": dtype,
            "expander_version": EXPANDER_VERSION}


def up_to_date(out: Path, stamp: Mapping[str, Any]) -> bool:
    """Whether ``out`` holds a complete expansion whose stamp matches ``stamp``."""
    try:
        saved = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(saved, dict) and all(saved.get(key) == value for key, value in stamp.items())
            and all((out / name).is_file() for name in OUTPUT_FILES))


def expand(draft_dir: Path, target_dir: Path, out: Path, dtype: str = "float32") -> bool:
    """Expand ``draft_dir`` into ``out``; False when ``out`` already is this expansion."""
    stamp = stamp_for(draft_dir, target_dir, dtype)
    if up_to_date(out, stamp):
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        expand_to_full_vocab(draft_dir, target_dir, staging, dtype=DTYPES[dtype])
        (staging / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        # mkdtemp's 0700 would hide the model from other users (vLLM's or a worker's).
        staging.chmod(0o755)
        for written in staging.iterdir():
            written.chmod(0o644)
        _swap_in(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return True


def _swap_in(staging: Path, out: Path) -> None:
    """Rename ``staging`` to ``out``, an old ``out`` renamed aside first and removed after (as convert_gguf
    does): a directory cannot be renamed over a non-empty one, and ``out`` is briefly absent, never partial."""
    if not (out.exists() or out.is_symlink()):
        os.rename(staging, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}-{time.time_ns()}")
    os.rename(out, old)
    os.rename(staging, out)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.expand_draft",
                                     description="Expand a reduced-vocabulary draft into a full-vocabulary "
                                                 "Hugging Face Llama directory (for vLLM).")
    parser.add_argument("--draft", type=Path, default=DEFAULT_DRAFT, help="the draft (default: %(default)s)")
    parser.add_argument("--target", type=Path, default=DEFAULT_TARGET,
                        help="the target it was distilled from (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the output directory (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="the weights' dtype in the output (default: %(default)s)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        expanded = expand(args.draft, args.target, args.out, args.dtype)
    except DraftFormatError as e:
        print(f"expand_draft: {e}", file=sys.stderr)
        return 1
    took = time.monotonic() - started
    if expanded:
        size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
        print(f"{args.out}: expanded {args.draft} in {took:.1f} s ({size / 1e6:.0f} MB)")
    else:
        print(f"{args.out}: up to date with {args.draft} and {args.target} (checked in {took:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
