"""YAML for operator input (config.yaml, ``PUT /admin/policy``), with the dangerous parts refused.

``yaml.safe_load`` constructs no objects, but it still expands aliases: a few hundred bytes of
nested anchors become gigabytes of lists (the "billion laughs"), and nesting thousands of
levels deep exhausts the recursive composer. Configuration never needs either, so this loader
refuses anchors and aliases outright and bounds the size and the nesting depth before any
value is built. Every error message is bounded too: it is shown to clients and kept in
``GET /admin/policy``.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.events import AliasEvent
from yaml.nodes import Node

from policies import bounded_text

MAX_DEPTH = 32  # config.yaml nests 4 levels; this leaves room without letting the composer recurse far
MAX_MESSAGE = 500


class YamlRefused(ValueError):
    """The text is not YAML this gateway accepts; the message says why (bounded)."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader without anchors or aliases and with a nesting limit, checked as nodes are composed."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, AliasEvent) or getattr(event, "anchor", None) is not None:
            raise ComposerError(None, None, "anchors and aliases (& and *) are not accepted", event.start_mark)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise ComposerError(None, None, f"nested more than {MAX_DEPTH} levels deep", event.start_mark)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(text: str, max_bytes: int) -> Any:
    """Parses one YAML (or JSON) document under the limits above; raises YamlRefused."""
    if len(text.encode()) > max_bytes:
        raise YamlRefused(f"YAML document exceeds {max_bytes} bytes")
    loader = _StrictLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise YamlRefused(f"invalid YAML: {bounded_text(str(exc), MAX_MESSAGE)}") from None
    except (ValueError, OverflowError, RecursionError) as exc:
        # A scalar the constructors choke on, e.g. an integer of more than 4300 digits.
        raise YamlRefused(f"invalid YAML value: {bounded_text(str(exc), MAX_MESSAGE)}") from None
    finally:
        loader.dispose()
