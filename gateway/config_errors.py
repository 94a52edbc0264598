"""The configuration error every config section raises: it names the field and the value."""

from __future__ import annotations

from policies.config import bounded_repr, bounded_text


class ConfigError(ValueError):
    def __init__(self, field: str, value: object, problem: str) -> None:
        field = bounded_text(field, 100)  # an unknown key is the file's text
        super().__init__(f"{field}: {problem} (got {bounded_repr(value)})")
        self.field = field
        self.value = value
