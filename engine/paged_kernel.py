"""Single-token decode attention that reads the paged KV pool's blocks in place (no gather).

``engine/csrc/paged_decode.cpp`` is a small C++ torch extension, compiled with
``torch.utils.cpp_extension.load`` at first use and cached by torch (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``; the cache key covers the source and flags, so an edit
rebuilds it). Each (decode row, KV head) is one task of ``at::parallel_for``: the row's query
heads that read that KV head walk its block table, block by block, with an online softmax in
float32. The flags are plain ``-O3 -fopenmp``: the AVX-512 kernel is a function compiled for that
target and chosen at run time (``__builtin_cpu_supports``), so the build runs on any x86 CPU (and
elsewhere the portable loop).

``load()`` returns the module or None (compile failed, no compiler, not built for this platform);
the failure is logged once and the engine keeps its torch path.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
NAME = "dpmesh_paged_decode"
DTYPES = (torch.float32, torch.bfloat16)
_lock = threading.Lock()
_state: dict[str, object] = {}  # "module" (None when it failed), "error"


def load():
    """The compiled extension (built on first call, then torch's cache), or None."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        module = None
        try:
            from torch.utils.cpp_extension import load as load_extension

            if os.environ.get("DPMESH_DISABLE_CPP_KERNEL"):
                raise RuntimeError("DPMESH_DISABLE_CPP_KERNEL is set")
            module = load_extension(
                name=NAME,
                sources=[str(SOURCE)],
                extra_cflags=["-O3", "-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # compiler missing, build error, unsupported platform
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
