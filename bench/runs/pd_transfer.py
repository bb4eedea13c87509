"""What prefill/decode disaggregation costs on our engine: KV transfer throughput and the time
to first token a transfer adds, by prompt length.

One prefill worker and one decode worker (``runengine --disaggregation-mode prefill|decode``,
the tiny model, DP 1 each) on this host. For each prompt length, ``--repeats`` fresh prompts
(token ids, so the length is exact):

* single: the whole request on one engine (the prefill worker serves ordinary requests too),
  streamed; its TTFT;
* two-step (vLLM's protocol, as vllm-router drives it): the prefill leg (``max_tokens`` 1,
  ``kv_transfer_params.do_remote_decode``), then the decode leg streamed with the prefill's
  answer; TTFT = the prefill leg's time + the decode leg's time to its first token;
* the pull itself: blocks, bytes and seconds from the decode worker's /metrics, as MB/s.

    .venv/bin/python -m bench.runs.pd_transfer [--lengths 128 512 1024 1536] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from harness.procs import metrics, start_engine

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def stream_ttft(client: httpx.Client, url: str, body: dict) -> float:
    started = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - started
    raise RuntimeError("no token came back")


def pulled(url: str) -> tuple[float, float, float]:
    m = metrics(url)
    return tuple(
        m.get((f"kv_transfer_{name}", 0), 0.0)
        for name in ("blocks_pulled", "bytes_pulled", "pull_seconds")
    )


def run_length(client, prefill, decode, length: int, repeats: int, rng) -> dict:
    single, two_step, prefill_legs, rates = [], [], [], []
    for _ in range(repeats):
        prompt = [rng.randrange(8, 4000) for _ in range(length)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        single.append(stream_ttft(client, prefill.url, body))
        prompt = [rng.randrange(8, 4000) for _ in range(length)]  # fresh: no hit anywhere
        body = {**body, "prompt": prompt}
        before = pulled(decode.url)
        started = time.perf_counter()
        first_leg = {**body, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
        leg = client.post(prefill.url + "/v1/completions", json=first_leg)
        leg.raise_for_status()
        prefill_s = time.perf_counter() - started
        params = leg.json()["kv_transfer_params"]
        decode_s = stream_ttft(client, decode.url, {**body, "kv_transfer_params": params})
        prefill_legs.append(prefill_s)
        two_step.append(prefill_s + decode_s)
        time.sleep(0.4)  # the ranks report their counters every 0.25 s
        after = pulled(decode.url)
        if after[2] > before[2]:
            rates.append((after[1] - before[1]) / (after[2] - before[2]))
        blocks, nbytes = after[0] - before[0], after[1] - before[1]
    return {
        "length": length,
        "single_ms": 1000 * statistics.median(single),
        "two_step_ms": 1000 * statistics.median(two_step),
        "prefill_leg_ms": 1000 * statistics.median(prefill_legs),
        "added_ms": 1000 * (statistics.median(two_step) - statistics.median(single)),
        "blocks": blocks,
        "mib": nbytes / 2**20,
        "mb_per_s": statistics.median(rates) / 1e6 if rates else 0.0,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 1536])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    common = ("--dp-size", "1", "--num-kv-blocks", "1024", "--max-model-len", "2048",
              "--disaggregation-bootstrap-port", "0")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with (
            start_engine(tmp, *common, "--disaggregation-mode", "prefill", name="p") as prefill,
            start_engine(tmp, *common, "--disaggregation-mode", "decode", name="d") as decode,
            httpx.Client(timeout=120) as client,
        ):
            run_length(client, prefill, decode, 64, 2, rng)  # warm-up
            print("| prompt tokens | TTFT one engine | TTFT prefill -> decode | of it the prefill "
                  "leg | added | blocks pulled | MiB | pull MB/s |")  # fmt: skip
            print("|---:|---:|---:|---:|---:|---:|---:|---:|")
            for length in args.lengths:
                row = run_length(client, prefill, decode, length, args.repeats, rng)
                print(
                    f"| {row['length']} | {row['single_ms']:.1f} ms | {row['two_step_ms']:.1f} ms "
                    f"| {row['prefill_leg_ms']:.1f} ms | {row['added_ms']:+.1f} ms "
                    f"| {row['blocks']:.0f} | {row['mib']:.2f} | {row['mb_per_s']:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
