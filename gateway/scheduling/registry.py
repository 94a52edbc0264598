"""The plugin types a ``routing:`` section may name, by their config ``type``. A new plugin is a
module under ``plugins/`` and one line here; a caller may parse with types of its own beside
these (``config.parse_routing``'s ``types``: a test's scorer)."""

from __future__ import annotations

from gateway.scheduling.framework import Plugin
from gateway.scheduling.plugins.has_method_filter import HasMethodFilter
from gateway.scheduling.plugins.load_bound_filter import LoadBoundFilter
from gateway.scheduling.plugins.load_guard import LoadGuard
from gateway.scheduling.plugins.load_scorer import LoadScorer
from gateway.scheduling.plugins.max_score_picker import MaxScorePicker
from gateway.scheduling.plugins.method_agreement_scorer import MethodAgreementScorer
from gateway.scheduling.plugins.method_placement import MethodPlacement
from gateway.scheduling.plugins.min_prefix_hit import MinPrefixHit
from gateway.scheduling.plugins.mode_filter import ModeFilter
from gateway.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from gateway.scheduling.plugins.ready_filter import ReadyFilter
from gateway.scheduling.plugins.session_affinity_scorer import SessionAffinityScorer
from gateway.scheduling.plugins.single_profile_handler import SingleProfileHandler
from gateway.scheduling.plugins.sticky_placement import StickyPlacement

PLUGIN_TYPES: dict[str, type[Plugin]] = {cls.type_name: cls for cls in (
    ReadyFilter, LoadBoundFilter, HasMethodFilter, ModeFilter,
    LoadGuard, MethodPlacement, StickyPlacement, MinPrefixHit,
    PrefixCacheScorer, LoadScorer, SessionAffinityScorer, MethodAgreementScorer,
    MaxScorePicker, SingleProfileHandler)}

