"""``python -m engine.fit_step_time``: measure our own CPU engine and fit the step-time model.

Runs the real tiny model's ``LLMEngine`` in this process over a grid of steps (prefills of
several lengths after cached prefixes of several lengths, decode batches of several sizes and
context lengths, and decodes mixed with a prefill), times each ``step()``, and fits the
coefficients of ``engine.sim.step_time`` by least squares (``engine.sim.fit``). Prints them
(ready to paste into ``CPU_TINY`` in ``engine/sim/profiles.py``) with the fit error.

Like a rank of a DP-2 server on a 2-core box, the engine runs one torch thread by default, and
a step's time is then the CPU time of this thread (``time.thread_time``): on a shared box that
is what the step costs, without the time other processes held the core. Each shape is measured
``--repeats`` times in each of ``--passes`` passes over the grid and the fastest kept, for
the same reason.

Arrows: this tool sits above both the engine and its simulation: it imports ``engine.llm_engine``
(the engine it times) and ``engine.sim`` (the model it fits). It lives outside ``engine.sim``
because ``engine.llm_engine`` imports ``engine.sim.runner`` (the simulated runner is one of the
engine's runners), so ``engine.sim`` must never import the engine back.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sim.fit import fit_cost, fit_error
from engine.sim.step_time import StepShape, shape_of

MAX_DECODE_CONTEXT = 40_000  # tokens of KV a decode batch may hold (the pool has 65,536)


class StepTimer:
    """Drives an LLMEngine and records (shape, seconds) of the steps it is asked to time."""

    def __init__(self, engine, rng: random.Random, clock=time.perf_counter):
        self.engine, self.rng, self.clock = engine, rng, clock
        self.best: dict[tuple, tuple[StepShape, float]] = {}  # the fastest sample per grid point
        self._shape: StepShape | None = None
        run = engine.runner.run

        def run_and_record(batch):
            self._shape = shape_of(batch)
            return run(batch)

        engine.runner.run = run_and_record
        self._ids = 0

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(4, self.engine.runner.vocab_size) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        self._ids += 1
        rid = f"fit-{self._ids}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.engine.add_request(rid, prompt, params)
        return rid

    def step(self) -> tuple[StepShape, float] | None:
        """One engine step: its shape and how long it took (None if nothing was scheduled)."""
        started = self.clock()
        self.engine.step()
        elapsed = self.clock() - started
        shape, self._shape = self._shape, None
        return None if shape is None else (shape, elapsed)

    def record(self, key: tuple, samples: list[tuple[StepShape, float] | None]) -> None:
        """Keep the fastest sample of grid point ``key`` seen so far, over all passes."""
        candidates = [s for s in samples if s] + ([self.best[key]] if key in self.best else [])
        self.best[key] = min(candidates, key=lambda s: s[1])

    @property
    def shapes(self) -> list[StepShape]:
        return [shape for shape, _ in self.best.values()]

    @property
    def seconds(self) -> list[float]:
        return [seconds for _, seconds in self.best.values()]

    def finish_all(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()

    def drain(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)


def measure_prefills(timer: StepTimer, lengths, contexts, repeats: int) -> None:
    """One prefill of ``p`` new tokens after ``c`` cached ones, per (p, c)."""
    for c in contexts:
        for p in lengths:
            samples = []
            for _ in range(repeats):
                prefix = timer.prompt(c)
                if c:
                    timer.add(prefix + timer.prompt(1), 1)  # caches the prefix
                    timer.finish_all()
                timer.add(prefix + timer.prompt(p), 1)
                samples.append(timer.step())
            timer.record(("prefill", p, c), samples)


def measure_decodes(timer: StepTimer, batches, contexts, repeats: int, mixed: int) -> None:
    """Decode steps of ``b`` sequences of context ``c``, then steps where a ``mixed``-token
    prefill joins those decodes; the fastest of ``repeats`` of each."""
    for c in contexts:
        for b in batches:
            if b * c > MAX_DECODE_CONTEXT:
                continue
            for _ in range(b):
                timer.add(timer.prompt(c), 2 * repeats + 32)  # outlasts the untimed prefills
            while any(s.num_computed_tokens < s.num_prompt_tokens for s in _seqs(timer)):
                timer.step()  # the prefills, not timed
            timer.record(("decode", b, c), [timer.step() for _ in range(repeats)])
            samples = []
            for _ in range(repeats):
                timer.add(timer.prompt(mixed), 1)
                samples.append(timer.step())
            timer.record(("mixed", b, c), samples)
            timer.drain()


def _seqs(timer: StepTimer):
    return [r.seq for r in timer.engine.requests.values()]


def measure(threads: int, repeats: int, passes: int, seed: int) -> StepTimer:
    """The grid, ``passes`` times over with ``repeats`` samples per point each time: on a shared
    box a point's fastest sample, taken at different moments, is its own cost."""
    config = EngineConfig(
        model="tiny", num_kv_blocks=4096, max_num_batched_tokens=2048, num_threads=threads
    )
    engine = LLMEngine(config)
    # one thread computes inline: its CPU time is the step's cost, whoever else shares the core
    clock = time.thread_time if threads == 1 else time.perf_counter
    timer = StepTimer(engine, random.Random(seed), clock)
    measure_prefills(timer, [64], [0], 3)  # warm-up, dropped
    timer.best.clear()
    for _ in range(passes):
        measure_prefills(timer, [16, 64, 128, 256, 512, 1024], [0, 256, 768], repeats)
        measure_decodes(timer, [1, 4, 8, 16, 32, 64], [16, 128, 512, 1024], repeats, 128)
    return timer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--repeats", type=int, default=2, help="samples per point per pass")
    parser.add_argument("--passes", type=int, default=3, help="times over the whole grid")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    timer = measure(args.threads, args.repeats, args.passes, args.seed)
    cost = fit_cost(timer.shapes, timer.seconds)
    print(
        f"{len(timer.shapes)} steps measured in {time.monotonic() - started:.0f} s on "
        f"{platform.machine()} ({_cpus()} CPUs), {args.threads} torch thread(s)"
    )
    for name, value in cost.as_dict().items():
        print(f"  {name:<22} {value:.6g}")
    err = fit_error(cost, timer.shapes, timer.seconds)
    print(
        "fit error: RMS {rms_ms:.2f} ms, mean {mean_rel_pct:.1f} %, max {max_rel_pct:.1f} %, "
        "R^2 {r2:.4f}".format(**err)
    )
    print("StepCost(" + ", ".join(f"{k}={v:.4g}" for k, v in cost.as_dict().items()) + ")")


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
