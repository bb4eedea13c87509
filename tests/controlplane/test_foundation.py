"""The Django foundation: settings from the environment, daphne + Channels serving the ASGI
app, Celery's embedded mode, and the Postgres and Redis paths against real services."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from controlplane import celery_app
from controlplane.env import channel_layers, namespaced_settings, parse_database_url

BASE = Path("/srv/app")


def _subprocess_env(**overrides: str) -> dict[str, str]:
    """The current environment without the service URLs, plus ``overrides``: each
    subprocess states exactly which database and broker it uses."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"
    env.update(overrides)
    return env


def _manage(repo_root: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


# --- settings from the environment -------------------------------------------------------


def test_parse_postgres_url_with_encoded_credentials_and_options():
    db = parse_database_url(
        "postgresql://dp%40user:p%3As%2Fw@db.internal:6543/dp%20mesh?sslmode=require",
        base_dir=BASE,
    )
    assert db == {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "dp mesh",
        "USER": "dp@user",
        "PASSWORD": "p:s/w",
        "HOST": "db.internal",
        "PORT": "6543",
        "OPTIONS": {"sslmode": "require"},
    }


def test_parse_postgres_url_minimal_leaves_defaults_to_libpq():
    db = parse_database_url("postgres://postgres@127.0.0.1/dpmesh", base_dir=BASE)
    assert (db["NAME"], db["USER"], db["PASSWORD"], db["HOST"], db["PORT"]) == (
        "dpmesh",
        "postgres",
        "",
        "127.0.0.1",
        "",
    )


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("sqlite:///var/db.sqlite3", "/srv/app/var/db.sqlite3"),
        ("sqlite:////tmp/db.sqlite3", "/tmp/db.sqlite3"),
        ("sqlite://:memory:", ":memory:"),
    ],
)
def test_parse_sqlite_url(url, path):
    db = parse_database_url(url, base_dir=BASE)
    assert (db["ENGINE"], db["NAME"]) == ("django.db.backends.sqlite3", path)


@pytest.mark.parametrize("url", ["mysql://root@localhost/db", "postgres://postgres@localhost/"])
def test_parse_database_url_rejects_what_it_cannot_serve(url):
    with pytest.raises(ValueError):
        parse_database_url(url, base_dir=BASE)


def test_channel_layer_is_redis_only_when_redis_url_is_set():
    assert channel_layers(None)["default"]["BACKEND"] == "channels.layers.InMemoryChannelLayer"
    redis_layer = channel_layers("redis://cache:6379/0")["default"]
    assert redis_layer == {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": ["redis://cache:6379/0"]},
    }


def test_control_plane_settings_are_overridable_and_typed():
    defaults = {"POLICY": "cache_aware", "BALANCE_ABS_THRESHOLD": 64, "REQUEST_TIMEOUT_S": 600.0}
    env = {"CP_POLICY": "round_robin", "CP_REQUEST_TIMEOUT_S": "30"}
    assert namespaced_settings(env, "CP_", defaults) == {
        "POLICY": "round_robin",
        "BALANCE_ABS_THRESHOLD": 64,
        "REQUEST_TIMEOUT_S": 30.0,
    }
    with pytest.raises(ValueError, match="CP_BALANCE_ABS_THRESHOLD"):
        namespaced_settings({"CP_BALANCE_ABS_THRESHOLD": "lots"}, "CP_", defaults)


def test_loaded_settings_have_the_fixed_shape():
    assert settings.INSTALLED_APPS[0] == "daphne"
    assert {"channels", "apps.replicas", "apps.routing"} <= set(settings.INSTALLED_APPS)
    assert settings.ASGI_APPLICATION == "controlplane.asgi.application"
    assert {"POLICY", "HEALTH_CHECK_INTERVAL_S", "REQUEST_TIMEOUT_S"} <= set(settings.CONTROL_PLANE)


@pytest.mark.parametrize(("secret", "warns"), [(None, True), ("s3cret-from-env", False)])
def test_default_secret_key_with_debug_off_warns(repo_root, secret, warns):
    env = _subprocess_env(DJANGO_DEBUG="0")
    env.pop("DJANGO_SECRET_KEY", None)
    if secret:
        env["DJANGO_SECRET_KEY"] = secret
    result = subprocess.run(
        [sys.executable, "-c", "import controlplane.settings"],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert ("DJANGO_SECRET_KEY is unset" in result.stderr) is warns


# --- serving: daphne + Channels ----------------------------------------------------------


def _wait_for_http(url: str, process: subprocess.Popen, deadline_s: float) -> httpx.Response:
    """Poll ``url`` until it answers; fail early if the server process died."""
    deadline = time.monotonic() + deadline_s
    while True:
        if process.poll() is not None:
            pytest.fail(f"daphne exited with {process.returncode}: {process.stderr.read()}")
        try:
            return httpx.get(url, timeout=2)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.slow
def test_daphne_serves_the_admin_login_page(repo_root, free_port, tmp_path):
    env = _subprocess_env(DATABASE_URL=f"sqlite:///{tmp_path}/db.sqlite3")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "daphne",
            "-b",
            "127.0.0.1",
            "-p",
            str(free_port),
            "controlplane.asgi:application",
        ],
        cwd=repo_root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        response = _wait_for_http(f"http://127.0.0.1:{free_port}/admin/login/", server, 15)
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert response.status_code == 200
    assert response.headers["server"] == "daphne"
    assert 'id="login-form"' in response.text


# --- Celery -------------------------------------------------------------------------------


@celery_app.task(name="tests.controlplane.add")
def add(x, y):
    return x + y


@pytest.mark.skipif(
    bool(os.environ.get("REDIS_URL")), reason="REDIS_URL set: Celery is not in embedded mode"
)
def test_celery_runs_tasks_inline_without_redis():
    assert celery_app.conf.task_always_eager is True
    assert add.delay(2, 3).get(timeout=1) == 5


# --- databases ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_test_database_is_migrated(django_user_model):
    django_user_model.objects.create_user(username="operator", password="x")
    assert django_user_model.objects.filter(username="operator").exists()


@pytest.fixture
def postgres_database(postgres_server_url):
    """A throwaway Postgres database, dropped afterwards; yields its DATABASE_URL."""
    import psycopg

    name = f"dpmesh_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{postgres_server_url}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{postgres_server_url}/{name}"
    finally:
        with psycopg.connect(f"{postgres_server_url}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.slow
def test_migrations_apply_on_postgres(repo_root, postgres_database):
    import psycopg

    env = _subprocess_env(DATABASE_URL=postgres_database)
    migrate = _manage(repo_root, "migrate", "--noinput", env=env)
    assert migrate.returncode == 0, migrate.stderr
    # --check exits non-zero while any migration is unapplied.
    check = _manage(repo_root, "migrate", "--check", env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    with psycopg.connect(postgres_database) as conn:
        applied = conn.execute("SELECT count(*) FROM django_migrations").fetchone()[0]
    assert applied > 0


# --- Redis channel layer -----------------------------------------------------------------


async def test_redis_channel_layer_round_trip(redis_url):
    from channels_redis.core import RedisChannelLayer

    layer = RedisChannelLayer(hosts=[redis_url], prefix=f"test-{uuid.uuid4().hex[:8]}")
    try:
        channel = await layer.new_channel()
        await layer.send(channel, {"type": "rank.update", "rank": 3})
        assert await layer.receive(channel) == {"type": "rank.update", "rank": 3}
    finally:
        await layer.flush()
        await layer.close_pools()
