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

from workers.protocol import ChatMessage


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

    def encode(self, text: str) -> list[int]:
        """A text prompt (``/v1/completions``): special tokens as the tokenizer adds them."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=True).ids
        return ids

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        ids: list[int] = self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids
        return ids

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        if self._template is None:
            raise ValueError("the model has no chat template (tokenizer_config.json chat_template)")
        return self._template.render(messages=[{"role": m.role, "content": m.content} for m in messages],
                                     add_generation_prompt=True, **self.special)

    def decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text


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
    appears, and the text never includes the stop string itself.
    """

    codec: TextCodec
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the decoded text already returned
    stopped: bool = False
    _text: str = ""

    def push(self, new_ids: list[int]) -> str:
        if self.stopped or not new_ids:
            return ""
        self.ids.extend(new_ids)
        text = self.codec.decode(self.ids)
        # A multi-byte character split across tokens decodes to U+FFFD until it completes.
        while text.endswith("\ufffd"):
            text = text[:-1]
        self._text = text
        if self.stop:
            window_start = max(0, self.sent - max(len(s) for s in self.stop))
            hits = [i for i in (text.find(s, window_start) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                self._text = text = text[:min(hits)]
                return self._emit(len(text))
            return self._emit(len(text) - max(len(s) for s in self.stop) + 1)
        return self._emit(len(text))

    def flush(self) -> str:
        """Whatever was held back, once generation has ended without a stop string."""
        return self._emit(len(self._text))

    def _emit(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = self._text[self.sent:upto]
        self.sent = upto
        return delta
