"""Graceful drain of a router process: on SIGTERM or SIGINT it stops taking new work, lets the work
it has finish, then stops.

The first signal: the fleet says ``draining`` (``/health`` answers 503 ``draining``, so a load
balancer or Kubernetes takes the process out of rotation), the admission control rejects every
waiting and every new request (503 ``server_error`` with ``Retry-After``), and the requests already
admitted, streams included, run on for up to ``--drain-timeout-secs``. When none is left, or at
the timeout, ``stop`` is called: the reactor's, whose shutdown runs the process's own
(``RouterProcess.stop``: the background loops cancelled, the outbound connections closed) and cuts
whatever is still running. A second signal stops at once.

Daphne's Twisted reactor would install its own handlers, which stop at the first signal and cut
every stream; ``serve_router`` starts it without them and installs these on the reactor's asyncio
loop instead (apps/routing/process.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

logger = logging.getLogger("apps.router")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
POLL_S = 0.05


class Drain:
    """Drains ``router``'s process through its ``admission`` control, once, then calls ``stop``
    (which ends the server; ``install`` gives it)."""

    def __init__(self, router, admission, timeout_s: float, stop=None, clock=time.monotonic):
        self.router, self.admission = router, admission
        self.timeout_s, self.stop, self.clock = timeout_s, stop, clock
        self.task: asyncio.Task | None = None
        self.stopped = False

    def install(self, loop: asyncio.AbstractEventLoop, stop) -> None:
        """Handle SIGTERM and SIGINT on ``loop`` (the main thread's); ``stop()`` ends the server."""
        self.stop = stop
        for signum in SIGNALS:
            loop.add_signal_handler(signum, self.signalled, signum)

    def signalled(self, signum: int) -> None:
        """The first signal starts the drain, a second one stops now."""
        name = signal.Signals(signum).name
        if self.task is None:
            logger.info(
                "%s: draining (in flight: %d); stopping when they end, at most %g s from now "
                "(a second signal stops at once)",
                name,
                self.admission.in_flight,
                self.timeout_s,
            )
            self.start()
        elif not self.stopped:
            logger.warning(
                "%s again: stopping now (in flight, cut: %d)", name, self.admission.in_flight
            )
            self.task.cancel()
            self._stop_once()

    def start(self) -> asyncio.Task:
        """Stop taking work (on the event loop) and stop the server once what was admitted ended."""
        self.router.fleet.draining = True
        self.admission.drain()
        self.task = asyncio.ensure_future(self._finish())
        return self.task

    async def _finish(self) -> None:
        deadline = self.clock() + self.timeout_s
        while self.admission.in_flight and self.clock() < deadline:
            await asyncio.sleep(POLL_S)
        if self.admission.in_flight:
            logger.warning(
                "drain timeout (%g s): stopping now (in flight, cut: %d)",
                self.timeout_s,
                self.admission.in_flight,
            )
        else:
            logger.info("drained: stopping")
        self._stop_once()

    def _stop_once(self) -> None:
        if not self.stopped:
            self.stopped = True
            if self.stop is not None:
                self.stop()
