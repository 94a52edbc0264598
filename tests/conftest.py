"""The suite's order: the longest modules first, so that `make test`'s processes (`-n 3 --dist
loadfile --no-loadscope-reorder`) end together. xdist's default order puts the modules with the
most tests first, which sent the bench smokes (one to six tests of 10-30 s each) last, one process
running them while the others sat idle."""

from __future__ import annotations

import pytest


def module_rank(item: pytest.Item) -> int:
    """0: a module with a test marked slow; 1: the rest of the end-to-end tier; 2: the unit tier."""
    if item.get_closest_marker("slow") is not None:
        return 0
    return 1 if item.nodeid.startswith("tests/e2e/") else 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A module keeps its tests together, in their own order (a module's fixtures are shared).
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        rank[module] = min(rank.get(module, 2), module_rank(item))
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])
