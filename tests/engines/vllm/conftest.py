"""The vLLM tests' shared ``tiny-llm`` deployment (``vllm_env``, the temporary home every vLLM
process of the session uses, is in ``tests/engines/conftest.py``: the qwen3-omni vLLM thinker's
tests use it too)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engines.vllm.servers import Server, tiny_llm


@pytest.fixture(scope="session")
def tiny_llm_server(
    vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One unsplit ``tiny-llm`` for the session (``servers.py``): the OpenAI-route tests and
    the prefill/decode split's reference answers use the same deployment."""
    with tiny_llm(tmp_path_factory.mktemp("vllm-tiny-llm")) as server:
        yield server
