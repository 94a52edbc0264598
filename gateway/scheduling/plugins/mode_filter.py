"""``mode-filter``: only workers that serve ``mode`` (speculative or plain). Placement's last
stage uses it for the mode pair (``Route.other_id``) over workers of one fixed mode each."""

from __future__ import annotations

from typing import ClassVar

from gateway.scheduling.framework import Candidate, Choices, Cycle, Filter, Parameters


class ModeFilter(Filter):
    type_name = "mode-filter"
    parameters: ClassVar[Parameters] = {"mode": (str, "speculative", None, None)}
    mode: str = "speculative"
    choices: ClassVar[Choices] = {"mode": ("speculative", "plain")}

    def filter(self, cycle: Cycle, endpoints: list[Candidate]) -> list[Candidate]:
        return [c for c in endpoints if self.mode in c.modes]
