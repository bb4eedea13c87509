"""The printed table (vLLM's layout, plus cache and per-rank sections) and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path

WIDTH = 60


def _title(text: str, fill: str = "=") -> str:
    return f"{' ' + text + ' ':{fill}^{WIDTH}}"


def _row(label: str, value) -> str:
    if value is None:
        shown = "n/a"
    elif isinstance(value, float):
        shown = f"{value:.2f}"
    else:
        shown = str(value)
    return f"{label + ':':<42}{shown:>{WIDTH - 42}}"


def _latency(name: str, key: str, summary: dict) -> list[str]:
    d = summary[key]
    return [
        _title(name, "-"),
        _row(f"Mean {name.split()[0]} (ms)", d["mean"]),
        _row(f"Median {name.split()[0]} (ms)", d["median"]),
        _row(f"P99 {name.split()[0]} (ms)", d["p99"]),
    ]


def _ranks(title: str, block: dict) -> list[str]:
    if not block:
        return []
    lines = [
        _title(title, "-"),
        f"{'rank':>6}{'requests':>12}{'prompt tok':>14}{'cached tok':>14}{'hit rate':>12}",
    ]
    for rank, row in block["ranks"].items():
        hit = row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
        lines.append(
            f"{rank:>6}{row['requests']:>12}{row['prompt_tokens']:>14}{row['cached_tokens']:>14}{hit:>12.2%}"
        )
    lines.append(_row("Requests max/mean", block.get("requests_max_over_mean")))
    lines.append(_row("Prompt tokens max/mean", block.get("prompt_tokens_max_over_mean")))
    return lines


def _oracle(oracle: dict | None, cached: int | None) -> list[str]:
    """The unbounded-cache oracle beside the measured hits (bench/oracle.py)."""
    if not oracle:
        return []
    rate = oracle["hit_rate"]
    return [
        _row(f"Oracle cached tokens (block {oracle['block_size']})", oracle["cached_tokens"]),
        _row("Oracle hit rate (one unbounded cache)", f"{rate:.2%}" if rate is not None else None),
        _row(
            "Cached / oracle",
            cached / oracle["cached_tokens"]
            if cached is not None and oracle["cached_tokens"]
            else None,
        ),
    ]


def _trace(info: dict | None) -> list[str]:
    if not info:
        return []
    return [
        _title("Trace replay", "-"),
        _row("Trace records (window)", info["records"]),
        _row("Sent / skipped / clipped", f"{info['sent']} / {info['skipped']} / {info['clipped']}"),
        _row("Tokens per hash id", info["block_tokens"]),
        _row("Speedup (open loop)", info["speedup"] if info["speedup"] else "off (trace order)"),
    ]


def format_report(report: dict) -> str:
    """The human-readable result of one run."""
    s = report["summary"]
    hit = s["hit_rate"]
    lines = [
        _title("Serving Benchmark Result"),
        _row("Target", report["config"]["base_url"]),
        _row("Dataset", report["config"]["dataset_name"]),
        _row("Successful requests", s["completed"]),
        _row("Failed requests", s["failed"]),
        _row("Maximum request concurrency", report["config"]["max_concurrency"]),
        _row("Benchmark duration (s)", s["duration_s"]),
        _row("Total input tokens", s["total_input_tokens"]),
        _row("Total generated tokens", s["total_output_tokens"]),
        _row("Request throughput (req/s)", s["request_throughput"]),
        _row("Output token throughput (tok/s)", s["output_throughput"]),
        _row("Total token throughput (tok/s)", s["total_token_throughput"]),
        *_latency("TTFT", "ttft_ms", s),
        *_latency("TPOT (excl. 1st token)", "tpot_ms", s),
        *_latency("ITL", "itl_ms", s),
        *_latency("E2EL", "e2el_ms", s),
        *_trace(report.get("trace")),
        _title("Prefix cache", "-"),
        _row("Cached prompt tokens", s["cached_tokens"]),
        _row("Hit rate (cached / prompt tokens)", f"{hit:.2%}" if hit is not None else None),
        *_oracle(report.get("oracle"), s["cached_tokens"]),
        *_ranks("Per rank (X-Data-Parallel-Rank)", s["per_rank"]),
    ]
    engine = report.get("engine_metrics")
    if engine:
        lines += _ranks("Per rank (engine /metrics deltas)", engine)
        lines.append(
            _row(
                "Engine hit rate",
                f"{engine['hit_rate']:.2%}" if engine["hit_rate"] is not None else None,
            )
        )
    if s["errors"]:
        lines += [_title("Errors (first distinct)", "-"), *s["errors"]]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
