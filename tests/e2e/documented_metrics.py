"""The metric series docs/metrics.md documents, and a series' base name (dashboards and
observability tests)."""

from __future__ import annotations

import re

from dashboards.observe import REPO

METRICS_DOC = REPO / "docs" / "metrics.md"


def documented_metrics() -> set[str]:
    """Metric names in docs/metrics.md's tables (first column, in backticks)."""
    names = set()
    for line in METRICS_DOC.read_text().splitlines():
        match = re.match(r"\|\s*`((?:specgate_|vllm:)[a-z0-9_:]+)`", line)
        if match:
            names.add(match.group(1))
    return names


def base_name(series: str) -> str:
    """A histogram's series as its documented name (``x_bucket`` -> ``x``)."""
    return re.sub(r"_(bucket|sum|count|gcount|gsum)$", "", series)
