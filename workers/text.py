"""Text in and out of the engine: tokenizer, chat template, incremental detokenizer, stops.

The engine sees token ids only; this module is the one place that turns requests into ids
and ids back into the text a client receives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from workers.protocol import ChatMessage

# The chat template, also stored as Jinja in the models' tokenizer_config.json:
#   <|role|>\n{content}<|end|>\n   for each message, then   <|assistant|>\n
# Generation ends at <|end|>, one of the models' EOS ids.


def render_chat(messages: tuple[ChatMessage, ...] | list[ChatMessage]) -> str:
    rendered = "".join(f"<|{m.role}|>\n{m.content}<|end|>\n" for m in messages)
    return rendered + "<|assistant|>\n"


class TextCodec:
    def __init__(self, tokenizer_path: Path, bos_token_id: int | None) -> None:
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.bos_token_id = bos_token_id

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] if self.bos_token_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text


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
