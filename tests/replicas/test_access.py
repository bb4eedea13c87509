"""Access control (apps/replicas/auth.py): the workers API's mutations need an admin key or a staff
session with a CSRF token; its reads stay open. The OpenAI endpoints need an API key when some are
configured; /health and /metrics stay open. In-process through the real URLconf and the project's
ASGI application, then once through a real ``runrouter`` configured by its flags."""

import json

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from apps.replicas.auth import bearer_token, configured_keys, key_matches
from apps.replicas.models import Worker
from controlplane.asgi import build_application
from harness.procs import free_port, router_command, start

ADMIN_KEYS = "admin-one, admin-two"
API_KEYS = "k1,k2"
INVALID_API_KEY = {
    "error": {
        "message": "Incorrect API key provided.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
}


def keys_setting(settings, *, admin: str = "", api: str = "") -> None:
    settings.CONTROL_PLANE = {**settings.CONTROL_PLANE, "ADMIN_KEYS": admin, "API_KEYS": api}


@pytest.fixture
def admin_keys(settings):
    keys_setting(settings, admin=ADMIN_KEYS)


def unreachable() -> str:
    return f"http://127.0.0.1:{free_port()}"


def mutations(worker_id: int = 1) -> list[tuple[str, str, dict]]:
    """(method, path, body) of every mutation of the workers API."""
    url = unreachable()
    return [
        ("post", "/workers", {"url": url}),
        ("delete", f"/workers/{worker_id}", {}),
        ("post", f"/add_worker?url={url}", {}),
        ("post", f"/remove_worker?url={url}", {}),
    ]


def send(client, method: str, path: str, body: dict, **headers):
    if method == "post":
        return client.post(
            path, data=json.dumps(body), content_type="application/json", headers=headers
        )
    return client.delete(path, headers=headers)


def assert_refused(r, status: int) -> None:
    assert r.status_code == status, r.content
    error = r.json()["error"]
    assert error["code"] == status and error["param"] is None and error["message"]
    assert error["type"] in ("invalid_request_error", "authentication_error")
    if status == 401:
        assert r.headers["WWW-Authenticate"] == "Bearer"


# ----- the settings' parsing and the comparison ---------------------------------------------------
def test_configured_keys_split_strip_and_drop_empties(settings):
    settings.CONTROL_PLANE = {**settings.CONTROL_PLANE, "API_KEYS": " k1, ,k2 ,,", "ADMIN_KEYS": ""}
    assert configured_keys("API_KEYS") == ["k1", "k2"]
    assert configured_keys("ADMIN_KEYS") == []


def test_bearer_token_and_matching():
    assert bearer_token("Bearer abc") == b"abc" and bearer_token("bearer  abc ") == b"abc"
    assert (
        bearer_token("Basic abc") is None
        and bearer_token("Bearer ") is None
        and bearer_token(None) is None
    )
    assert key_matches(b"k2", ["k1", "k2"]) and not key_matches(b"k3", ["k1", "k2"])
    assert not key_matches(None, ["k1"]) and not key_matches(b"", [])


# ----- the workers API ----------------------------------------------------------------------------
@pytest.mark.django_db
@pytest.mark.parametrize(
    "index",
    range(4),
    ids=["POST /workers", "DELETE /workers/1", "POST /add_worker", "POST /remove_worker"],
)
def test_anonymous_and_wrong_key_mutations_are_401(client, router, admin_keys, index):
    method, path, body = mutations()[index]
    assert_refused(send(client, method, path, body), 401)
    assert_refused(send(client, method, path, body, Authorization="Bearer not-a-key"), 401)
    assert_refused(send(client, method, path, body, Authorization="admin-one"), 401)  # no scheme
    assert Worker.objects.count() == 0 and not router.fleet.all_targets()


@pytest.mark.django_db
def test_without_admin_keys_anonymous_mutations_are_still_refused(client, router, settings):
    keys_setting(settings)
    for method, path, body in mutations():
        assert_refused(send(client, method, path, body), 401)
        assert_refused(send(client, method, path, body, Authorization="Bearer "), 401)
        assert_refused(send(client, method, path, body, Authorization="Bearer anything"), 401)


@pytest.mark.django_db
def test_right_admin_key_passes(client, router, admin_keys):
    key = {"Authorization": "Bearer admin-two"}
    r = client.post("/workers", data="{}", content_type="application/json", headers=key)
    assert r.status_code == 400 and r.json()["error"]["message"] == "'url' is required"
    url = unreachable()
    r = client.post(
        "/workers", data=json.dumps({"url": url}), content_type="application/json", headers=key
    )
    assert r.status_code == 502 and url in r.json()["error"]["message"]
    assert client.post(f"/add_worker?url={url}", headers=key).status_code == 502
    assert client.post(f"/remove_worker?url={url}", headers=key).status_code == 404
    worker = Worker.objects.create(url=url)
    r = client.delete(f"/workers/{worker.id}", headers=key)
    assert r.status_code == 200 and r.json() == {"deleted": worker.id}
    assert not Worker.objects.exists()


@pytest.mark.django_db
def test_reads_stay_open(client, router, admin_keys):
    worker = Worker.objects.create(url="http://127.0.0.1:9")
    r = client.get("/workers")
    assert r.status_code == 200 and [w["url"] for w in r.json()["workers"]] == [worker.url]
    assert client.get(f"/workers/{worker.id}").json()["url"] == worker.url
    assert client.get("/list_workers").json() == {"urls": [worker.url]}
    assert client.get("/add_worker").status_code == 405  # no mutation: nothing to authenticate


def staff_client(username: str, *, staff: bool = True) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(
        get_user_model().objects.create_user(username, password="pw-not-used", is_staff=staff)
    )
    return client


def csrf_token(client: Client) -> str:
    # renders a form with {% csrf_token %}: sets the cookie
    assert client.get("/admin/").status_code == 200
    return client.cookies["csrftoken"].value


@pytest.mark.django_db
@pytest.mark.parametrize("configured", [ADMIN_KEYS, ""], ids=["admin keys", "no admin keys"])
def test_staff_session_passes_with_csrf_token(router, settings, configured):
    keys_setting(settings, admin=configured)
    client = staff_client("operator")
    token = {"X-CSRFToken": csrf_token(client)}
    url = unreachable()
    r = client.post(
        "/workers", data=json.dumps({"url": url}), content_type="application/json", headers=token
    )
    assert r.status_code == 502, r.content
    assert client.post(f"/remove_worker?url={url}", headers=token).status_code == 404
    worker = Worker.objects.create(url=url)
    assert client.delete(f"/workers/{worker.id}", headers=token).status_code == 200
    # a Bearer header is judged on its own: a wrong key is refused even with a session
    assert_refused(
        send(client, "post", "/workers", {"url": url}, Authorization="Bearer wrong", **token), 401
    )


@pytest.mark.django_db
def test_staff_session_without_csrf_token_is_403(router, admin_keys):
    client = staff_client("operator")
    csrf_token(client)  # the cookie is there; the header is not
    for method, path, body in mutations():
        assert_refused(send(client, method, path, body), 403)
        assert "CSRF" in send(client, method, path, body).json()["error"]["message"]
    assert_refused(
        send(client, "post", "/workers", {"url": "http://x"}, **{"X-CSRFToken": "f" * 32}), 403
    )
    assert Worker.objects.count() == 0


@pytest.mark.django_db
def test_non_staff_user_is_403(router, admin_keys):
    client = staff_client("visitor", staff=False)
    client.get("/workers")
    for method, path, body in mutations():
        r = send(client, method, path, body)
        assert_refused(r, 403)
        assert "staff" in r.json()["error"]["message"]


# ----- the OpenAI endpoints -----------------------------------------------------------------------
async def asgi(
    router, method: str, path: str, key: str | None = None, body: dict | None = None
) -> httpx.Response:
    """Through the project's real ASGI application (the proxy paths are served before Django)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transport = httpx.ASGITransport(app=build_application(router))
    async with httpx.AsyncClient(
        transport=transport, base_url="http://testserver", timeout=30
    ) as client:
        return await client.request(method, path, headers=headers, json=body)


OPENAI = [
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    ),
    ("GET", "/v1/models", None),
]


@pytest.mark.parametrize("method,path,body", OPENAI, ids=[p for _, p, _ in OPENAI])
async def test_openai_endpoints_need_an_api_key_when_configured(
    arouter, settings, method, path, body
):
    keys_setting(settings, api=API_KEYS)
    for key in (None, "wrong", "k1,k2", "admin-one"):
        r = await asgi(arouter, method, path, key, body)
        assert r.status_code == 401, (key, r.text)
        assert r.json() == INVALID_API_KEY
    for key in ("k1", "k2"):
        r = await asgi(arouter, method, path, key, body)
        # past auth: no worker to route to
        assert r.status_code == (200 if method == "GET" else 503), r.text
        if method == "POST":
            assert r.json()["error"]["message"] == "no available worker"
    # refused requests were never routed
    assert arouter.stats.no_target == (2 if method == "POST" else 0)
    if method == "POST":  # every answer of the proxy paths is counted by status for /metrics
        assert arouter.stats.responses == {(path, 401): 4, (path, 503): 2}
        text = (await asgi(arouter, "GET", "/metrics")).text
        assert f'dpmesh_router_http_responses_total{{endpoint="{path}",status="401"}} 4.0' in text


async def test_api_key_is_checked_before_the_body_is_read(arouter, settings):
    keys_setting(settings, api=API_KEYS)
    headers = [(b"content-type", b"application/json")]

    sent = []

    async def receive():
        raise AssertionError("the body was read")

    async def collect(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    await build_application(arouter)(scope, receive, collect)
    assert sent[0]["status"] == 401 and json.loads(sent[1]["body"]) == INVALID_API_KEY


async def test_without_api_keys_the_openai_endpoints_are_open(arouter, settings):
    keys_setting(settings)
    assert (await asgi(arouter, "GET", "/v1/models")).json() == {"object": "list", "data": []}
    assert (await asgi(arouter, "POST", "/v1/completions", body={"prompt": "x"})).status_code == 503
    assert (
        await asgi(arouter, "POST", "/v1/completions", "anything", {"prompt": "x"})
    ).status_code == 503


async def test_health_and_metrics_stay_open(arouter, settings):
    keys_setting(settings, admin=ADMIN_KEYS, api=API_KEYS)
    assert (await asgi(arouter, "GET", "/health")).status_code == 503  # no workers, but not 401
    r = await asgi(arouter, "GET", "/metrics")
    assert r.status_code == 200 and "dpmesh_router" in r.text


# ----- a real router, configured by its flags -----------------------------------------------------
@pytest.mark.slow
def test_runrouter_flags_configure_the_keys(tmp_path):
    port = free_port()
    cmd = router_command(
        (), "--api-key", "k1", "--api-key", "k2", "--admin-key", "adm", port=port, dp_aware=False
    )
    # the flags replace the environment's keys
    env = {
        "DATABASE_URL": f"sqlite:///{tmp_path}/router.sqlite3",
        "CONTROL_PLANE_API_KEYS": "env-key",
        "CONTROL_PLANE_ADMIN_KEYS": "env-admin",
    }
    with start(
        cmd, f"http://127.0.0.1:{port}", tmp_path / "router.log", health="/metrics", env=env
    ) as router:
        with httpx.Client(base_url=router.url, timeout=10) as http:
            for key in (None, "env-key", "adm"):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                for path in ("/v1/completions", "/v1/chat/completions"):
                    r = http.post(path, json={"prompt": "x", "messages": []}, headers=headers)
                    assert r.status_code == 401 and r.json() == INVALID_API_KEY
                r = http.get("/v1/models", headers=headers)
                assert r.status_code == 401 and r.json() == INVALID_API_KEY
            r = http.post(
                "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer k2"}
            )
            assert r.status_code == 503  # past auth, no worker
            assert (
                http.get("/v1/models", headers={"Authorization": "Bearer k1"}).json()["data"] == []
            )
            assert (
                http.get("/health").status_code == 503 and http.get("/metrics").status_code == 200
            )

            for key in (None, "env-admin", "k1"):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                r = http.post("/workers", json={}, headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            r = http.post("/workers", json={}, headers={"Authorization": "Bearer adm"})
            assert r.status_code == 400 and r.json()["error"]["message"] == "'url' is required"
            assert http.get("/workers").json() == {"workers": []}
