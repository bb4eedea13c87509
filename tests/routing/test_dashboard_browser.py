"""The dashboard in a real browser (Debian's headless Chromium through chromedriver) against a
real dp-2 engine and a real `runrouter` process with its embedded periodic jobs: log in, watch
the per-rank hit rates move while a workload runs (no reload), check the numbers against the
engine's own /metrics, switch the policy and see the next requests routed differently.

Set ``DPMESH_DOCS_SCREENSHOT=docs/dashboard.png`` to refresh the README's screenshot.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time

import httpx
import pytest

from bench import datasets
from bench.runner import RunOptions, send_samples
from harness.procs import (
    REPO_ROOT,
    free_port,
    metrics,
    router_command,
    start,
    start_engine,
    wait_for,
)
from tests.conftest import _in_ci

pytestmark = pytest.mark.slow

DP = 2
USER, PASSWORD = "ops", "dashboard-test-pw-1"
SCRAPE_S = 1.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dashboard")
    with start_engine(tmp, "--dp-size", str(DP), "--num-kv-blocks", "512") as engine:
        port = free_port()
        env = {
            "DATABASE_URL": f"sqlite:///{tmp}/router.sqlite3",
            "DJANGO_SUPERUSER_USERNAME": USER,
            "DJANGO_SUPERUSER_PASSWORD": PASSWORD,
            "CONTROL_PLANE_SCRAPE_INTERVAL_S": str(SCRAPE_S),
        }
        env.pop("REDIS_URL", None)
        cmd = router_command(engine.url, port=port, policy="cache_aware")
        with start(cmd, f"http://127.0.0.1:{port}", tmp / "router.log", env=env) as router:
            yield engine, router


@pytest.fixture(scope="module")
def browser():
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        message = "Debian's chromium and chromium-driver are not installed (.ci/run installs them)"
        if _in_ci():
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-extensions",
        "--window-size=1500,1300",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def js(driver, expr: str):
    return driver.execute_script(f"return {expr};")


def cells(driver, field: str) -> dict[str, str]:
    """{rank key: text} of one column of the ranks table."""
    return driver.execute_script(
        "const out = {}; for (const tr of document.querySelectorAll('#ranks tr[data-target]')) {"
        f"  const td = tr.querySelector('[data-field=\"{field}\"]');"
        " out[tr.dataset.target] = td ? td.textContent.trim() : null;"
        "} return out;"
    )


def log_in(driver, router_url: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(router_url + "/dashboard/")
    assert "/admin/login/" in driver.current_url  # the dashboard is staff-only
    driver.find_element(By.NAME, "username").send_keys(USER)
    driver.find_element(By.NAME, "password").send_keys(PASSWORD)
    driver.find_element(By.CSS_SELECTOR, "input[type=submit], button[type=submit]").click()
    wait_for(lambda: driver.current_url.rstrip("/").endswith("/dashboard"), timeout=15)
    assert driver.current_url.rstrip("/").endswith("/dashboard"), driver.current_url
    assert wait_for(lambda: js(driver, "window.dashboardSnapshots || 0") >= 1, timeout=15), (
        "no snapshot arrived"
    )


def run_workload(router_url: str, samples) -> threading.Thread:
    """Half the samples pinned to each rank (a client's pin, which the router honours): every
    rank sees hits whatever the routing would have done (the test is about the dashboard; with
    4 prefixes at concurrency 2 cache_aware once kept all of them on one rank)."""

    async def both():
        await asyncio.gather(
            *(
                send_samples(
                    RunOptions(
                        base_url=router_url,
                        model="tiny",
                        max_concurrency=1,
                        progress=False,
                        extra_body={"data_parallel_rank": rank},
                    ),
                    samples[rank::DP],
                )  # fmt: skip
                for rank in range(DP)
            )
        )

    thread = threading.Thread(target=lambda: asyncio.run(both()), daemon=True)
    thread.start()
    return thread


def test_dashboard_shows_live_hit_rates_equal_to_the_engines_metrics(fleet, browser):
    engine, router = fleet
    log_in(browser, router.url)
    keys = [f"{engine.url}@{r}" for r in range(DP)]
    assert wait_for(lambda: sorted(cells(browser, "engine_hit_rate")) == keys, timeout=10), cells(
        browser, "engine_hit_rate"
    )
    browser.execute_script("window.__sameDocument = true;")  # gone if the page reloads
    snapshots_before = js(browser, "window.dashboardSnapshots")

    samples = datasets.prefix_repetition(
        num_prompts=60,
        prefix_len=256,
        suffix_len=64,
        num_prefixes=4,
        output_len=24,
        seed=11,
        allowed=datasets.allowed_token_ids(4096),
    )
    workload = run_workload(router.url, samples)
    seen: dict[str, set[str]] = {k: set() for k in keys}
    while workload.is_alive():
        for key, text in cells(browser, "engine_hit_rate").items():
            seen[key].add(text)
        time.sleep(0.2)
    workload.join()
    # the hit rates moved while the page stayed the same document: live updates, no reload
    assert js(browser, "window.__sameDocument === true")
    # at least two pushes while it ran (each rank's rate below takes two values, so two are
    # needed; a ~3 s run at one scrape a second gives two or three, more on a slower host)
    assert js(browser, "window.dashboardSnapshots") >= snapshots_before + 2
    for key in keys:
        assert len(seen[key] - {"–"}) >= 2, (
            f"{key}: the hit rate never moved during the run: {seen[key]}"
        )

    # Within one refresh of the run's end, the table shows exactly the engine's own counters.
    def matches():
        m = metrics(engine.url)
        want = {
            f"{engine.url}@{r}": (
                str(int(m[("prompt_tokens", r)])),
                str(int(m[("cached_tokens", r)])),
                f"{100 * m[('cached_tokens', r)] / m[('prompt_tokens', r)]:.1f}%",
            )
            for r in range(DP)
        }
        got = {
            k: (
                cells(browser, "engine_prompt_tokens")[k],
                cells(browser, "engine_cached_tokens")[k],
                cells(browser, "engine_hit_rate")[k],
            )
            for k in keys
        }
        return got == want, got, want

    deadline = time.monotonic() + 3 * SCRAPE_S + 2  # a scrape, a push, and slack for a busy host
    while True:
        ok, got, want = matches()
        if ok or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ok, f"dashboard {got} != engine /metrics {want}"
    # and the router's side: what it dispatched and predicted, next to it
    requests = {k: int(v) for k, v in cells(browser, "requests").items()}
    assert sum(requests.values()) == len(samples)
    assert all(cells(browser, "router_hit_rate")[k].endswith("%") for k in keys)

    browser.save_screenshot(str(REPO_ROOT / "var" / "dashboard-test.png"))
    target = os.environ.get("DPMESH_DOCS_SCREENSHOT")
    if target:
        browser.save_screenshot(str(REPO_ROOT / target))


def ranks_of(router_url: str, prompt: list[int], n: int) -> list[str]:
    out = []
    with httpx.Client(base_url=router_url, timeout=60) as client:
        for _ in range(n):
            r = client.post(
                "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
            out.append(r.headers["x-data-parallel-rank"])
    return out


def test_the_policy_switch_on_the_dashboard_changes_the_next_requests_routing(fleet, browser):
    from selenium.webdriver.support.ui import Select

    engine, router = fleet
    if "/dashboard" not in browser.current_url:
        log_in(browser, router.url)
    prompt = list(range(100, 100 + 200))  # 12 full blocks: cache_aware keeps it on its home rank
    assert js(browser, "window.lastSnapshot.policy") == "cache_aware"
    assert len(set(ranks_of(router.url, prompt, 6))) == 1

    Select(browser.find_element("id", "policy-select")).select_by_value("round_robin")
    assert wait_for(lambda: js(browser, "window.lastSnapshot.policy") == "round_robin", timeout=10)
    assert active_policy(router.url) == "round_robin"  # applied in the router, not only shown
    after = ranks_of(router.url, prompt, 6)
    # the same prompt now goes everywhere
    assert sorted(set(after)) == [str(r) for r in range(DP)], after
    assert js(browser, "window.lastSnapshot.policy_updated_by") == USER

    Select(browser.find_element("id", "policy-select")).select_by_value("cache_aware")
    assert wait_for(lambda: js(browser, "window.lastSnapshot.policy") == "cache_aware", timeout=10)


def test_the_dashboard_says_why_prompts_missed_and_which_sessions_diverge(fleet, browser):
    engine, router = fleet
    if "/dashboard" not in browser.current_url:
        log_in(browser, router.url)
    first = [(7 * i) % 3000 + 500 for i in range(120)]
    second = first[:70] + [(11 * i) % 3000 + 500 for i in range(60)]  # rewritten from token 70
    with httpx.Client(base_url=router.url, timeout=60, headers={"X-Session-ID": "edits"}) as c:
        for prompt in (first, second):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
            assert c.post("/v1/completions", json=body).status_code == 200

    def divergence_rows():
        return browser.execute_script(
            "return [...document.querySelectorAll('#divergences tr[data-session]')].map("
            "tr => [...tr.children].map(td => td.textContent));"
        )

    assert wait_for(lambda: divergence_rows(), timeout=10), "no diverging session shown"
    session, token, lost, target, before, earlier, now = divergence_rows()[0]
    assert (session, token) == ("h:edits", "70")
    assert int(lost) > 0 and target.startswith(engine.url)
    assert earlier != now and before  # the two renderings side by side, the same before it
    # the reasons table: a row per rank that served, and the diverged tokens on this one
    reasons = browser.execute_script(
        "const out = {};"
        " for (const tr of document.querySelectorAll('#miss-reasons tr[data-target]')) {"
        "  const tds = [...tr.querySelectorAll('[data-reason]')];"
        "  out[tr.dataset.target] = Object.fromEntries("
        "    tds.map(td => [td.dataset.reason, Number(td.textContent)]));"
        " } return out;"
    )
    assert reasons[target]["diverged"] == int(lost), reasons
    assert all(r["never_seen"] > 0 and r["tail"] > 0 for r in reasons.values()), reasons
    assert "edits" in browser.find_element("id", "worst-sessions").text


def test_anonymous_requests_are_refused(fleet):
    engine, router = fleet
    with httpx.Client(base_url=router.url, timeout=10) as client:
        for path in ("/dashboard/", "/admin/", "/admin/replicas/worker/"):
            r = client.get(path)
            assert r.status_code == 302 and "/admin/login/" in r.headers["location"], path
        assert client.post("/workers", json={"url": engine.url}).status_code == 401
        assert client.delete("/workers/1").status_code == 401
        assert client.post("/dashboard/policy", json={"policy": "random"}).status_code in (302, 403)

    async def websocket():
        import aiohttp

        async with aiohttp.ClientSession() as session:
            try:
                async with session.ws_connect(
                    router.url.replace("http", "ws") + "/ws/dashboard/",
                    headers={"Origin": router.url},
                ) as ws:
                    message = await ws.receive(timeout=5)
                    return ("closed", ws.close_code, message.type)
            except aiohttp.WSServerHandshakeError as exc:
                return ("refused", exc.status, None)

    outcome = asyncio.run(websocket())
    assert outcome[0] == "refused" and outcome[1] == 403 or outcome[:2] == ("closed", 4403), outcome
    assert active_policy(router.url) == "cache_aware"


def active_policy(router_url: str) -> str:
    """The active policy as the router's /metrics reports it."""
    for line in httpx.get(router_url + "/metrics").text.splitlines():
        if line.startswith("dpmesh_router_policy_info{"):
            return line.split('policy="', 1)[1].split('"', 1)[0]
    raise AssertionError("no policy_info in /metrics")
