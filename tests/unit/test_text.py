"""Text in and out of the engine: chat template, incremental detokenizing, stop strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.api.wire import ChatMessage
from workers.text import TextCodec, TextStream

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "demo-target"
BOS = 0


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_model_dir(MODEL_DIR)


def stream_all(codec: TextCodec, text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], TextStream]:
    ids = codec.encode(text)[1:]
    stream = TextStream(codec, stop)
    deltas = [stream.push([token]) for token in ids]
    if not stream.stopped:
        deltas.append(stream.flush())
    return deltas, stream


def test_chat_is_rendered_by_the_model_directorys_template(codec: TextCodec) -> None:
    rendered = codec.render_chat([ChatMessage("system", "be brief"), ChatMessage("user", "hi")])
    assert rendered == "<|endoftext|><|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"


def test_special_tokens_are_single_ids(codec: TextCodec) -> None:
    ids = codec.encode("<|user|>\nx<|end|>")
    assert ids[0] == BOS and ids[1] == 2 and 4 in ids


@pytest.mark.parametrize("model", ["demo-target", "demo-draft"])
def test_one_prompt_encoding_declared_by_the_model_directory(model: str) -> None:
    """D1: text and chat prompts start with exactly one BOS, as the directory declares for
    every tokenizer that reads it (tokenizer.json post-processor, add_bos_token, template)."""
    codec = TextCodec.from_model_dir(MODEL_DIR.parent / model)
    config = json.loads((MODEL_DIR.parent / model / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["bos_token"] == "<|endoftext|>"
    bare = codec.tokenizer.encode("def f():", add_special_tokens=False).ids
    assert codec.encode("def f():") == [BOS, *bare]
    chat = codec.encode_chat([ChatMessage("user", "hi")])
    assert chat[0] == BOS and chat[1] != BOS and chat[1] == 2  # <|user|>
    assert codec.encode("") == [BOS]


@pytest.mark.parametrize("text", ["def f(x):\n    return x + 1\n", "naïve café – 日本語 ✓", "a\tb\r\nc"])
def test_deltas_reassemble_the_text(codec: TextCodec, text: str) -> None:
    deltas, _ = stream_all(codec, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)  # split multi-byte characters are held back


@pytest.mark.parametrize(("text", "stop", "expected"), [
    ("def f(x):\n    return x\n\ndef g", ("\n\n",), "def f(x):\n    return x"),
    ("alpha beta gamma", ("gam", "beta"), "alpha "),  # the earliest stop wins
    ("alpha beta", ("zeta",), "alpha beta"),  # no stop: everything, after flush
    ("x = 1 # done", ("# done",), "x = 1 "),
])
def test_stop_strings_cut_exactly(codec: TextCodec, text: str, stop: tuple[str, ...], expected: str) -> None:
    deltas, stream = stream_all(codec, text, stop)
    assert "".join(deltas) == expected
    assert stream.stopped == (expected != text)


def test_nothing_after_a_stop(codec: TextCodec) -> None:
    stream = TextStream(codec, ("STOP",))
    stream.push(codec.encode("abc STOP")[1:])
    assert stream.stopped
    assert stream.push(codec.encode(" more")[1:]) == "" and stream.flush() == ""


def test_a_stop_inside_a_multi_token_push_keeps_tokens_up_to_it(codec: TextCodec) -> None:
    """A speculative step pushes several tokens at once; only those up to the one that completed
    the stop string count (vLLM adds tokens one by one and stops there)."""
    ids = codec.encode("alpha beta gamma delta epsilon")[1:]
    needed = next(n for n in range(1, len(ids) + 1) if "gam" in codec.decode(ids[:n]))
    assert needed < len(ids)
    stream = TextStream(codec, ("gam",))
    first = stream.push(ids[:1])
    assert stream.last_kept == 1 and not stream.stopped
    assert first + stream.push(ids[1:]) == "alpha beta "
    assert stream.stopped and stream.last_kept == needed - 1 and stream.ids == ids[:needed]


@pytest.mark.parametrize("cut", range(1, 12))
def test_a_primed_stream_continues_as_if_never_interrupted(codec: TextCodec, cut: int) -> None:
    """A resumed request (mid-stream migration): a fresh TextStream primed with the ids generated
    so far and the characters already sent delivers exactly the rest, and finds a stop string
    that spans the boundary."""
    text = "def f(x):\n    return x + 1\n\nEND of it"
    ids = codec.encode(text)[1:]
    stop = ("\n\nEND",)
    whole, reference = stream_all(codec, text, stop)
    first = TextStream(codec, stop)
    sent = "".join(first.push([t]) for t in ids[:cut])
    resumed = TextStream(codec, stop)
    resumed.prime(ids[:cut], len(sent))
    rest = []
    for token in ids[cut:]:
        rest.append(resumed.push([token]))
        if resumed.stopped:
            break
    if not resumed.stopped:
        rest.append(resumed.flush())
    assert sent + "".join(rest) == "".join(whole) == "def f(x):\n    return x + 1"
    assert resumed.stopped and resumed.ids == reference.ids


def vllm_stop_text(codec: TextCodec, pushes: list[list[int]], stop: str, min_tokens: int) -> tuple[str, bool]:
    """vLLM's v1 detokenizer on one stop string: a push's tokens decoded one by one; once more
    than ``min_tokens`` exist, the stop is looked for in the text after token ``min_tokens`` (or
    after what the pushes before searched) with a look-back of its length minus one; the text
    ends before the match."""
    ids: list[int] = []
    text = ""
    for push in pushes:
        offset = len(text)
        for token in push:
            ids.append(token)
            text = codec.decode(ids)
            if min_tokens and len(ids) <= min_tokens:
                offset = len(text)
        if len(ids) > min_tokens:
            found = text.find(stop, max(0, offset - len(stop) + 1))
            if found >= 0:
                return text[:found], True
    return text, False


COUNT = "1. 1\n2. 2\n3. 3\n4. 4"  # tokens: '1' '.' ' 1' '\n' '2' '.' ' 2' '\n' '3' ...


@pytest.mark.parametrize("stop", ["2", "\n2", "1\n2", ". 3"])
@pytest.mark.parametrize("min_tokens", range(0, 12))
@pytest.mark.parametrize("push", [1, 3, 32])  # one token a step, a speculative step of 3, all at once
def test_min_tokens_with_stop_matches_vllm(codec: TextCodec, stop: str, min_tokens: int, push: int) -> None:
    """The table of issue 52: a stop completed by token ``min_tokens`` or earlier stays and
    generation goes on; one straddling the boundary or after it ends the text before it; in
    single-token pushes (streamed, plain) and multi-token ones (speculative steps), the same."""
    ids = codec.encode(COUNT)[1:]
    pushes = [ids[i:i + push] for i in range(0, len(ids), push)]
    expected, stopped = vllm_stop_text(codec, pushes, stop, min_tokens)
    stream = TextStream(codec, (stop,), min_tokens=min_tokens)
    deltas = []
    for piece in pushes:
        deltas.append(stream.push(piece))
        if stream.stopped:
            break
    if not stream.stopped:
        deltas.append(stream.flush())
    assert ("".join(deltas), stream.stopped) == (expected, stopped)
    if stopped:  # the tokens that count end with the one that completed the stop, past min_tokens
        assert len(stream.ids) > min_tokens and stop in codec.decode(stream.ids)


@pytest.mark.parametrize(("min_tokens", "expected"), [
    (4, "1. 1\n"),  # the '2' completing the first "2" is token 5: past min_tokens 4, found
    (5, "1. 1\n2. "),  # token 5 completes it at the boundary: ignored; the ' 2' (token 7) ends it
    (6, "1. 1\n2. "),
    (7, "1. 1\n2. 2\n3. 3\n4. 4"),  # every "2" completed by token 7 or before: none ends it
])
def test_the_issue_cases(codec: TextCodec, min_tokens: int, expected: str) -> None:
    ids = codec.encode(COUNT)[1:]
    for pushes in ([[t] for t in ids], [ids]):
        stream = TextStream(codec, ("2",), min_tokens=min_tokens)
        text = "".join(stream.push(p) for p in pushes)
        text += "" if stream.stopped else stream.flush()
        assert text == expected
