"""The configuration error every config.yaml section raises (it names the field and the value),
and the collector that lets a parser report every bad field instead of stopping at the first
(``policies.config``'s, which the routing section's parser below this room shares)."""

from __future__ import annotations

from policies.config import Problems, SectionError

__all__ = ["ConfigError", "Problems"]


class ConfigError(SectionError):
    """A config.yaml field's problem."""
