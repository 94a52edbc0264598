"""Drives sessions through a gateway as a user would, and pairs what the workers measured with
what the gateway believes: the ground truth for the acceptance estimate.

Each session sends its requests one after another with ``X-Session-ID``; sessions run side by
side up to ``concurrency``. A specgate worker's answer carries its own count of the drafts it
proposed, accepted and tested (``usage.speculative``, counted by the worker's server step by step,
not by the gateway); summed over a session they give its true α (accepted ÷ tested). After the
last request, ``/admin/sessions/{id}`` says what the gateway believes.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class SessionRun:
    session_id: str
    proposed: int = 0  # the workers' counts, summed over the session's requests
    accepted: int = 0
    tested: int = 0
    completion_tokens: int = 0
    modes: list[str] = field(default_factory=list)  # X-Specgate-Mode of each request
    admin: dict[str, Any] = field(default_factory=dict)  # /admin/sessions/{id} after the last request

    @property
    def true_alpha(self) -> float | None:
        return self.accepted / self.tested if self.tested else None

    @property
    def estimate(self) -> float | None:
        value = self.admin.get("acceptance_estimate")
        return None if value is None else float(value)

    @property
    def latched(self) -> bool:
        return bool(self.admin.get("low_acceptance"))


async def run_sessions(base_url: str, sessions: Sequence[Sequence[str]], *, model: str, max_tokens: int = 64,
                       temperature: float = 0.0, concurrency: int = 4, prefix: str = "s",
                       headers: dict[str, str] | None = None) -> list[SessionRun]:
    """Every session's requests in order (completions, not streamed); ``base_url`` the gateway's root."""
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers or {}) as http:

        async def one(index: int, prompts: Sequence[str]) -> SessionRun:
            run = SessionRun(f"{prefix}{index}")
            async with limit:
                for prompt in prompts:
                    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
                    async with http.post(base_url + "/v1/completions", json=body,
                                         headers={"X-Session-ID": run.session_id}) as response:
                        answer = await response.json()
                        if response.status != 200:
                            raise RuntimeError(f"{run.session_id}: HTTP {response.status}: {answer}")
                        run.modes.append(response.headers.get("X-Specgate-Mode", ""))
                    run.completion_tokens += int(answer["usage"]["completion_tokens"])
                    speculative = answer["usage"]["speculative"]
                    run.proposed += int(speculative["proposed"])
                    run.accepted += int(speculative["accepted"])
                    run.tested += int(speculative["tested"])
                async with http.get(f"{base_url}/admin/sessions/{run.session_id}") as response:
                    run.admin = await response.json()
            return run

        return list(await asyncio.gather(*(one(i, prompts) for i, prompts in enumerate(sessions))))


def summary(runs: Sequence[SessionRun], min_tested: int = 64) -> dict[str, Any]:
    """False fallbacks (latched sessions by true α band) and the estimate's error against the truth."""
    judged = [r for r in runs if r.true_alpha is not None and r.estimate is not None and r.tested >= min_tested]
    errors = [abs(r.estimate - r.true_alpha) for r in judged if r.estimate is not None and r.true_alpha is not None]
    high = [r for r in runs if r.true_alpha is not None and r.true_alpha >= 0.75]
    middle = [r for r in runs if r.true_alpha is not None and 0.70 <= r.true_alpha < 0.75]
    return {
        "sessions": len(runs),
        "true_alpha_median": round(statistics.median(r.true_alpha for r in runs if r.true_alpha is not None), 4)
        if any(r.true_alpha is not None for r in runs) else None,
        "sessions_at_or_above_0.75": len(high),
        "latched_at_or_above_0.75": sum(r.latched for r in high),
        "sessions_0.70_to_0.75": len(middle),
        "latched_0.70_to_0.75": sum(r.latched for r in middle),
        "latched_total": sum(r.latched for r in runs),
        "false_fallback_share": round(sum(r.latched for r in runs if r.true_alpha is not None
                                          and r.true_alpha >= 0.70) / max(1, len(high) + len(middle)), 4),
        "judged_sessions": len(judged),
        "median_abs_error": round(statistics.median(errors), 4) if errors else None,
        "max_abs_error": round(max(errors), 4) if errors else None,
        "gateway_counts_match_workers": all(
            r.admin.get("acceptance", {}).get("drafts_tested") == r.tested
            and r.admin.get("acceptance", {}).get("drafts_accepted") == r.accepted for r in runs),
    }
