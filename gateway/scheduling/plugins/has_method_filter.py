"""``has-method-filter``: only workers that speculate with ``method`` (a configured profile's
fixed method; placement's last stage uses it for the method the policy wants)."""

from __future__ import annotations

from typing import ClassVar

from gateway.scheduling.framework import Candidate, Choices, Cycle, Filter, Parameters
from policies.methods import METHODS, Method


class HasMethodFilter(Filter):
    type_name = "has-method-filter"
    parameters: ClassVar[Parameters] = {"method": (str, "draft", None, None)}
    method: str = "draft"
    choices: ClassVar[Choices] = {"method": METHODS}

    def filter(self, cycle: Cycle, endpoints: list[Candidate]) -> list[Candidate]:
        return serving_method(endpoints, self.method)  # type: ignore[arg-type]


def serving_method(endpoints: list[Candidate], method: Method) -> list[Candidate]:
    return [c for c in endpoints if "speculative" in c.modes and method in c.methods]
