"""The vLLM lane's fixtures (``make test-vllm``): real vLLM OpenAI servers, started once per
session when a test asks, on the demo pair or the real one (SmolLM2-135M-Instruct and its
expanded draft, from ``make install-vllm``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.vllm.vllm_harness import REAL_PAIR, VllmServer, start_vllm_server


@pytest.fixture(scope="session")
def vllm_plugin_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM with the demo pair (K = 3) and specgate's scheduler plugin, per-step metrics."""
    server = start_vllm_server(tmp_path_factory.mktemp("vllm-plugin"), speculative=True, plugin=True,
                               metrics_level="detailed")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_ngram_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM with the demo target and prompt lookup (ngram, K = 3) for its life, through
    specgate's scheduler plugin, per-step metrics."""
    server = start_vllm_server(tmp_path_factory.mktemp("vllm-ngram"), speculative=True, plugin=True,
                               metrics_level="detailed", method="ngram")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM with the target alone: the no-speculation reference."""
    server = start_vllm_server(tmp_path_factory.mktemp("vllm-plain"), speculative=False, plugin=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_real_plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM with the converted SmolLM2-135M-Instruct alone, float32: the real pair's reference."""
    server = start_vllm_server(tmp_path_factory.mktemp("vllm-real-plain"), speculative=False, plugin=False,
                               pair=REAL_PAIR)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_real_plugin_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM with SmolLM2-135M-Instruct and its distilled draft expanded to the full vocabulary
    (K = 3), float32, through specgate's scheduler plugin, per-step metrics."""
    server = start_vllm_server(tmp_path_factory.mktemp("vllm-real-plugin"), speculative=True, plugin=True,
                               metrics_level="detailed", pair=REAL_PAIR)
    yield server
    server.stop()
