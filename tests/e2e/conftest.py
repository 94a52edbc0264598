"""The e2e tier: real gateway, worker, Envoy, Redis and vLLM processes on loopback.

``gateway`` is one default gateway (one embedded worker) for the session, shared by the modules
that only send it requests; a module that needs another configuration, or changes the gateway's
state (its policy, its workers), starts its own with ``gateway_factory``, stopped when the module
ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.harness import Gateway, GatewayFactory, start_gateway, write_config


@pytest.fixture(scope="module")
def gateway_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayFactory]:
    """``(name, *, env=..., args=..., workers_ready=N, **sections) -> Gateway``: a gateway on
    ``write_config``'s test defaults updated with ``sections``, ``env`` and ``args`` as
    ``start_gateway`` takes them; with ``workers_ready``, returned once that many workers are."""
    started: list[Gateway] = []

    def start(name: str, *, env: dict[str, str] | None = None, args: tuple[str, ...] = (),
              workers_ready: int = 0, **sections: dict[str, Any]) -> Gateway:
        tmp = tmp_path_factory.mktemp(name)
        gateway = start_gateway(write_config(tmp / "config.yaml", **sections), tmp, env=env, args=args)
        started.append(gateway)
        if workers_ready:
            gateway.wait_workers_ready(workers_ready)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The default test gateway (one worker, 16 slots), shared by modules that only send requests."""
    tmp = tmp_path_factory.mktemp("gw-default")
    gw = start_gateway(write_config(tmp / "config.yaml", workers={"count": 1}), tmp)
    yield gw
    gw.stop()
