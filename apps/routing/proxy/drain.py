"""Graceful drain of a router process: on SIGTERM or SIGINT it stops taking new work, lets the work
it has finish, then stops.

The first signal: the fleet says ``draining`` (``/health`` answers 503 ``draining``, so a load
balancer or Kubernetes takes the process out of rotation), the admission control rejects every
waiting and every new request (503 ``server_error`` with ``Retry-After``), and the requests already
admitted, streams included, run on for up to ``--drain-timeout-secs``. When none is left, or at
the timeout, ``stop`` is called: the reactor's, whose shutdown runs the process's own
(``RouterProcess.stop``: the background loops cancelled, the outbound connections closed) and cuts
whatever is still running. A second signal stops at once.

The signal handling is serving/drain.py's, shared with ``runengine``.
"""

from __future__ import annotations

import logging
import time

from serving.drain import SIGNALS
from serving.drain import Drain as GracefulStop

__all__ = ["SIGNALS", "Drain"]

logger = logging.getLogger(__name__)


class Drain(GracefulStop):
    """Drains ``router``'s process through its ``admission`` control, once, then calls ``stop``
    (which ends the server; ``install`` gives it)."""

    def __init__(self, router, admission, timeout_s: float, stop=None, clock=time.monotonic):
        self.router, self.admission = router, admission
        super().__init__(self._begin, lambda: admission.in_flight, timeout_s, stop,
                         logger=logger, clock=clock)  # fmt: skip

    def _begin(self) -> None:
        self.router.fleet.draining = True
        self.admission.drain()
