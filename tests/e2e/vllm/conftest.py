"""The vLLM lane's fixtures (``make test-vllm``): real vLLM OpenAI servers on the demo pair or the
real one (SmolLM2-135M-Instruct and its expanded draft, from ``make install-vllm``), one of each
per session.

Every session server the collected tests ask for is launched when the first of them is asked
for, side by side, and each fixture waits for its own: a vLLM server spends most of its minute
of start-up in one thread (imports, loading), so on two cores they load in about half the time
one after another took. They lived to the session's end before too, so the lane's peak memory is
what it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.e2e.vllm.vllm_harness import LAUNCHED_TIMEOUT_S, REAL_PAIR, VllmServer, launch_vllm_server

# The session servers by fixture name: launch_vllm_server's arguments.
SERVERS: dict[str, dict[str, Any]] = {
    # the demo pair (K = 3) and specgate's scheduler plugin, per-step metrics
    "vllm_plugin_server": {"speculative": True, "plugin": True, "metrics_level": "detailed"},
    # the demo target and prompt lookup (ngram, K = 3) for its life, through the plugin, per-step metrics
    "vllm_ngram_server": {"speculative": True, "plugin": True, "metrics_level": "detailed", "method": "ngram"},
    # the target alone: the no-speculation reference
    "vllm_plain_server": {"speculative": False, "plugin": False},
    # the converted SmolLM2-135M-Instruct alone, float32: the real pair's reference
    "vllm_real_plain_server": {"speculative": False, "plugin": False, "pair": REAL_PAIR},
    # SmolLM2-135M-Instruct and its distilled draft expanded to the full vocabulary (K = 3), float32,
    # through the plugin, per-step metrics
    "vllm_real_plugin_server": {"speculative": True, "plugin": True, "metrics_level": "detailed", "pair": REAL_PAIR},
}


@dataclass
class Launched:
    """The session's servers: launched together, each waited for once."""

    servers: dict[str, VllmServer]
    ready: set[str] = field(default_factory=set)

    def get(self, name: str) -> VllmServer:
        server = self.servers[name]
        if name not in self.ready:
            server.wait_ready("/health", LAUNCHED_TIMEOUT_S)
            self.ready.add(name)
        return server


@pytest.fixture(scope="session")
def _launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    wanted = sorted({name for item in request.session.items for name in getattr(item, "fixturenames", ())
                     if name in SERVERS})
    launched = Launched({name: launch_vllm_server(tmp_path_factory.mktemp(name), **SERVERS[name]) for name in wanted})
    yield launched
    for server in launched.servers.values():
        server.stop()


@pytest.fixture(scope="session")
def vllm_plugin_server(_launched: Launched) -> VllmServer:
    return _launched.get("vllm_plugin_server")


@pytest.fixture(scope="session")
def vllm_ngram_server(_launched: Launched) -> VllmServer:
    return _launched.get("vllm_ngram_server")


@pytest.fixture(scope="session")
def vllm_plain_server(_launched: Launched) -> VllmServer:
    return _launched.get("vllm_plain_server")


@pytest.fixture(scope="session")
def vllm_real_plain_server(_launched: Launched) -> VllmServer:
    return _launched.get("vllm_real_plain_server")


@pytest.fixture(scope="session")
def vllm_real_plugin_server(_launched: Launched) -> VllmServer:
    return _launched.get("vllm_real_plugin_server")
