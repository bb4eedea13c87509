"""``runengine``: N DP rank processes behind one OpenAI HTTP front served by daphne."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import uuid

from engine.config import ATTENTION_IMPLS, DTYPES, MODEL_IMPLS
from engine.digests import SCHEME
from engine.sim.profiles import PROFILES, get_profile

logger = logging.getLogger("engine.front")

DEFAULT_PORT = 8000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of DESIGN.md, shared by ``manage.py runengine`` and
    ``python -m engine.server.main``."""
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
    parser.add_argument(
        "--cache-stats-interval",
        type=int,
        default=100,
        help="log [Cache Stats] lines every this many requests per rank",
    )
    parser.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument(
        "--drain-timeout-secs",
        type=float,
        default=25.0,
        help="on SIGTERM/SIGINT: how long requests in flight may run on before the engine stops "
        "(new ones get 503 meanwhile; a second signal stops at once)",
    )
    add_simulation_arguments(parser)


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


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def build(args):
    """Start the ranks and build the ASGI app (rank processes run from here on)."""
    from engine.server.frontend import EngineClient

    dp_size, tp_size = resolve_dp_size(args)
    if dp_size < 1:
        raise SystemExit("--dp-size must be >= 1")
    # builds the tiny model once, before the ranks race for it
    model_path = model_directory(args)
    tokenizer = front_tokenizer(model_path, args.simulate)
    config = engine_config(args, model_path)
    client = EngineClient(config, dp_size, args.dp_load_balance)
    threads = args.threads_per_rank or max(1, _cores() // dp_size)
    client.start(threads)
    return client, tokenizer, model_path, dp_size, tp_size


def model_directory(args) -> str:
    """The model's local directory. A simulated engine never imports torch, so it has a missing
    tiny model built by a child process."""
    from engine.tiny import resolve_model_path

    if args.simulate and args.model == "tiny":
        import subprocess

        subprocess.run([sys.executable, "-m", "engine.tiny"], check=True, stdout=subprocess.DEVNULL)
    return resolve_model_path(args.model)


def front_tokenizer(model_path: str, simulate: str | None):
    """The tokenizer the front parses prompts with: transformers' for the real engine, the lean
    ``engine.tokenizer`` (same ids, no torch) for a simulated one."""
    if simulate:
        from engine.tokenizer import load_tokenizer

        return load_tokenizer(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def engine_config(args, model_path: str):
    """The ranks' EngineConfig; with --simulate, the profile fills the scheduler limits the
    flags leave unset (a device is never probed: that would import torch)."""
    from engine.config import EngineConfig

    profile = get_profile(args.simulate) if args.simulate else None
    return EngineConfig(
        model=model_path,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        **_scheduler_limits(args, profile),
        max_model_len=args.max_model_len,
        device="cpu" if profile else resolve_device(args.device),
        dtype=args.dtype,
        model_impl=args.model_impl,
        attention_impl=args.attention_impl,
        stats_interval=args.cache_stats_interval,
        simulate=args.simulate,
        simulate_speedup=args.simulate_speedup,
    )


def _scheduler_limits(args, profile) -> dict[str, int | None]:
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


def vocab_size(model_path: str, tokenizer, simulate: str | None) -> int:
    """The id range prompts may use: the model's embedding rows, or (simulated, no model) the
    tokenizer's full vocabulary."""
    if simulate:
        return len(tokenizer)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).vocab_size


def server_info(args, client, model_path: str, dp_size: int, tp_size: int, tokenizer) -> dict:
    first = client.ranks[0].info
    info = {
        "vocab_size": vocab_size(model_path, tokenizer, args.simulate),
        "model_id": args.model,
        "served_model_name": args.served_model_name or args.model,
        "model_path": model_path,
        "dp_size": dp_size,
        "tp_size": tp_size,
        "block_size": args.block_size,
        "num_kv_blocks_per_rank": first.num_kv_blocks,
        "max_model_len": first.max_model_len,
        # sequences a rank runs at once: a router sends no more to a rank whose seats are taken
        # while another has one free (apps/routing/policies.py)
        "max_num_seqs": _scheduler_limits(
            args, get_profile(args.simulate) if args.simulate else None
        )["max_num_seqs"],
        # prefills longer than this that short prompts jump (engine.scheduler; 0: strict FCFS)
        "long_prefill_token_threshold": engine_config(args, model_path).long_prefill_threshold(),
        "dp_load_balance": args.dp_load_balance,
        "enable_prefix_caching": True,
        "prefix_digest": SCHEME,
        "kv_events": "/kv_events",  # the prefix caches as they change (SSE), for precise routing
        # new at every start: a router that sees it change knows the prefix caches are empty
        "instance_id": uuid.uuid4().hex,
    }
    if args.simulate:
        info["simulate"] = {
            **get_profile(args.simulate).summary(),
            "speedup": args.simulate_speedup,
        }
    return info


def register(router_url: str, own_url: str, key: str | None = None) -> None:
    """Tell a router about this engine, retrying while the router starts. A refusal (401/403: no
    or a wrong admin key) is final: retrying would not change it."""
    import time

    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for attempt in range(30):
        try:
            r = httpx.post(
                f"{router_url.rstrip('/')}/workers",
                json={"url": own_url},
                timeout=10,
                headers=headers,
            )
        except httpx.HTTPError as exc:
            logger.info("router %s not reachable yet (%s); retrying", router_url, exc)
            time.sleep(min(5.0, 0.5 * (attempt + 1)))
            continue
        if r.status_code < 300:
            logger.info("registered with router %s: %s", router_url, r.status_code)
        elif r.status_code in (401, 403):
            logger.error(
                "router %s refused registration (%s): %s the router's admin key "
                "with --register-key (or CONTROL_PLANE_ADMIN_KEYS); not retrying",
                router_url,
                r.status_code,
                "check" if key else "pass",
            )
        else:
            logger.warning(
                "router %s refused registration: %s %s", router_url, r.status_code, r.text[:200]
            )
        return
    logger.error("gave up registering with router %s", router_url)


def register_key(args) -> str | None:
    """``--register-key``, else the first of ``CONTROL_PLANE_ADMIN_KEYS`` (the router's own
    setting)."""
    if args.register_key:
        return args.register_key
    keys = [
        k.strip() for k in os.environ.get("CONTROL_PLANE_ADMIN_KEYS", "").split(",") if k.strip()
    ]
    return keys[0] if keys else None


def serve(args) -> int:
    logging.basicConfig(
        level=os.environ.get("ENGINE_LOG_LEVEL", "INFO"),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s [front] %(name)s: %(message)s",
    )
    logging.getLogger("transformers").setLevel(logging.WARNING)
    # installs the asyncio reactor; must come before twisted.internet.reactor
    from daphne.server import Server
    from twisted.internet import reactor

    from engine.server.app import EngineApp
    from engine.server.drain import Drain, close_loop, stop_reactor

    client, tokenizer, model_path, dp_size, tp_size = build(args)
    client.bind(reactor._asyncioEventloop)
    if not client.wait_ready(args.startup_timeout):
        logger.error("engine failed to start: %s", client.health_reason())
        client.shutdown()
        return 1
    info = server_info(args, client, model_path, dp_size, tp_size, tokenizer)
    app = EngineApp(client, tokenizer, info, max_body_bytes=args.max_body_bytes)
    url = f"http://{args.host}:{args.port}"
    if args.register_with:
        threading.Thread(
            target=register, args=(args.register_with, url, register_key(args)), daemon=True
        ).start()
    print(
        f"Engine ready on {url} (model {info['served_model_name']}, dp_size {dp_size})", flush=True
    )
    drain = Drain(
        lambda: setattr(app, "draining", True),
        lambda: app.in_flight,
        args.drain_timeout_secs,
        logger=logger,
    )
    drain.install(reactor._asyncioEventloop, lambda: stop_reactor(reactor))
    server = Server(
        application=app,
        endpoints=[f"tcp:port={args.port}:interface={args.host}"],
        signal_handlers=False,  # drain.py's instead: Twisted's would cut every stream
        verbosity=0,
        application_close_timeout=5,
    )
    try:
        server.run()
    finally:
        client.shutdown()
        close_loop(reactor._asyncioEventloop)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runengine", description=__doc__)
    add_arguments(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
