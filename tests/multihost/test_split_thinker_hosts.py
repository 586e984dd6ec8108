"""A split qwen3-omni thinker across two test hosts (network namespaces joined by a bridge):
the prefill engine on host ``a``, the decode engine on host ``b``, UCX restricted to TCP
(``UCX_TLS=tcp``: two namespaces of one kernel would otherwise read each other's memory
directly). The params' agent metadata is all the decode side needs to reach the prefill
engine: its answers, text and audio in, are the unsplit thinker's, bit for bit, from pulled
state. With host ``a`` cut off, the same params' reads fail and host ``b`` prefills each
request itself: the same answers, counted failed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.multihost.hosts import TestHosts
from tests.procs import clean_env, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PEER = "tests.multihost.split_peer"


def test_the_decode_host_pulls_the_prefill_hosts_state_over_tcp(tmp_path: Path) -> None:
    hosts = TestHosts(["a", "b"], tmp_path)
    try:
        env = {**clean_env(), "UCX_TLS": "tcp"}
        out = tmp_path / "params.jsonl"
        prefill = hosts["a"].spawn(
            [sys.executable, "-m", PEER, "prefill", str(out)], name="prefill", env=env
        )
        wait_until(
            lambda: out.exists() and out.read_text().endswith("done\n"),
            90,
            interval=0.2,
            message=lambda: prefill.describe(),
        )
        result = _decode(hosts, out, env, "decode")
        assert result["equal"] == [True, True], result
        assert result["pulled"] == 2 and result["failed"] == 0 and result["bytes"] > 0, result
        assert prefill.alive  # it served the reads
        # The same params with host a unreachable: the reads fail (the path was the network),
        # each request is prefilled on host b, with the same answers.
        hosts["a"].link_down()
        result = _decode(hosts, out, env, "decode-cut")
        assert result["equal"] == [True, True], result
        assert result["pulled"] == 0 and result["failed"] == 2, result
    finally:
        hosts.close()


def _decode(hosts: TestHosts, params: Path, env: dict[str, str], name: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", PEER, "decode", str(params), "2"]
    decode = hosts["b"].spawn(argv, name=name, env=env)
    assert decode.wait(120) == 0, decode.describe()
    line = [x for x in decode.stdout.splitlines() if x.startswith("{")][-1]
    return json.loads(line)  # type: ignore[no-any-return]
