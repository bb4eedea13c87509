"""Single-token decode attention that reads the paged KV pool's blocks in place (no gather).

``engine/csrc/paged_decode.cpp`` is a small C++ torch extension, compiled with
``torch.utils.cpp_extension`` at first use into a cache of our own: ``DPMESH_KERNEL_CACHE``,
default ``~/.cache/dpmesh/kernels``, one directory per key (a digest of the source, the flags,
torch's and Python's versions and the machine), so an edit or an upgrade builds a new one. Each
(decode row, KV head) is one task of ``at::parallel_for``: the row's query heads that read that
KV head walk its block table, block by block, with an online softmax in float32. The flags are
plain ``-O3 -fopenmp``: the AVX-512 kernel is a function compiled for that target and chosen at
run time (``__builtin_cpu_supports``), so the build runs on any x86 CPU (and elsewhere the
portable loop).

Why not torch's own cache: it guards a build with a lock *file* that its holder deletes when it
is done, and a process killed while holding it (an engine SIGKILLed during start-up, a build
interrupted) leaves the file behind, after which every later ``load`` waits for it forever, the
engine's start and ``make test`` with it. Here a built kernel is imported straight from its
file with no lock at all, and a build is serialized by ``flock`` on a lock file, which the kernel
releases when its holder dies; the build goes to a fresh directory renamed into place when
complete, so a half-built one is never seen. Waiting for another process's build is bounded
(``BUILD_WAIT_S``), after which the engine takes its torch path.

``load()`` returns the module or None (compile failed, no compiler, not built for this platform,
the wait ran out); the failure is logged once and the engine keeps its torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import torch

from serving.native import acquire, cache_root, import_file

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
NAME = "dpmesh_paged_decode"
DTYPES = (torch.float32, torch.bfloat16)
CFLAGS = ("-O3", "-fopenmp")
BUILD_WAIT_S = 600.0  # the longest a process waits for another's build of the same kernel
_lock = threading.Lock()
_state: dict[str, object] = {}  # "module" (None when it failed), "error"


def build_key() -> str:
    """What a built kernel depends on: the source, the flags, torch, Python and the machine."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (*CFLAGS, torch.__version__, sys.version, platform.machine()):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def _build(root: Path, target: Path):
    """Compile into a fresh directory under ``root`` and rename it to ``target`` once whole."""
    from torch.utils.cpp_extension import load as load_extension

    # the caller holds the lock: scratch directories left here are from killed builds, and a
    # target without its .so was emptied by hand
    for left in root.glob(f".{target.name}-*"):
        shutil.rmtree(left, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        module = load_extension(
            name=NAME,
            sources=[str(SOURCE)],
            extra_cflags=list(CFLAGS),
            build_directory=str(scratch),
            verbose=False,
        )
        os.rename(scratch, target)
        return module
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # gone already when the rename happened


def load():
    """The compiled extension (built on first call, imported from the cache after), or None."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        module = None
        try:
            if os.environ.get("DPMESH_DISABLE_CPP_KERNEL"):
                raise RuntimeError("DPMESH_DISABLE_CPP_KERNEL is set")
            root = cache_root()
            target = root / f"{NAME}-{build_key()}"
            built = target / f"{NAME}.so"
            if built.exists():
                module = import_file(NAME, built)
            else:
                root.mkdir(parents=True, exist_ok=True)
                fd = acquire(root / f"{target.name}.lock", BUILD_WAIT_S)
                try:  # another process may have built it while this one waited
                    module = import_file(NAME, built) if built.exists() else _build(root, target)
                finally:
                    os.close(fd)
        except Exception as exc:  # compiler missing, build error, unsupported platform, wait
            _state["error"] = f"{type(exc).__name__}: {str(exc).strip()[-2000:]}"
            logger.warning("paged decode kernel unavailable: %s", _state["error"])
        _state["module"] = module
        return module


def error() -> str | None:
    """Why ``load()`` returned None (after it did)."""
    return _state.get("error")  # type: ignore[return-value]


def paged_decode(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the decode queries ``q`` [B, H, D] (last dim contiguous, any other strides)
    over the first ``context_lens[b]`` (int32 [B]) tokens of the blocks ``block_tables[b]``
    (int32 [B, W]) of ``k_blocks`` / ``v_blocks`` [KVH, num_blocks, block_size, D]; query head h
    reads KV head h // (H / KVH). Writes ``out`` [B, H, D] when given; returns the result."""
    module = load()
    if module is None:
        raise RuntimeError(f"paged decode kernel unavailable: {error()}")
    return module.paged_decode(q, k_blocks, v_blocks, block_tables, context_lens, scale, out)


def main() -> int:
    """``python -m engine.paged_kernel``: build the kernel now (``make serve`` and ``make test``
    do, so the first engine does not spend its start compiling); says which path engines take."""
    logging.basicConfig(level=logging.WARNING)
    if load() is None:
        print(f"paged decode kernel: unavailable, engines use the torch path ({error()})")
    else:
        print("paged decode kernel: built (engines' --attention-impl auto takes it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
