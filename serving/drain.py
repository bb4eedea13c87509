"""Graceful stop of a server process on SIGTERM or SIGINT: stop taking new work, let the work in
flight finish for up to a deadline, then stop; a second signal stops at once.

Daphne's Twisted reactor would install handlers that stop at the first signal and cut every
stream; the engine (engine/server/main.py) and the router (apps/routing/process.py) start it
without them and install these on the reactor's asyncio loop instead. What "stop taking work"
and "in flight" mean is the server's: ``begin`` and ``in_flight``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

SIGNALS = (signal.SIGTERM, signal.SIGINT)
POLL_S = 0.05


def stop_reactor(reactor) -> None:
    """Stop the Twisted reactor unless it is stopping already (a drain's ``stop``)."""
    from twisted.internet.error import ReactorNotRunning

    with contextlib.suppress(ReactorNotRunning):
        reactor.stop()


def close_loop(loop: asyncio.AbstractEventLoop, wait_s: float = 1.0) -> None:
    """After the reactor stopped: cancel what still runs on ``loop`` (a stop cut short leaves
    requests and loops pending), let it unwind for up to ``wait_s``, then close the loop. Left
    open, the loop is only closed by the collector at exit, after its self-pipe socket may have
    been finalized, which prints a traceback ("Invalid file descriptor: -1")."""
    if loop.is_closed():
        return
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    try:
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=wait_s))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()


class Drain:
    """Once: ``begin()``, then ``stop()`` when ``in_flight()`` is 0 or ``timeout_s`` passed."""

    def __init__(self, begin, in_flight, timeout_s: float, stop=None, *, logger=None,
                 clock=time.monotonic):  # fmt: skip
        self.begin, self.in_flight = begin, in_flight
        self.timeout_s, self.stop, self.clock = timeout_s, stop, clock
        self.log = logger or logging.getLogger(__name__)
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
            self.log.info(
                "%s: draining (in flight: %d); stopping when they end, at most %g s from now "
                "(a second signal stops at once)",
                name,
                self.in_flight(),
                self.timeout_s,
            )
            self.start()
        elif not self.stopped:
            self.log.warning("%s again: stopping now (in flight, cut: %d)", name, self.in_flight())
            self.task.cancel()
            self._stop_once()

    def start(self) -> asyncio.Task:
        """Stop taking work (on the event loop) and stop the server once what was admitted ended."""
        self.begin()
        self.task = asyncio.ensure_future(self._finish())
        return self.task

    async def _finish(self) -> None:
        deadline = self.clock() + self.timeout_s
        while self.in_flight() and self.clock() < deadline:
            await asyncio.sleep(POLL_S)
        if self.in_flight():
            self.log.warning(
                "drain timeout (%g s): stopping now (in flight, cut: %d)",
                self.timeout_s,
                self.in_flight(),
            )
        else:
            self.log.info("drained: stopping")
        self._stop_once()

    def _stop_once(self) -> None:
        if not self.stopped:
            self.stopped = True
            if self.stop is not None:
                self.stop()
