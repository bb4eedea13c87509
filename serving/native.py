"""Native extensions built at first use into a cache of our own, shared by the engine's paged
decode kernel (engine/paged_kernel.py) and the router's prefix index core
(apps/routing/decision/index.py, with the digests and cache_aware's costs).

Built modules live under ``DPMESH_KERNEL_CACHE`` (default ``~/.cache/dpmesh/kernels``), one
directory per key (a digest of what the build depends on), so an edit or an upgrade builds a new
one. A built module is imported straight from its file with no lock; a build is serialized by
``flock`` on a lock file, which the kernel releases when its holder dies (a lock *file* that its
holder deletes, as torch's cache uses, outlives a killed holder and stalls every later build);
the build goes to a fresh directory renamed into place when complete, so a half-built one is
never seen.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """Where built modules live (``DPMESH_KERNEL_CACHE``, default ``~/.cache/dpmesh/kernels``)."""
    configured = os.environ.get("DPMESH_KERNEL_CACHE")
    if configured:
        return Path(configured)
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "dpmesh" / "kernels"


def import_file(name: str, path: Path):
    """The extension module ``name`` from its built file."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def acquire(lock_path: Path, wait_s: float) -> int:
    """An exclusive ``flock`` on ``lock_path`` (its fd; closing it releases), waiting at most
    ``wait_s``; TimeoutError past that. The kernel drops the lock when its holder exits, killed
    or not, so no lock outlives its process."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise TimeoutError(
                    f"another process has been building the kernel {lock_path.stem} for "
                    f"{wait_s:.0f} s (it holds {lock_path})"
                ) from None
            time.sleep(0.2)


def cached_build(name: str, key: str, build: Callable[[Path], Path], wait_s: float) -> Path:
    """The built file of ``name`` for ``key`` in the cache: built by ``build(scratch)`` (which
    writes it into the fresh directory ``scratch`` and returns its path there) when absent, under
    the lock, then renamed into place."""
    root = cache_root()
    target = root / f"{name}-{key}"
    built = target / f"{name}.so"
    if built.exists():
        return built
    root.mkdir(parents=True, exist_ok=True)
    fd = acquire(root / f"{target.name}.lock", wait_s)
    try:
        if built.exists():  # another process built it while this one waited
            return built
        # the lock is held: scratch directories left here are from killed builds, and a target
        # without its file was emptied by hand
        for left in root.glob(f".{target.name}-*"):
            shutil.rmtree(left, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        try:
            made = build(scratch)
            if made != scratch / f"{name}.so":
                os.replace(made, scratch / f"{name}.so")
            os.rename(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # gone already when the rename happened
        return built
    finally:
        os.close(fd)
