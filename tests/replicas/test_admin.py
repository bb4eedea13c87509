"""The admin changes the fleet through the services: adding a worker runs discovery against a real
engine (dp_size 2) and installs its targets in the router; an unreachable one is a form error and
nothing is saved; drain, undrain and remove reach the router; the policy set here applies to the
process's router."""

import os
import re
import subprocess
import sys

import httpx
import pytest
from django.contrib.admin.models import LogEntry

from apps.replicas.models import Rank, Worker, WorkerEvent
from apps.routing.models import RoutingSettings
from harness.procs import REPO_ROOT, free_port, router_command, start, start_engine
from harness.standin import StandIn

ADD = "/admin/replicas/worker/add/"
CHANGELIST = "/admin/replicas/worker/"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with start_engine(
        tmp_path_factory.mktemp("engine"), "--dp-size", "2", "--num-kv-blocks", "64"
    ) as server:
        yield server


def keys(router) -> list[str]:
    return sorted(t.key for t in router.fleet.all_targets())


def add_through_admin(admin_client, url: str, **extra):
    return admin_client.post(ADD, {"url": url, "api_key": "", "dp_aware": "on", **extra})


def added(admin_client, engine) -> Worker:
    r = add_through_admin(admin_client, engine.url)
    assert r.status_code == 302, r.content.decode()[-3000:]
    return Worker.objects.get()


def run_action(admin_client, action: str, *workers: Worker, **extra):
    return admin_client.post(
        CHANGELIST, {"action": action, "_selected_action": [w.id for w in workers], **extra}
    )


def test_anonymous_admin_redirects_to_the_login(client):
    r = client.get("/admin/")
    assert r.status_code == 302 and r.url == "/admin/login/?next=/admin/"


@pytest.mark.django_db(transaction=True)
def test_add_form_asks_for_url_key_and_dp_awareness(admin_client):
    html = admin_client.get(ADD).content.decode()
    assert set(
        re.findall(r'name="(url|api_key|dp_aware|dp_size|server_info|health|draining)"', html)
    ) == {"url", "api_key", "dp_aware"}
    assert re.search(r'<input type="password" name="api_key"', html)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_add_runs_discovery_and_installs_the_targets(admin_client, engine, router):
    r = add_through_admin(admin_client, engine.url + "/", api_key="engine-secret")
    assert r.status_code == 302, r.content.decode()[-3000:]
    worker = Worker.objects.get()
    assert (worker.url, worker.dp_size, worker.dp_aware, worker.model_name) == (
        engine.url,
        2,
        True,
        "tiny",
    )
    assert worker.api_key == "engine-secret" and worker.health == Worker.Health.HEALTHY
    assert [r.rank for r in Rank.objects.filter(worker=worker)] == [0, 1]
    assert [(e.kind, e.detail) for e in worker.events.all()] == [
        ("discovered", "model tiny, dp_size 2")
    ]
    assert keys(router) == [f"{engine.url}@0", f"{engine.url}@1"]
    assert [t.rank_id for t in router.fleet.targets[worker.id]] == [
        r.id for r in worker.ranks.all()
    ]
    assert LogEntry.objects.get().object_id == str(worker.id)
    assert r.url == CHANGELIST
    listed = admin_client.get(CHANGELIST).content.decode()
    assert engine.url in listed and "tiny" in listed

    Rank.objects.filter(worker=worker, rank=0).update(
        prompt_tokens=200, predicted_tokens=100, cached_tokens=150
    )
    html = admin_client.get(f"{CHANGELIST}{worker.id}/change/").content.decode()
    # server_info, pretty-printed, read-only
    assert "<pre>" in html and "&quot;dp_size&quot;: 2" in html
    assert 'name="server_info"' not in html and 'name="url"' not in html
    assert 'value="engine-secret"' not in html  # the key is not rendered back
    assert "50.0%" in html and "75.0%" in html  # rank 0's router-predicted and engine hit rates
    assert "discovered" in html and "model tiny, dp_size 2" in html  # the health history
    ranks = admin_client.get("/admin/replicas/rank/").content.decode()
    assert "50.0%" in ranks and "75.0%" in ranks and f"{engine.url}@1" in ranks
    assert admin_client.get("/admin/replicas/rank/add/").status_code == 403
    events = admin_client.get("/admin/replicas/workerevent/").content.decode()
    assert (
        "model tiny, dp_size 2" in events
        and admin_client.get("/admin/replicas/workerevent/add/").status_code == 403
    )


@pytest.mark.django_db(transaction=True)
def test_unreachable_worker_is_a_form_error_and_nothing_is_saved(admin_client, router):
    url = f"http://127.0.0.1:{free_port()}"
    r = add_through_admin(admin_client, url)
    assert r.status_code == 200
    html = r.content.decode()
    assert "errornote" in html and "discovery failed" in html and url in html
    assert (
        not Worker.objects.exists()
        and not Rank.objects.exists()
        and not WorkerEvent.objects.exists()
    )
    assert keys(router) == [] and not LogEntry.objects.exists()

    r = add_through_admin(admin_client, "localhost:8000")  # no scheme: the service's own check
    assert r.status_code == 200 and "must start with http:// or https://" in r.content.decode()
    assert not Worker.objects.exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_adding_a_registered_url_again_is_a_form_error(admin_client, engine, router):
    worker = added(admin_client, engine)
    r = add_through_admin(admin_client, engine.url + "/")
    assert r.status_code == 200 and "already registered" in r.content.decode()
    assert list(Worker.objects.all()) == [worker] and WorkerEvent.objects.count() == 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_drain_and_undrain_actions_reach_the_router(admin_client, engine, router):
    worker = added(admin_client, engine)
    assert run_action(admin_client, "drain_selected", worker).status_code == 302
    worker.refresh_from_db()
    assert worker.draining and router.fleet.workers[worker.id].draining
    assert not any(t.available for t in router.fleet.all_targets())
    # already draining: no event
    assert run_action(admin_client, "drain_selected", worker).status_code == 302
    assert run_action(admin_client, "undrain_selected", worker).status_code == 302
    worker.refresh_from_db()
    assert not worker.draining and not router.fleet.workers[worker.id].draining
    assert all(t.available for t in router.fleet.all_targets())
    assert [e.kind for e in worker.events.order_by("at", "id")] == [
        "discovered",
        "draining",
        "undrained",
    ]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_change_form_drains_and_keeps_a_blank_key(admin_client, engine, router):
    r = add_through_admin(admin_client, engine.url, api_key="engine-secret")
    assert r.status_code == 302
    worker = Worker.objects.get()
    ranks = list(worker.ranks.all())
    data = {
        "api_key": "",
        "dp_aware": "on",
        "draining": "on",
        "ranks-TOTAL_FORMS": len(ranks),
        "ranks-INITIAL_FORMS": len(ranks),
        "ranks-MIN_NUM_FORMS": 0,
        "ranks-MAX_NUM_FORMS": 1000,
    }
    for i, rank in enumerate(ranks):
        data |= {f"ranks-{i}-id": rank.id, f"ranks-{i}-worker": worker.id}
    r = admin_client.post(f"{CHANGELIST}{worker.id}/change/", data)
    assert r.status_code == 302, r.content.decode()[-3000:]
    worker.refresh_from_db()
    assert worker.draining and worker.api_key == "engine-secret" and worker.dp_size == 2
    assert (
        router.fleet.workers[worker.id].draining
        and router.fleet.workers[worker.id].api_key == "engine-secret"
    )

    # dp-unaware: one target for the whole worker, rediscovered
    data |= {"dp_aware": "", "draining": ""}
    assert admin_client.post(f"{CHANGELIST}{worker.id}/change/", data).status_code == 302
    worker.refresh_from_db()
    assert (worker.dp_aware, worker.draining, worker.dp_size) == (False, False, 2)
    assert keys(router) == [engine.url] and [r.rank for r in worker.ranks.all()] == [None]
    assert [e.kind for e in worker.events.order_by("at", "id")] == [
        "discovered",
        "draining",
        "undrained",
    ]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_remove_action_goes_through_the_service(admin_client, engine, router):
    worker = added(admin_client, engine)
    r = run_action(admin_client, "delete_selected", worker)
    assert r.status_code == 200  # Django's confirmation page, listing what goes with the worker
    html = r.content.decode()
    assert "Remove selected workers" in admin_client.get(CHANGELIST).content.decode()
    assert (
        "Are you sure" in html and "permission to delete" not in html and f"{engine.url}@1" in html
    )
    assert Worker.objects.exists() and keys(router)  # nothing removed before the confirmation
    assert run_action(admin_client, "delete_selected", worker, post="yes").status_code == 302
    assert not Worker.objects.exists() and not Rank.objects.exists()
    assert keys(router) == [] and router.fleet.workers == {} and router.index.capacity == {}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_delete_view_goes_through_the_service(admin_client, engine, router):
    worker = added(admin_client, engine)
    page = admin_client.get(f"{CHANGELIST}{worker.id}/delete/")
    assert page.status_code == 200 and "permission to delete" not in page.content.decode()
    assert admin_client.post(f"{CHANGELIST}{worker.id}/delete/", {"post": "yes"}).status_code == 302
    assert not Worker.objects.exists() and keys(router) == [] and router.fleet.workers == {}


@pytest.mark.django_db(transaction=True)
def test_policy_change_applies_to_the_router(admin_client, admin_user, router):
    assert router.policy.name == "cache_aware"
    r = admin_client.post("/admin/routing/routingsettings/add/", {"policy": "round_robin"})
    assert r.status_code == 302, r.content.decode()[-3000:]
    row = RoutingSettings.objects.get()
    assert (row.policy, row.updated_by) == ("round_robin", admin_user.username)
    assert router.policy.name == "round_robin" and router.config.policy == "round_robin"
    assert admin_client.get("/admin/routing/routingsettings/add/").status_code == 403  # one row

    r = admin_client.post(
        f"/admin/routing/routingsettings/{row.id}/change/", {"policy": "power_of_two"}
    )
    assert r.status_code == 302
    assert router.policy.name == "power_of_two"
    r = admin_client.post(
        f"/admin/routing/routingsettings/{row.id}/change/", {"policy": "nonsense"}
    )
    assert r.status_code == 200 and router.policy.name == "power_of_two"


@pytest.mark.django_db
def test_bench_runs_are_listed_read_only(admin_client):
    from apps.routing.models import BenchRun

    run = BenchRun.objects.create(
        base_url="http://127.0.0.1:1",
        status=BenchRun.Status.DONE,
        params={"dataset": "sharegpt", "requests": 64},
        result={"throughput_rps": 12.5, "per_rank": {"0": 1}},
    )
    html = admin_client.get("/admin/routing/benchrun/").content.decode()
    assert "dataset=sharegpt" in html and "throughput_rps=12.5" in html and "per_rank" not in html
    assert admin_client.get("/admin/routing/benchrun/add/").status_code == 403
    page = admin_client.get(f"/admin/routing/benchrun/{run.id}/change/").content.decode()
    assert 'name="status"' not in page and "sharegpt" in page


# ----- the admin in a real router process (daphne: the admin's thread, the router's event loop) ---
def login(http, username: str, password: str) -> None:
    page = http.get("/admin/login/")
    r = http.post(
        "/admin/login/",
        data={
            "username": username,
            "password": password,
            "next": "/admin/",
            "csrfmiddlewaretoken": form_token(page.text),
        },
    )
    assert r.status_code == 302 and r.headers["location"] == "/admin/", r.text[-2000:]


def form_token(html: str) -> str:
    return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html).group(1)


def admin_post(http, path: str, data: dict):
    return http.post(path, data={**data, "csrfmiddlewaretoken": form_token(http.get(path).text)})


@pytest.mark.slow
def test_admin_in_a_running_router_changes_its_fleet(tmp_path):
    """Under daphne the admin's views run in a worker thread: ``async_to_sync`` runs the services on
    the server's loop, where the router that serves /v1 lives."""
    port = free_port()
    env = {
        "DATABASE_URL": f"sqlite:///{tmp_path}/router.sqlite3",
        "DJANGO_SUPERUSER_PASSWORD": "pw-for-tests",
    }
    cmd = router_command(port=port)
    with (
        StandIn(dp_size=2, model="standin-admin").start() as standin,
        start(
            cmd, f"http://127.0.0.1:{port}", tmp_path / "router.log", health="/workers", env=env
        ) as router,
    ):
        subprocess.run(
            [
                sys.executable,
                "manage.py",
                "createsuperuser",
                "--noinput",
                "--username",
                "boss",
                "--email",
                "boss@example.com",
            ],
            cwd=REPO_ROOT,
            env={**os.environ, **env},
            check=True,
            capture_output=True,
        )
        with httpx.Client(base_url=router.url, timeout=30) as http:
            login(http, "boss", "pw-for-tests")
            r = admin_post(http, ADD, {"url": standin.url, "api_key": "", "dp_aware": "on"})
            assert r.status_code == 302, r.text[-3000:]
            worker = http.get("/workers").json()["workers"][0]
            assert [t["key"] for t in worker["targets"]] == [f"{standin.url}@0", f"{standin.url}@1"]
            assert http.get("/health").json()["targets"] == [f"{standin.url}@0", f"{standin.url}@1"]
            r = http.post(
                "/v1/completions", json={"model": "standin-admin", "prompt": "hi", "max_tokens": 1}
            )
            assert r.status_code == 200 and r.headers["x-routed-target"].startswith(
                standin.url + "@"
            )

            page = http.get(CHANGELIST).text
            r = http.post(
                CHANGELIST,
                data={
                    "action": "drain_selected",
                    "_selected_action": worker["id"],
                    "csrfmiddlewaretoken": form_token(page),
                },
            )
            assert r.status_code == 302
            assert http.get("/health").status_code == 503  # drained: no available target

            r = http.post(
                CHANGELIST,
                data={
                    "action": "delete_selected",
                    "_selected_action": worker["id"],
                    "post": "yes",
                    "csrfmiddlewaretoken": form_token(page),
                },
            )
            assert r.status_code == 302
            assert http.get("/workers").json() == {"workers": []}
            r = http.post(
                "/v1/completions", json={"model": "standin-admin", "prompt": "hi", "max_tokens": 1}
            )
            assert r.status_code == 503
            assert "Traceback" not in router.log()
