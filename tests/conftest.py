"""Fixtures shared by the whole suite: free ports, the repository root, and the external
services (Postgres, Redis).

A service fixture skips its test when the service is unreachable on a developer machine,
but fails it when ``CI`` is set: in CI the services are part of the contract, and a silent
skip would hide a broken set-up.
"""

import os
from pathlib import Path

import pytest

from harness import procs

REPO_ROOT = Path(__file__).resolve().parent.parent
POSTGRES_SERVER_URL = os.environ.get("TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432")
REDIS_TEST_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _service_missing(what: str, error: Exception):
    message = f"{what} is unreachable: {error}"
    if _in_ci():
        pytest.fail(f"{message} (CI is set, so this is a failure; .ci/run should have started it)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it, so parallel runs do not clash)."""
    return procs.free_port()


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    """URL of a Postgres server (no database name), e.g. ``postgres://postgres@127.0.0.1:5432``."""
    import psycopg

    try:
        psycopg.connect(f"{POSTGRES_SERVER_URL}/postgres", connect_timeout=3).close()
    except psycopg.Error as error:
        _service_missing(f"Postgres at {POSTGRES_SERVER_URL}", error)
    return POSTGRES_SERVER_URL


@pytest.fixture(scope="session")
def redis_url() -> str:
    """URL of a Redis database reserved for tests (db 15 by default)."""
    import redis

    try:
        redis.Redis.from_url(REDIS_TEST_URL, socket_connect_timeout=3).ping()
    except redis.RedisError as error:
        _service_missing(f"Redis at {REDIS_TEST_URL}", error)
    return REDIS_TEST_URL


@pytest.fixture(scope="session")
def pd_engines(tmp_path_factory):
    """(prefill, decode): our engine in both prefill/decode roles (DP 2 each, the tiny model,
    a 3 s KV-transfer timeout, bootstrap listener on a free port), started at once and shared by
    the engine's and the router's PD tests (tests/engine/test_pd_server.py,
    tests/routing/test_pd_routing.py): starting a pair takes ~25 s on the CI machine."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import ExitStack

    tmp = tmp_path_factory.mktemp("pd-engines")
    common = ("--dp-size", "2", "--num-kv-blocks", "256", "--max-model-len", "1024",
              "--kv-transfer-timeout-secs", "3",
              "--disaggregation-bootstrap-port", "0")  # fmt: skip
    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        jobs = [
            pool.submit(lambda m: stack.enter_context(
                procs.start_engine(tmp, *common, "--disaggregation-mode", m, name=m)), mode)
            for mode in ("prefill", "decode")
        ]  # fmt: skip
        yield tuple(job.result() for job in jobs)
