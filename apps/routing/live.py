"""The router process's side of the replicas app: its ``FleetRuntime`` (apps/replicas/runtime.py).

The replicas' services write the durable record (``Worker``, ``Rank``) and tell the process's
``LiveFleet`` what changed; it reads the row into a ``WorkerView`` (apps/routing/records.py) and
hands that to the router's decision state. The process builds one ``LiveFleet`` with its router
and admission control (apps/routing/process.py) and puts it in every Django request's and
websocket's scope (controlplane/asgi.py), where the views find both (``router_of``,
``live_of``) instead of looking them up.
"""

from __future__ import annotations

import asyncio

from apps.replicas.runtime import SCOPE_KEY, runtime_of
from apps.routing.decision.request_shape import tokenizer_or_none
from apps.routing.decision.router import Router
from apps.routing.feeds import prompt_ids
from apps.routing.records import view_of


class LiveFleet:
    def __init__(self, router: Router, admission=None):
        self.router = router
        self.admission = admission  # apps/routing/proxy/admission.py, None outside a process
        self._tasks: set[asyncio.Task] = set()

    @property
    def dp_aware(self) -> bool:
        """The process's default for workers registered without saying."""
        return self.router.config.dp_aware

    def worker_saved(self, worker, rank_ids: dict[int | None, int]) -> None:
        """Serve a discovered worker's targets (a worker not discovered yet waits for the health
        loop), and load its tokenizer now so that its first request does not pay for it."""
        if not worker.server_info:
            return
        tokenizer_path = self.router.config.tokenizer_path
        view = view_of(worker, tokenizer_path)
        self.router.install_worker(view, rank_ids)
        if view.tokenizer_path or tokenizer_path:
            warm_tokenizer(tokenizer_path or view.tokenizer_path)
        installed = self.router.fleet.workers.get(view.worker_id)
        if installed is None:
            return
        if prompt_ids.enabled() and prompt_ids.wanted(installed):
            self._in_background(prompt_ids.check(installed))

    def _in_background(self, coro) -> None:
        """Run ``coro`` on the running loop, keeping a reference until it ends (none running: a
        job's thread; the check waits for the next save)."""
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def worker_removed(self, worker_id: int) -> None:
        self.router.remove_worker(worker_id)

    def worker_draining(self, worker_id: int, draining: bool) -> None:
        self.router.set_draining(worker_id, draining)

    def worker_live(self, worker_id: int) -> dict | None:
        return self.router.worker_state(worker_id)


def warm_tokenizer(path: str) -> None:
    """Load a tokenizer off the event loop when there is one (it is cached:
    apps/routing/decision/request_shape.py)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        tokenizer_or_none(path)
        return
    loop.run_in_executor(None, tokenizer_or_none, path)


def live_of(request_or_scope) -> LiveFleet:
    """The process's ``LiveFleet`` serving a Django request (or in a Channels scope)."""
    if isinstance(request_or_scope, dict):
        live = request_or_scope.get(SCOPE_KEY)
    else:
        live = runtime_of(request_or_scope)
    if live is None:
        raise RuntimeError("this request was not served by a router process (no router in scope)")
    return live


def router_of(request_or_scope) -> Router:
    return live_of(request_or_scope).router
