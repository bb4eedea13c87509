"""The ``runengine`` command line: its flags, and the ``EngineConfig`` they make.

Shared by ``manage.py runengine`` and ``python -m engine.server.main``; the tests build parsers
from it too. Nothing here imports torch: a simulated engine parses the same flags.

Arrows: ``engine.server.main`` imports this module; it imports only ``engine.config``,
``engine.lora`` (``--lora-modules``' entries) and ``engine.sim.profiles`` (the ``--simulate``
profiles and the limits they fill in).
"""

from __future__ import annotations

import argparse

from engine.config import ATTENTION_IMPLS, DTYPES, MODEL_IMPLS, EngineConfig
from engine.lora import DEFAULT_MAX_LORA_RANK, LoRAModulePath, parse_lora_module
from engine.sim.profiles import PROFILES, get_profile

DEFAULT_PORT = 8000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of DESIGN.md, shared by ``manage.py runengine`` and
    ``python -m engine.server.main``, in the order ``--help`` lists them."""
    _add_model_and_ranks(parser)
    _add_kv_and_scheduling(parser)
    _add_router_facing(parser)
    _add_forward_pass(parser)
    _add_lora(parser)
    _add_operations(parser)
    add_simulation_arguments(parser)


def _add_model_and_ranks(parser: argparse.ArgumentParser) -> None:
    """What runs, in how many DP ranks, and where the front listens."""
    parser.add_argument(
        "--model", default="tiny", help="'tiny' (built in) or a local Hugging Face model directory"
    )
    parser.add_argument("--dp-size", type=int, default=None, help="number of DP ranks (processes)")
    parser.add_argument(
        "-tp",
        "--tp-size",
        type=int,
        default=None,
        dest="tp_size",
        help="ATOM's spelling: with --enable-dp-attention, -tp N means --dp-size N",
    )
    parser.add_argument("--enable-dp-attention", action="store_true")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument(
        "--server",
        choices=("uvicorn", "daphne"),
        default="uvicorn",
        help="the ASGI server of the front (uvicorn: uvloop and httptools, header and body "
        "deadlines; daphne: Twisted)",
    )


def _add_kv_and_scheduling(parser: argparse.ArgumentParser) -> None:
    """Each rank's KV pool and scheduler limits, and how the front spreads requests on ranks."""
    parser.add_argument("--block-size", type=int, default=16)
    kv = parser.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per rank")
    kv.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool bytes per rank")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="default 64 (with --simulate: the profile's)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="default 512 (with --simulate: the profile's)",
    )
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="a prefill with more tokens than this left is long: short prompts jump it "
        "(default: half of --max-num-batched-tokens; with --simulate on a GPU profile 0, vLLM's "
        "default; 0: strict FCFS)",
    )
    parser.add_argument(
        "--dp-load-balance",
        default="least_requests",
        choices=["least_requests", "round_robin", "least_tokens"],
    )


def _add_router_facing(parser: argparse.ArgumentParser) -> None:
    """How a router sees this engine: its model name, and whom it registers with."""
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--register-with",
        default=None,
        metavar="ROUTER_URL",
        help="register this engine with a router's /workers API once ready",
    )
    parser.add_argument(
        "--register-key",
        default=None,
        metavar="KEY",
        help="the router's admin key, sent as 'Authorization: Bearer KEY' with --register-with "
        "(default: the first key of CONTROL_PLANE_ADMIN_KEYS, if set)",
    )


def _add_forward_pass(parser: argparse.ArgumentParser) -> None:
    """Where and how each rank runs the model."""
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=list(DTYPES),
        help="weights and KV cache dtype; auto: the checkpoint's own (the tiny model: float32)",
    )
    parser.add_argument(
        "--model-impl",
        default="auto",
        choices=list(MODEL_IMPLS),
        help="forward pass: native (engine/native_llama.py: Llama, Mistral, Qwen2), transformers "
        "(its decoder modules), or auto: native when the model qualifies",
    )
    parser.add_argument(
        "--attention-impl",
        default="auto",
        choices=list(ATTENTION_IMPLS),
        help="decode attention: cpp (engine/paged_kernel.py, a C++ kernel built at first use, "
        "reading the paged KV pool in place), torch (gather + SDPA), or auto: cpp when it builds",
    )
    parser.add_argument(
        "--threads-per-rank",
        type=int,
        default=None,
        help="torch threads per rank (default: the cores divided between ranks)",
    )


def _add_lora(parser: argparse.ArgumentParser) -> None:
    """LoRA adapters, vLLM's flags: every rank loads each at start; a request picks one by its
    ``model`` field."""
    lora = parser.add_argument_group("LoRA adapters (engine/lora.py)")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="PEFT LoRA adapter directories, each served as a model of its own: name=path, or "
        'the JSON object {"name": ..., "path": ..., "base_model_name": ...} (vLLM\'s flag)',
    )
    lora.add_argument(
        "--max-lora-rank",
        type=int,
        default=DEFAULT_MAX_LORA_RANK,
        help="the largest adapter rank accepted; a larger one fails the start (vLLM's flag)",
    )
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        help="accepted for vLLM's command lines (here --lora-modules alone enables adapters)",
    )


def _lora_module(text: str) -> LoRAModulePath:
    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_operations(parser: argparse.ArgumentParser) -> None:
    """Logging, request size, and how long starting and stopping may take."""
    parser.add_argument(
        "--cache-stats-interval",
        type=int,
        default=100,
        help="log [Cache Stats] lines every this many requests per rank",
    )
    parser.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    pd = parser.add_argument_group("prefill/decode disaggregation (engine/kv_transfer.py)")
    pd.add_argument(
        "--disaggregation-mode",
        choices=["null", "prefill", "decode"],
        default="null",
        help="prefill: answer requests sent for a remote decode and hold their KV for it to "
        "pull; decode: pull the KV a prefill worker computed, then generate (SGLang's flag)",
    )
    pd.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=8998,
        help="a prefill worker's bootstrap listener for SGLang's protocol: decode workers ask it "
        "where a request's KV is (0: any free port, reported on /server_info)",
    )
    pd.add_argument(
        "--kv-transfer-host",
        default=None,
        help="the address decode workers reach this prefill worker's ranks on (default: --host, "
        "or 127.0.0.1 when --host is a wildcard)",
    )
    pd.add_argument(
        "--kv-transfer-timeout-secs",
        type=float,
        default=480.0,
        help="a prefill's KV not pulled within this is released (vLLM's default wait)",
    )
    parser.add_argument(
        "--debug-ignore-rank-on",
        action="append",
        default=[],
        metavar="PATH",
        help="for testing a router's pin check: requests on PATH (e.g. /v1/chat/completions) go "
        "to the rank the engine picks, whatever rank they ask for, as some engines' paths do",
    )
    parser.add_argument(
        "--drain-timeout-secs",
        type=float,
        default=25.0,
        help="on SIGTERM/SIGINT: how long requests in flight may run on before the engine stops "
        "(new ones get 503 meanwhile; a second signal stops at once)",
    )


def add_simulation_arguments(parser: argparse.ArgumentParser) -> None:
    sim = parser.add_argument_group(
        "simulation",
        "the real engine with the model's forward pass replaced by a step-time model "
        "(engine/sim); --num-kv-blocks, --kv-cache-memory, --max-model-len, --block-size, "
        "--max-num-seqs and --max-num-batched-tokens override the profile",
    )
    profiles = "; ".join(f"{p.name}: {p.description}" for p in PROFILES.values())
    sim.add_argument(
        "--simulate",
        metavar="PROFILE",
        default=None,
        choices=list(PROFILES),
        help=f"simulate PROFILE instead of running the model ({profiles})",
    )
    sim.add_argument(
        "--simulate-speedup",
        type=_positive_float,
        default=1.0,
        metavar="X",
        help="run modeled time X times faster (every modeled sleep is divided by X)",
    )


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return number


def resolve_dp_size(args) -> tuple[int, int]:
    """(dp_size, tp_size). ``-tp N --enable-dp-attention`` is ATOM's way of asking for N DP
    ranks."""
    if args.dp_size is not None:
        return args.dp_size, args.tp_size or 1
    if args.enable_dp_attention and args.tp_size:
        return args.tp_size, args.tp_size
    if args.tp_size and args.tp_size > 1:
        raise SystemExit(
            "tensor parallelism is not implemented; "
            "use --dp-size N (or -tp N --enable-dp-attention)"
        )
    return 1, 1


def resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_config(args, model_path: str):
    """The ranks' EngineConfig; with --simulate, the profile fills the scheduler limits the
    flags leave unset (a device is never probed: that would import torch)."""
    profile = get_profile(args.simulate) if args.simulate else None
    return EngineConfig(
        model=model_path,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        **scheduler_limits(args, profile),
        max_model_len=args.max_model_len,
        device="cpu" if profile else resolve_device(args.device),
        dtype=args.dtype,
        model_impl=args.model_impl,
        attention_impl=args.attention_impl,
        stats_interval=args.cache_stats_interval,
        simulate=args.simulate,
        simulate_speedup=args.simulate_speedup,
        disaggregation_mode=(
            None if args.disaggregation_mode == "null" else args.disaggregation_mode
        ),
        kv_transfer_host=kv_transfer_host(args),
        kv_transfer_timeout_s=args.kv_transfer_timeout_secs,
        debug_ignore_rank_paths=tuple(args.debug_ignore_rank_on),
        lora_modules=tuple(args.lora_modules),
        max_lora_rank=args.max_lora_rank,
    )


def kv_transfer_host(args) -> str:
    if args.kv_transfer_host:
        return args.kv_transfer_host
    return "127.0.0.1" if args.host in ("", "0.0.0.0", "::") else args.host


def scheduler_limits(args, profile) -> dict[str, int | None]:
    """--max-num-seqs / --max-num-batched-tokens / --long-prefill-token-threshold, else the
    profile's (simulated: vLLM's defaults on that GPU) or 64 / 512 / half the budget."""
    defaults = (
        (profile.max_num_seqs, profile.max_num_batched_tokens, profile.long_prefill_token_threshold)
        if profile
        else (64, 512, None)
    )
    flags = (args.max_num_seqs, args.max_num_batched_tokens, args.long_prefill_token_threshold)
    seqs, tokens, threshold = (d if f is None else f for f, d in zip(flags, defaults, strict=True))
    return {
        "max_num_seqs": seqs,
        "max_num_batched_tokens": tokens,
        "long_prefill_token_threshold": threshold,
    }
