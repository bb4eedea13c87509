"""``python -m bench`` / ``manage.py bench``: flags (vLLM's ``bench serve`` names where they exist),
target discovery, dataset building, the run, and the report."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path

import httpx

from bench import datasets, engine_metrics, trace
from bench.oracle import sample_oracle
from bench.report import format_report, write_json
from bench.runner import RunOptions, RunResult, send_conversations, send_samples
from bench.summary import summarize

logger = logging.getLogger(__name__)

DATASETS = ("prefix_repetition", "random", "multi_turn")  # synthetic (the dashboard offers these)
TRACE_DATASETS = ("mooncake_trace",)  # replayed from --trace-path (bench/trace.py)
DEFAULT_NUM_PROMPTS = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """All flags; shared by ``python -m bench`` and ``manage.py bench``."""
    _add_target_arguments(parser)
    _add_run_arguments(parser)
    _add_dataset_arguments(parser)
    trace.add_arguments(parser)


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """Where to send, and what the target serves (each discovered when not given)."""
    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root, e.g. http://127.0.0.1:8000",
    )
    parser.add_argument(
        "--model", default=None, help="model name to send (default: the target's /v1/models)"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer path (default: the model path of /server_info, or of a router's workers "
        "on GET /workers, when it exists here)",
    )
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="id range when no tokenizer is known"
    )


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """How many requests, how fast, and where the numbers go."""
    parser.add_argument(
        "--dataset-name", default="prefix_repetition", choices=DATASETS + TRACE_DATASETS
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests (default {DEFAULT_NUM_PROMPTS}); mooncake_trace: the first N records of "
        "the trace, in its order (default: the whole trace)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="req/s, Poisson arrivals (default inf)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--prompt-format",
        default="ids",
        choices=["ids", "text"],
        help="completions prompts as token-id lists (exact lengths) or decoded text",
    )
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos so outputs have exactly the requested length",
    )
    parser.add_argument(
        "--extra-body", type=json.loads, default={}, help="JSON merged into every request body"
    )
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument(
        "--engine-metrics-url", default=None, help="engine /metrics to diff per rank around the run"
    )
    parser.add_argument(
        "--json", dest="json_path", default=None, metavar="PATH", help="write all numbers here"
    )
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument(
        "--oracle-block-size",
        type=int,
        default=None,
        metavar="N",
        help="block size of the oracle hit rate printed beside the measured one (one unbounded "
        "prefix cache over the token-id prompts, in send order); default: the target's "
        "/server_info block_size, else 16",
    )


def _add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """Each synthetic workload's shape (vLLM's ``bench serve`` names)."""
    group = parser.add_argument_group("prefix_repetition")
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    group.add_argument("--prefix-repetition-output-len", type=int, default=128)
    group = parser.add_argument_group("random")
    group.add_argument("--random-input-len", type=int, default=1024)
    group.add_argument("--random-output-len", type=int, default=128)
    group = parser.add_argument_group("multi_turn")
    group.add_argument("--multi-turn-conversations", type=int, default=16)
    group.add_argument("--multi-turn-turns", type=int, default=5)
    group.add_argument("--multi-turn-system-len", type=int, default=400)
    group.add_argument("--multi-turn-user-len", type=int, default=60)
    group.add_argument("--multi-turn-output-len", type=int, default=32)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench", description="OpenAI-API load generator for dp-mesh engines"
    )
    add_arguments(parser)
    return parser


# ----- the target ------------------------------------------------------------------------------
def discover(base_url: str, api_key: str | None = None, model: str | None = None) -> dict:
    """What the target says of itself: an engine's /server_info (empty for servers without it)
    plus ``models`` from /v1/models. A router has no /server_info of its own; its workers' facts
    (GET /workers) stand in, so ``bench`` against ``manage.py serve`` finds the tokenizer as it
    does against the engine. ``model`` picks the workers (default: the first of ``models``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=30, headers=headers) as client:
        info = _server_info(client)
        models = _models(client)
        if not info:
            info = _fleet_info(client, model or (models or [None])[0])
    return {**info, "models": models}


def _server_info(client: httpx.Client) -> dict:
    """/server_info, or SGLang's older /get_server_info; {} when neither answers a JSON object."""
    for path in ("/server_info", "/get_server_info"):
        try:
            r = client.get(path)
            body = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            continue
        if isinstance(body, dict):
            return body
    return {}


def _models(client: httpx.Client) -> list[str]:
    try:
        r = client.get("/v1/models")
        return [m["id"] for m in r.json().get("data", [])] if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return []


FLEET_FACTS = ("vocab_size", "block_size", "max_model_len")


def _fleet_info(client: httpx.Client, model: str | None) -> dict:
    """A router's knowledge of the workers serving ``model``, from GET /workers (each row holds
    the worker's own /server_info and the registration's overrides): the tokenizer's path (an
    override's ``tokenizer_path``, else the model's), vocabulary, block size and context, from a
    healthy worker when there is one. ``dp_size`` only for a single worker: behind several, a
    rank number names no one rank. {} when the target is no router of ours."""
    try:
        r = client.get("/workers")
        rows = r.json().get("workers") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return {}
    known = [w for w in rows or [] if isinstance(w, dict) and w.get("server_info")]
    serving = [w for w in known if w.get("model") == model] or known
    healthy = [w for w in serving if w.get("health") == "healthy"] or serving
    if not healthy:
        return {}
    server_info, overrides = healthy[0]["server_info"], healthy[0].get("overrides") or {}
    info = {k: server_info[k] for k in FLEET_FACTS if server_info.get(k) is not None}
    path = overrides.get("tokenizer_path") or server_info.get("model_path")
    if path:
        info["model_path"] = path
    if len(serving) == 1:
        info["dp_size"] = serving[0].get("dp_size") or server_info.get("dp_size")
    return info


def load_tokenizer(args, info: dict):
    """``--tokenizer``, else the target's own model directory when it is on this machine, else
    None."""
    path = args.tokenizer or info.get("model_path")
    if not path or (not args.tokenizer and not Path(path).is_dir()):
        return None
    from transformers import AutoTokenizer  # heavy: only when there is a tokenizer to load

    return AutoTokenizer.from_pretrained(path)


def model_name(args, info: dict) -> str:
    name = args.model or info.get("served_model_name") or (info.get("models") or [None])[0]
    if not name:
        raise SystemExit("bench: no model name; pass --model (the target lists none at /v1/models)")
    return name


# ----- the workload ----------------------------------------------------------------------------
def build_workload(args, info: dict, tokenizer):
    """The samples (prefix_repetition, random) or conversations (multi_turn) for ``args``."""
    if args.dataset_name == "multi_turn":
        return datasets.multi_turn(
            num_conversations=args.multi_turn_conversations,
            num_turns=args.multi_turn_turns,
            system_len=args.multi_turn_system_len,
            user_len=args.multi_turn_user_len,
            output_len=args.multi_turn_output_len,
            seed=args.seed,
            tokenizer=tokenizer,
        )
    if args.dataset_name in TRACE_DATASETS:
        return build_trace(args, info, tokenizer).samples
    allowed = _allowed(args, info, tokenizer)
    as_text = args.prompt_format == "text"
    num_prompts = DEFAULT_NUM_PROMPTS if args.num_prompts is None else args.num_prompts
    if args.dataset_name == "random":
        return datasets.random_prompts(
            num_prompts=num_prompts,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            seed=args.seed,
            allowed=allowed,
            tokenizer=tokenizer,
            as_text=as_text,
        )
    return datasets.prefix_repetition(
        num_prompts=num_prompts,
        prefix_len=args.prefix_repetition_prefix_len,
        suffix_len=args.prefix_repetition_suffix_len,
        num_prefixes=args.prefix_repetition_num_prefixes,
        output_len=args.prefix_repetition_output_len,
        seed=args.seed,
        allowed=allowed,
        tokenizer=tokenizer,
        as_text=as_text,
    )


def _allowed(args, info: dict, tokenizer) -> list[int]:
    vocab = (
        args.vocab_size
        or info.get("vocab_size")
        or (len(tokenizer) if tokenizer is not None else None)
    )
    if vocab is None and tokenizer is None:
        raise SystemExit(
            "bench: no tokenizer and no vocab size; pass --tokenizer PATH or --vocab-size N"
        )
    return datasets.allowed_token_ids(vocab, tokenizer)


def build_trace(args, info: dict, tokenizer) -> trace.TraceWorkload:
    """The trace's first ``--num-prompts`` records as token-id samples; the target's
    max_model_len (when /server_info has it) bounds prompt + output."""
    if args.prompt_format != "ids":
        raise SystemExit("bench: mooncake_trace sends token-id prompts only (--prompt-format ids)")
    try:
        return trace.build_from_args(
            args, _allowed(args, info, tokenizer), info.get("max_model_len")
        )
    except (OSError, ValueError) as exc:
        raise SystemExit(f"bench: {exc}")


def _check(args) -> None:
    if args.speedup is None:
        return
    if args.dataset_name not in TRACE_DATASETS:
        raise SystemExit(
            "bench: --speedup replays a trace's timestamps (--dataset-name mooncake_trace)"
        )
    if args.request_rate != float("inf"):
        raise SystemExit("bench: --speedup sends on the trace's own times; drop --request-rate")
    if args.speedup <= 0:
        raise SystemExit("bench: --speedup must be positive")


async def measure(
    opts: RunOptions, workload, metrics_url: str | None
) -> tuple[RunResult, dict | None]:
    """Run the workload, diffing the engine's per-rank counters around it when asked."""
    before = await engine_metrics.scrape(metrics_url) if metrics_url else None
    if workload and isinstance(workload[0], datasets.Conversation):
        run = await send_conversations(opts, workload)
    else:
        run = await send_samples(opts, workload)
    if before is None:
        return run, None
    after = await engine_metrics.scrape(metrics_url)
    return run, engine_metrics.summarize(engine_metrics.delta(before, after))


def run(args) -> dict:
    """Benchmark as ``args`` say; print the table, write ``--json``; return the report."""
    # like vLLM's bench: the key comes from the environment
    api_key = os.environ.get("OPENAI_API_KEY") or None
    _check(args)
    info = discover(args.base_url, api_key, args.model)
    tokenizer = load_tokenizer(args, info)
    replay = build_trace(args, info, tokenizer) if args.dataset_name in TRACE_DATASETS else None
    workload = replay.samples if replay else build_workload(args, info, tokenizer)
    opts = RunOptions(
        base_url=args.base_url,
        model=model_name(args, info),
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        extra_body=args.extra_body,
        timeout_s=args.request_timeout,
        progress=not args.disable_tqdm,
        api_key=api_key,
        speedup=args.speedup,
    )
    result, engine = asyncio.run(measure(opts, workload, args.engine_metrics_url))
    block = args.oracle_block_size or info.get("block_size") or 16
    is_samples = not (workload and isinstance(workload[0], datasets.Conversation))
    report = {
        "config": {**_config(args), "model": opts.model, "dp_size": info.get("dp_size")},
        "summary": summarize(result.results, result.duration_s, info.get("dp_size")),
        "oracle": sample_oracle(result.results, workload, block) if is_samples else None,
        "trace": _trace_info(replay, opts.speedup) if replay else None,
        "engine_metrics": engine,
        "requests": [_request_row(r) for r in result.results],
    }
    print(format_report(report), flush=True)
    if args.json_path:
        write_json(report, args.json_path)
    return report


def _trace_info(replay: trace.TraceWorkload, speedup: float | None) -> dict:
    return {
        "records": replay.window,
        "sent": len(replay.samples),
        "skipped": replay.skipped,
        "clipped": replay.clipped,
        "block_tokens": replay.block_tokens,
        "max_input_len": replay.limit,
        "speedup": speedup,
    }


def _config(args) -> dict:
    """The flags as JSON-safe values (an infinite rate becomes "inf": JSON has no Infinity)."""
    out = {}
    for key, value in vars(args).items():
        if isinstance(value, float) and value == float("inf"):
            value = "inf"
        if value is None or isinstance(value, (str, int, float, bool, dict, list)):
            out[key] = value
    return out


def _request_row(result) -> dict:
    row = asdict(result)
    row.pop("text")
    return row


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    report = run(build_parser().parse_args(argv))
    return 0 if report["summary"]["completed"] else 1
