"""The engine on an accelerator, checked and measured in one short run (issue 13's GPU script):
``python -m bench.runs.gpu_check [--device cuda] [--json FILE]``. Never needed for tests or CI; a
session that is lent a GPU runs it (``scripts/gpu-check.sh`` wraps it with a time limit) and puts
the numbers in docs/benchmarks.md. ``--device cpu`` runs the same steps here, smaller
(``--quick``), to keep the script working.

1. Exactness: greedy token ids of the in-process engine (``LLMEngine``, paged KV, prefix cache,
   a mixed batch with a shared prefix) against transformers' ``generate`` on the same device:
   float32 token for token; bfloat16 within two bf16 spacings of transformers' top logit at
   every position (tests/engine/test_exactness_bf16.py says why that and not equality).
2. Throughput: closed loop at 1, 16 and 64 concurrent requests (random 256 in / 64 out,
   ``bench.runs.engine_step``'s driver): output tok/s and the median pure-decode step.
3. Cached-prefix TTFT: one request with a 2,048-token prefix cold, then another with the same
   prefix and a new 32-token suffix: time to its first token, both.
4. The server: ``manage.py runengine --device DEVICE --dp-size N`` (rank r on device r) answers
   one completion per rank over HTTP, with the rank it was asked for (skipped where daphne is
   not installed: the GPU image has torch and transformers, not our server's packages).

Each step prints one line and its numbers go to ``--json``; a failed check makes the exit status
1 after the remaining steps ran.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

VOCAB_LOW, VOCAB_HIGH = 8, 4000  # ordinary tokens of the tiny model
BF16_TOL = 2**-4


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def make_engine(args, dtype: str, **kw):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(model=args.model, device=args.device, dtype=dtype, block_size=16, **kw)
    )


def exactness(args, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engine.sampling_params import SamplingParams
    from engine.tiny import ensure_tiny_model

    path = ensure_tiny_model() if args.model == "tiny" else args.model
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(args.device).eval()
    rng = random.Random(7)
    shared = ids(rng, 160)
    prompts = [ids(rng, n) for n in (1, 17, 131, 300)] + [shared + ids(rng, n) for n in (3, 40)]
    engine = make_engine(args, dtype, num_kv_blocks=1024)
    engine.generate([shared + ids(rng, 5)], SamplingParams(max_tokens=2, temperature=0))
    outs = engine.generate(prompts, SamplingParams(max_tokens=args.exact_tokens, temperature=0))
    worst, mismatched = 0.0, 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs, strict=True):
            tokens = out["token_ids"]
            if dtype == "float32":
                ref = model.generate(
                    torch.tensor([prompt], device=args.device),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=args.device),
                    max_new_tokens=args.exact_tokens,
                    do_sample=False,
                )[0, len(prompt) :].tolist()
                mismatched += ref != tokens
            else:
                seq = torch.tensor([prompt + tokens], device=args.device)
                logits = model(seq).logits[0, len(prompt) - 1 : -1].float()
                picked = logits.gather(1, torch.tensor(tokens, device=args.device)[:, None])[:, 0]
                worst = max(worst, (logits.max(dim=-1).values - picked).max().item())
    ok = mismatched == 0 if dtype == "float32" else worst <= BF16_TOL
    cached = [o["num_cached_tokens"] for o in outs[-2:]]
    return {"dtype": dtype, "ok": ok, "mismatched_outputs": mismatched,
            "worst_logit_gap": worst, "shared_prefix_cached_tokens": cached}  # fmt: skip


def throughput(args, dtype: str) -> list[dict]:
    from bench.runs.engine_step import run

    rows = []
    engine = make_engine(args, dtype, max_num_seqs=max(args.concurrency))
    rng = random.Random(3)
    run(engine, [ids(rng, 256) for _ in range(8)], 8, 8)  # warm up
    for c in args.concurrency:
        n = max(2 * c, args.min_prompts)
        r = run(engine, [ids(rng, 256) for _ in range(n)], c, 64)
        rows.append({"dtype": dtype, "concurrency": c, "requests": n,
                     "output_tok_per_s": r["output_tok_per_s"],
                     "decode_step_ms_p50": r["decode_ms_p50"]})  # fmt: skip
    return rows


def cached_prefix_ttft(args, dtype: str) -> dict:
    from engine.sampling_params import SamplingParams

    engine = make_engine(args, dtype)
    rng = random.Random(11)
    prefix = ids(rng, args.prefix_tokens)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def first_token_s(prompt: list[int]) -> tuple[float, int]:
        rid = f"ttft-{time.monotonic_ns()}"
        started = time.perf_counter()
        engine.add_request(rid, prompt, params)
        while True:
            for out in engine.step():
                if out.request_id == rid and out.new_token_ids:
                    return time.perf_counter() - started, out.num_cached_tokens

    first_token_s(ids(rng, 64))  # warm up
    cold, _ = first_token_s(prefix + ids(rng, 32))
    warm, cached = first_token_s(prefix + ids(rng, 32))
    return {"dtype": dtype, "prefix_tokens": len(prefix), "cold_ttft_ms": cold * 1e3,
            "cached_ttft_ms": warm * 1e3, "cached_tokens": cached}  # fmt: skip


def server(args) -> dict:
    import importlib.util

    if importlib.util.find_spec("daphne") is None:  # a GPU image with torch but not our server
        return {"ok": None, "skipped": "daphne is not installed here (carry its wheels)"}
    import httpx

    from harness.procs import free_port, start

    port = free_port()
    cmd = [sys.executable, "manage.py", "runengine", "--port", str(port), "--device",
           args.device, "--dp-size", str(args.dp_size), "--model", args.model]  # fmt: skip
    answered = []
    with start(cmd, f"http://127.0.0.1:{port}", Path(args.log), timeout=300) as proc:
        info = httpx.get(proc.url + "/server_info", timeout=10).json()
        for rank in range(args.dp_size):
            r = httpx.post(
                proc.url + "/v1/completions",
                json={"prompt": "hello there", "max_tokens": 4, "data_parallel_rank": rank},
                timeout=120,
            )
            answered.append(
                r.status_code == 200 and r.headers.get("x-data-parallel-rank") == str(rank)
            )
    return {"dp_size": info.get("dp_size"), "ranks_answered": answered, "ok": all(answered)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench.runs.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--min-prompts", type=int, default=32)
    p.add_argument("--exact-tokens", type=int, default=24)
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--log", default="/tmp/gpu-check-engine.log")
    p.add_argument("--quick", action="store_true", help="small sizes (a CPU dry run)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.min_prompts, args.exact_tokens = [1, 4], 4, 8
        args.prefix_tokens = 512
    import torch

    out: dict = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    failed = False
    steps = [("exactness", exactness), ("throughput", throughput), ("ttft", cached_prefix_ttft)]
    for name, step in steps:
        for dtype in args.dtype:
            try:
                result = step(args, dtype)
            except Exception as exc:  # report and go on: the other steps still say something
                result = {"dtype": dtype, "ok": False, "error": repr(exc)}
            out.setdefault(name, []).append(result)
            failed |= isinstance(result, dict) and result.get("ok") is False
            print(name, json.dumps(result), flush=True)
    try:
        out["server"] = server(args)
    except Exception as exc:
        out["server"] = {"ok": False, "error": repr(exc)}
    failed |= out["server"]["ok"] is False
    print("server", json.dumps(out["server"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
