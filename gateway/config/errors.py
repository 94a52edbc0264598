"""The configuration error every config section raises (it names the field and the value), and
the collector that lets a parser report every bad field instead of stopping at the first."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from policies.config import FieldError, bounded_repr, bounded_text, raise_problems

T = TypeVar("T")


class ConfigError(FieldError):
    def __init__(self, field: str, value: object, problem: str) -> None:
        field = bounded_text(field, 100)  # an unknown key is the file's text
        super().__init__(f"{field}: {problem} (got {bounded_repr(value)})", field, value)


class Problems:
    """Every field problem of one parse, in the order found.

    A parser reads each field through ``check``: a bad one is recorded and a stand-in (its
    default) returned, so parsing goes on to the next field; ``raise_any`` ends the parse with
    one error carrying them all (``FieldError.problems``).
    """

    def __init__(self) -> None:
        self.found: list[FieldError] = []

    def check(self, parse: Callable[[], T], stand_in: T) -> T:
        try:
            return parse()
        except FieldError as exc:
            self.found.extend(exc.problems)
            return stand_in

    def add(self, error: FieldError) -> None:
        self.found.extend(error.problems)

    def failed(self, field: str) -> bool:
        """Whether ``field`` has a problem already (a rule that reads it would only restate it)."""
        return any(problem.field == field for problem in self.found)

    def raise_any(self) -> None:
        raise_problems(self.found)
