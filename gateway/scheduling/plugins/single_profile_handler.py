"""``single-profile-handler`` (GIE's): one profile for every request."""

from __future__ import annotations

from collections.abc import Mapping

from gateway.scheduling.framework import Cycle, Profile, ProfileHandler


class SingleProfileHandler(ProfileHandler):
    type_name = "single-profile-handler"

    def choose(self, cycle: Cycle, profiles: Mapping[str, Profile]) -> Profile:
        return next(iter(profiles.values()))
