"""``runengine``: N DP rank processes behind one OpenAI HTTP front served by daphne.

The flags, and the ``EngineConfig`` they make, are ``engine.server.flags``'s; this module uses
``add_arguments`` and ``engine_config`` and so also offers them (``manage.py runengine`` imports
``add_arguments`` and ``serve`` from here).

Arrows: the top of the engine. It imports ``engine.server.flags``, ``engine.server.frontend``
(which starts the rank processes) and ``engine.server.app``; no engine module imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import uuid
from dataclasses import asdict

from engine.digests import SCHEME
from engine.server.flags import add_arguments, engine_config, resolve_dp_size, scheduler_limits
from engine.sim.profiles import get_profile

logger = logging.getLogger(__name__)


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
    check_lora_modules(args)  # first: a bad adapter fails the start in a moment
    # builds the tiny model once, before the ranks race for it
    model_path = model_directory(args)
    tokenizer = front_tokenizer(model_path, args.simulate)
    config = engine_config(args, model_path)
    client = EngineClient(config, dp_size, args.dp_load_balance)
    threads = args.threads_per_rank or max(1, _cores() // dp_size)
    client.start(threads)
    from serving import tracing

    tracing.setup("dpmesh-engine")  # the front's spans (the ranks are started: none inherit it)
    return client, tokenizer, model_path, dp_size, tp_size


def check_lora_modules(args) -> None:
    """Refuse, before any rank starts, adapters no rank could serve: a name taken twice or by
    the base model, a directory that is not a PEFT LoRA adapter, a rank over ``--max-lora-rank``,
    or a forward pass that cannot apply them. Each rank then checks the weights against the
    model (engine/lora_layers.py) and fails the start if they do not fit."""
    from engine.lora import check_names, read_adapter_config

    if not args.lora_modules:
        return
    try:
        check_names(tuple(args.lora_modules), {args.served_model_name or args.model, args.model})
        for module in args.lora_modules:
            read_adapter_config(module.path, args.max_lora_rank)
    except ValueError as exc:
        raise SystemExit(f"--lora-modules: {exc}") from None
    if args.model_impl == "transformers":
        raise SystemExit(
            "--lora-modules needs the native forward pass (engine/native_llama.py): "
            "drop --model-impl transformers"
        )


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
        # the largest request body the front reads (413 past it): a router refuses larger ones
        "max_request_body_bytes": args.max_body_bytes,
        # sequences a rank runs at once: a router sends no more to a rank whose seats are taken
        # while another has one free (apps/routing/decision/policies.py)
        "max_num_seqs": scheduler_limits(
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
        # prefill/decode disaggregation (engine/kv_transfer.py): null, prefill or decode
        "disaggregation_mode": args.disaggregation_mode,
        # the LoRA adapters a request may name in ``model``: a router chains their digests on
        # the adapter (engine/digests.py namespace)
        "lora_modules": [asdict(module) for module in args.lora_modules],
        "max_lora_rank": args.max_lora_rank,
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
    if args.server == "daphne":
        # installs the asyncio reactor; must come before twisted.internet.reactor
        from daphne.server import Server
        from twisted.internet import reactor

        loop = reactor._asyncioEventloop
    else:
        import uvloop

        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
    from engine.server.app import EngineApp
    from serving.drain import Drain, close_loop, stop_reactor

    client, tokenizer, model_path, dp_size, tp_size = build(args)
    client.bind(loop)
    if not client.wait_ready(args.startup_timeout):
        logger.error("engine failed to start: %s", client.health_reason())
        client.shutdown()
        return 1
    info = server_info(args, client, model_path, dp_size, tp_size, tokenizer)
    if args.disaggregation_mode == "prefill":
        from engine.server.pd import BootstrapServer

        bootstrap = BootstrapServer(args.host, args.disaggregation_bootstrap_port, client)
        info["disaggregation_bootstrap_port"] = bootstrap.port
        # SGLang's name: a router knows the prefill rank is the room's (engine/server/pd.py)
        info["load_balance_method"] = "follow_bootstrap_room"
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
    try:
        if args.server == "daphne":
            drain.install(loop, lambda: stop_reactor(reactor))
            Server(
                application=app,
                endpoints=[f"tcp:port={args.port}:interface={args.host}"],
                signal_handlers=False,  # drain.py's instead: Twisted's would cut every stream
                verbosity=0,
                application_close_timeout=5,
            ).run()
        else:
            from serving.uvicorn_server import make_server

            server = make_server(app, args.host, args.port, backlog=2048, graceful_s=2.0)
            drain.install(loop, server.stop)
            loop.run_until_complete(server.serve())
    finally:
        client.shutdown()
        close_loop(loop)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runengine", description=__doc__)
    add_arguments(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
