"""The vLLM lane's fixtures (``make test-vllm``): real vLLM OpenAI servers, started once per
session when a test asks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.vllm.vllm_harness import VllmServer, start_vllm_server


@pytest.fixture(scope="session")
def vllm_plugin_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM with the demo pair (K = 3) and specgate's scheduler plugin, per-step metrics."""
    server = start_vllm_server(tmp_path_factory.mktemp("vllm-plugin"), speculative=True, plugin=True,
                               metrics_level="detailed")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM with the target alone: the no-speculation reference."""
    server = start_vllm_server(tmp_path_factory.mktemp("vllm-plain"), speculative=False, plugin=False)
    yield server
    server.stop()
