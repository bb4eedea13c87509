"""Interop with a router nobody here wrote: SGLang's router (PyPI ``sglang-router``) in
``--dp-aware`` mode discovers our dp_size through /server_info and injects data_parallel_rank;
the engine's per-rank metrics show every rank served its share."""

import shutil
import sys
from pathlib import Path

import httpx
import pytest

from harness.procs import free_port, metrics, sglang_router_command, start, start_engine

pytestmark = pytest.mark.slow

DP = 2


def router_cmd(worker: str, port: int, policy: str) -> list[str]:
    assert shutil.which("sglang-router", path=str(Path(sys.executable).parent)), (
        "sglang-router is a test dependency (requirements.txt)"
    )
    return sglang_router_command(worker, port=port, policy=policy)


def test_sglang_router_dp_aware_ranks_are_honoured(tmp_path):
    with start_engine(tmp_path, "--dp-size", str(DP), "--num-kv-blocks", "128") as engine:
        port = free_port()
        with start(
            router_cmd(engine.url, port, "round_robin"),
            f"http://127.0.0.1:{port}",
            tmp_path / "router.log",
            health="/health",
            timeout=60,
        ) as router:
            before = metrics(engine.url)
            n = 8
            for i in range(n):
                chat, stream = bool(i % 2), bool(i // 2 % 2)
                body = {"max_tokens": 3, "temperature": 0, "stream": stream, "model": "tiny"}
                if chat:
                    body["messages"] = [{"role": "user", "content": f"hello {i}"}]
                else:
                    body["prompt"] = f"hello {i}"
                path = "/v1/chat/completions" if chat else "/v1/completions"
                r = httpx.post(router.url + path, json=body, timeout=60)
                assert r.status_code == 200, r.text
            after = metrics(engine.url)
            served = [after[("requests", r)] - before[("requests", r)] for r in range(DP)]
            assert served == [n // DP] * DP, (
                f"per-rank requests through sglang-router: {served}\n{router.log()}"
            )
