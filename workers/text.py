"""Text in and out of the engine: tokenizer, chat template, incremental detokenizer, stops.

The engine sees token ids only; this module is the one place that turns requests into ids
and ids back into the text a client receives.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from workers.api.wire import ChatMessage


class TextCodec:
    """A model directory's own prompt encoding, as vLLM and transformers read it.

    ``tokenizer.json`` (its post-processor adds BOS where the model wants one) encodes a text
    prompt with special tokens; a chat is rendered by ``tokenizer_config.json``'s Jinja chat
    template (which writes BOS itself) and encoded without, exactly as vLLM's OpenAI server
    does. So the same request is the same token ids on every engine.
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special: Mapping[str, str]) -> None:
        self.tokenizer = tokenizer
        self.special = dict(special)  # bos_token, eos_token, ... as the template sees them
        self._template = _JINJA.from_string(chat_template) if chat_template else None

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> TextCodec:
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token")}
        return cls(tokenizer, config.get("chat_template"), {k: v for k, v in special.items() if v is not None})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt (``/v1/completions``): special tokens as the tokenizer adds them."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        ids: list[int] = self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids
        return ids

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        """The chat as the template renders it. ``continue_final_message``: the last message left
        open for the model to continue (no end-of-turn after it), as transformers cuts it."""
        if self._template is None:
            raise ValueError("the model has no chat template (tokenizer_config.json chat_template)")
        text: str = self._template.render(messages=[{"role": m.role, "content": m.content} for m in messages],
                                          add_generation_prompt=add_generation_prompt, **self.special)
        if continue_final_message:
            final = messages[-1].content
            if final not in text:
                final = final.strip()
                if final not in text:
                    raise ValueError("the chat template does not render the final message's text as given")
            text = text[:text.rindex(final) + len(final)]
        return text

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def token_strs(self, ids: Sequence[int]) -> list[str | None]:
        """Each id's token as the vocabulary spells it (``Ġthe``), as transformers' convert_ids_to_tokens."""
        return [self.tokenizer.id_to_token(i) for i in ids]


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken mapping."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


# Chat templates are data from a model directory: render them sandboxed, as transformers does.
_JINJA = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)


@dataclass
class TextStream:
    """Turns token ids into text deltas, holding back what could still become a stop string.

    ``push`` returns the text safe to send now; ``stopped`` turns True when a stop string
    appears, and the text never includes the stop string itself. Tokens count as vLLM counts
    them, one at a time: a push that completes a stop string keeps its tokens up to and
    including the one that completed it (``last_kept``) and drops the rest, which the client
    never sees, so ``ids`` is exactly the completion the usage counts.
    """

    codec: TextCodec
    stop: tuple[str, ...] = ()
    # vLLM's min_tokens (its v1 detokenizer): stop strings are looked for once more than this
    # many tokens exist, in the text after token ``min_tokens`` with a look-back of each stop
    # string's length minus one. A stop completed by token ``min_tokens`` or earlier stays in the
    # text and generation goes on; one completed after it (straddling the boundary too) ends it.
    min_tokens: int = 0
    ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the decoded text already returned
    stopped: bool = False
    last_kept: int = 0  # of the last push's ids, how many count (all, unless a stop cut them)
    _text: str = ""
    # Characters of the text of the first ``min_tokens`` tokens: no stop string ending within
    # them is found (known once the tokens pass ``min_tokens``; 0 without min_tokens).
    _floor: int = 0

    def push(self, new_ids: list[int]) -> str:
        self.last_kept = 0
        if self.stopped or not new_ids:
            return ""
        before = len(self.ids)
        self.ids.extend(new_ids)
        text = self._decode(self.ids)
        self._text = text
        self.last_kept = len(new_ids)
        if not self.stop:
            return self._emit(len(text))
        longest = max(len(s) for s in self.stop)
        if len(self.ids) <= self.min_tokens:  # too early for a stop string: hold back as usual
            return self._emit(len(text) - longest + 1)
        if before <= self.min_tokens:  # this push passes min_tokens: where its tokens' text ends
            self._floor = len(self._decode(self.ids[:self.min_tokens])) if self.min_tokens else 0
        # Text before the window was already searched, when it was pushed.
        window_start = max(0, self.sent - longest)
        cut = self._find_stop(text, window_start)
        if cut is None:
            return self._emit(len(text) - longest + 1)
        # Several tokens at once (a speculative step): the stop belongs to the first of them
        # whose inclusion completes one; the text is cut where that prefix's earliest stop begins.
        # Only prefixes past min_tokens tokens may hold one.
        for n in range(max(1, self.min_tokens - before + 1), len(new_ids)):
            prefix_cut = self._find_stop(self._decode(self.ids[:before + n]), window_start)
            if prefix_cut is not None:
                cut = prefix_cut
                del self.ids[before + n:]
                self.last_kept = n
                break
        self.stopped = True
        self._text = text[:cut]
        return self._emit(cut)

    def prime(self, ids: list[int], sent: int) -> None:
        """Continue a generation begun elsewhere (a resumed request): ``ids`` were generated and
        ``sent`` characters of their text were delivered. What was held back stays held back, so
        a stop string spanning the boundary is still found and never sent."""
        self.ids = list(ids)
        self._text = self._decode(self.ids)
        self.sent = min(sent, len(self._text))
        if self.min_tokens and len(self.ids) > self.min_tokens:
            self._floor = len(self._decode(self.ids[:self.min_tokens]))

    def flush(self) -> str:
        """Whatever was held back, once generation has ended without a stop string."""
        return self._emit(len(self._text))

    def _decode(self, ids: list[int]) -> str:
        text = self.codec.decode(ids)
        # A multi-byte character split across tokens decodes to U+FFFD until it completes.
        while text.endswith("\ufffd"):
            text = text[:-1]
        return text

    def _find_stop(self, text: str, start: int) -> int | None:
        """Where the earliest stop string found from ``start`` begins; each must end past the
        ``min_tokens`` floor (begin at or after the floor less its length minus one)."""
        hits = [i for i in (text.find(s, max(start, self._floor - len(s) + 1)) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _emit(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = self._text[self.sent:upto]
        self.sent = upto
        return delta
