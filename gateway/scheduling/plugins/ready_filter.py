"""``ready-filter``: only workers that are ready (GIE keeps unready pods out of its snapshot)."""

from __future__ import annotations

from gateway.scheduling.framework import Candidate, Cycle, Filter


class ReadyFilter(Filter):
    type_name = "ready-filter"

    def filter(self, cycle: Cycle, endpoints: list[Candidate]) -> list[Candidate]:
        return [c for c in endpoints if c.ready]
