"""The dashboard's on-demand benchmark: a small, bounded version of ``manage.py bench`` sent to
the router itself, so an operator can see what the live fleet does with a known workload."""

from __future__ import annotations

import asyncio

from bench import cli
from bench.summary import summarize

LIMITS = {"num_prompts": (1, 2000), "max_concurrency": (1, 64)}
DEFAULTS = {"dataset": "prefix_repetition", "num_prompts": 50, "max_concurrency": 8}
TURNS = 5  # multi_turn: num_prompts counts turns, num_prompts // TURNS conversations


def validate(params: dict) -> dict:
    """The accepted parameters, defaults filled in; ValueError naming the bad one."""
    if not isinstance(params, dict):
        raise ValueError("the body must be a JSON object")
    unknown = set(params) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown parameter(s): {', '.join(sorted(unknown))}")
    out = {**DEFAULTS, **params}
    if out["dataset"] not in cli.DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(cli.DATASETS)}")
    for name, (low, high) in LIMITS.items():
        value = out[name]
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"{name} must be an integer from {low} to {high}")
    if out["dataset"] == "multi_turn" and out["num_prompts"] < TURNS:
        raise ValueError(
            f"multi_turn needs num_prompts >= {TURNS} (one conversation of {TURNS} turns)"
        )
    return out


def arguments(base_url: str, params: dict) -> list[str]:
    """``bench`` flags for ``params``: short prompts and outputs, so a run takes seconds."""
    argv = [
        "--base-url",
        base_url,
        "--dataset-name",
        params["dataset"],
        "--num-prompts",
        str(params["num_prompts"]),
        "--max-concurrency",
        str(params["max_concurrency"]),
        "--disable-tqdm",
        "--seed",
        "0",
    ]
    if params["dataset"] == "prefix_repetition":
        argv += [
            "--prefix-repetition-prefix-len",
            "256",
            "--prefix-repetition-suffix-len",
            "64",
            "--prefix-repetition-num-prefixes",
            "5",
            "--prefix-repetition-output-len",
            "16",
        ]
    elif params["dataset"] == "random":
        argv += ["--random-input-len", "256", "--random-output-len", "16"]
    else:
        argv += [
            "--multi-turn-conversations",
            str(params["num_prompts"] // TURNS),
            "--multi-turn-turns",
            str(TURNS),
            "--multi-turn-output-len",
            "16",
        ]
    return argv


def execute(
    base_url: str, params: dict, api_key: str | None = None, server_info: dict | None = None
) -> dict:
    """Run the workload (blocking) and return the numbers the dashboard shows. A router has no
    /server_info of its own: ``server_info`` (a worker's) gives the tokenizer and vocabulary."""
    params = validate(params)
    args = cli.build_parser().parse_args(arguments(base_url, params))
    info = {**(server_info or {}), **cli.discover(base_url, api_key)}
    tokenizer = cli.load_tokenizer(args, info)
    workload = cli.build_workload(args, info, tokenizer)
    opts = cli.RunOptions(
        base_url=base_url,
        model=cli.model_name(args, info),
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        progress=False,
        api_key=api_key,
    )
    run, _ = asyncio.run(cli.measure(opts, workload, None))
    summary = summarize(run.results, run.duration_s, info.get("dp_size"))
    return {
        "completed": summary["completed"],
        "failed": summary["failed"],
        "errors": summary["errors"],
        "duration_s": round(summary["duration_s"], 3),
        "throughput_rps": round(summary["request_throughput"], 3),
        "hit_rate": summary["hit_rate"],
        "cached_tokens": summary["cached_tokens"],
        "prompt_tokens": summary["total_input_tokens"],
        "ttft_ms": {
            "mean": summary["ttft_ms"]["mean"],
            "p50": summary["ttft_ms"]["median"],
            "p99": summary["ttft_ms"]["p99"],
        },
        "balance": summary["per_rank"]["prompt_tokens_max_over_mean"],
        "per_rank": summary["per_rank"]["ranks"],
        "ttft_ms_series": [
            round(r.ttft * 1000, 2) if r.ok and r.ttft is not None else None for r in run.results
        ],
    }
