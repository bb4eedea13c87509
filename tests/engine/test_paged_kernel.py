"""The cpp paged decode kernel (engine/paged_kernel.py) against a float64 gather + softmax
reference, and the engine's greedy tokens with it against the torch attention path."""

import random
import shutil

import pytest
import torch

from engine import model_runner, paged_kernel
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import _in_ci


@pytest.fixture(scope="module")
def kernel():
    """The extension, compiled once (then imported from ~/.cache/dpmesh/kernels)."""
    module = paged_kernel.load()
    if module is None:
        # a laptop without a compiler runs the torch path only; CI has one (the build is part
        # of the contract there, as the services are)
        if shutil.which("c++") is None and shutil.which("g++") is None and not _in_ci():
            pytest.skip(f"no C++ compiler: {paged_kernel.error()}")
        pytest.fail(f"the kernel did not build: {paged_kernel.error()}")
    return module


def reference(q, k_blocks, v_blocks, tables, lens, scale):
    """Gather each row's blocks, trim to its length, softmax attention in float64."""
    batch, heads, dim = q.shape
    kv_heads, _, block_size, _ = k_blocks.shape
    group = heads // kv_heads
    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        ids = tables[b, : (n + block_size - 1) // block_size].long()
        k = k_blocks[:, ids].reshape(kv_heads, -1, dim)[:, :n].double()
        v = v_blocks[:, ids].reshape(kv_heads, -1, dim)[:, :n].double()
        for h in range(heads):
            weights = torch.softmax(q[b, h].double() @ k[h // group].T * scale, -1)
            out[b, h] = weights @ v[h // group]
    return out


def random_case(seed, dtype, heads, kv_heads, dim, block_size, batch=7, blocks=64, width=9):
    g = torch.Generator().manual_seed(seed)
    k_blocks = torch.randn(kv_heads, blocks, block_size, dim, generator=g).to(dtype)
    v_blocks = torch.randn(kv_heads, blocks, block_size, dim, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(batch)])
    tables[1::2, :4] = tables[0, :4]  # some rows share a prefix, as cached ones do
    lens = torch.randint(1, width * block_size + 1, (batch,), generator=g)
    lens[0] = width * block_size  # one row fills its table
    lens[1] = 1
    # the engine's q: [B, H, D] rows of a wider fused projection (strided, last dim contiguous)
    qkv = torch.randn(batch, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    return qkv[:, :heads], k_blocks, v_blocks, tables.int(), lens.int()


CASES = [  # heads, kv heads, head_dim, block_size
    (8, 4, 32, 16),  # the tiny model
    (8, 8, 32, 16),
    (8, 1, 64, 16),
    (16, 2, 128, 16),
    (4, 4, 16, 5),  # blocks not a multiple of 16 tokens
    (6, 2, 24, 16),  # the portable loop: head_dim 24, three heads per KV head
    (8, 4, 32, 40),
]


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), CASES)
def test_kernel_matches_reference(kernel, dtype, atol, heads, kv_heads, dim, block_size):
    for seed in range(3):
        q, kb, vb, tables, lens = random_case(seed, dtype, heads, kv_heads, dim, block_size)
        scale = dim**-0.5
        expected = reference(q, kb, vb, tables, lens, scale)
        got = paged_kernel.paged_decode(q, kb, vb, tables, lens, scale)
        assert got.dtype == dtype and got.shape == q.shape
        assert (got.double() - expected).abs().max().item() <= atol
        out = torch.full((q.shape[0] + 2, heads, dim), float("nan"), dtype=dtype)
        paged_kernel.paged_decode(q, kb, vb, tables, lens, scale, out[1:-1])  # in place
        assert torch.equal(out[1:-1], got) and out[0].isnan().all() and out[-1].isnan().all()


def test_kernel_rejects_bad_inputs(kernel):
    q, kb, vb, tables, lens = random_case(0, torch.float32, 8, 4, 32, 16)
    with pytest.raises(RuntimeError, match="int32"):
        paged_kernel.paged_decode(q, kb, vb, tables.long(), lens, 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        paged_kernel.paged_decode(q, kb, vb, tables, lens + 1000, 1.0)
    bad = tables.clone()
    bad[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="out of range"):
        paged_kernel.paged_decode(q, kb, vb, bad, lens, 1.0)


def make_engine(**kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 512)
    return LLMEngine(EngineConfig(model="tiny", block_size=16, **kw))


def _generate(attention_impl: str, dtype: str = "float32"):
    rng = random.Random(9)

    def prompt(n):
        return [rng.randrange(8, 4000) for _ in range(n)]

    system, preamble = prompt(200), prompt(90)
    engine = make_engine(attention_impl=attention_impl, dtype=dtype, max_num_batched_tokens=64)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    engine.generate([system + prompt(3), preamble + prompt(2)], greedy)  # prefixes cached
    prompts = [system + prompt(n) for n in (1, 9, 33, 70)]
    prompts += [preamble + prompt(n) for n in (5, 40)] + [prompt(120), prompt(1)]
    # chunked prefill (64 tokens a step) mixes prefill chunks and decodes in steps
    outs = engine.generate(prompts, greedy)
    engine.block_manager.check_integrity([])
    return engine, [o["token_ids"] for o in outs], [o["num_cached_tokens"] for o in outs]


def test_engine_greedy_tokens_equal_the_torch_path(kernel):
    engine, tokens, cached = _generate("cpp")
    assert engine.runner.attention_impl == "cpp"
    ref_engine, ref_tokens, ref_cached = _generate("torch")
    assert ref_engine.runner.attention_impl == "torch"
    assert cached == ref_cached and cached[0] == 192
    assert tokens == ref_tokens


def test_engine_runs_the_kernel_in_bfloat16(kernel):
    engine, tokens, _ = _generate("auto", "bfloat16")
    assert engine.runner.attention_impl == "cpp"
    assert [len(t) for t in tokens] == [24] * 8


def test_auto_falls_back_to_torch_and_cpp_requires_the_kernel(monkeypatch):
    monkeypatch.setattr(paged_kernel, "load", lambda: None)
    engine = make_engine(num_kv_blocks=8)
    assert engine.runner.attention_impl == "torch" and engine.runner.decode_kernel is None
    with pytest.raises(ValueError, match="attention_impl='cpp'"):
        make_engine(num_kv_blocks=8, attention_impl="cpp")
    forced = make_engine(num_kv_blocks=8, attention_impl="torch")
    assert forced.runner.attention_impl == "torch"
    assert model_runner.paged_kernel is paged_kernel


def test_attention_impl_flag_and_validation():
    import argparse

    from engine.server import main

    with pytest.raises(ValueError, match="attention_impl"):
        EngineConfig(attention_impl="triton")
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    assert main.engine_config(parser.parse_args(["--device", "cpu"]), "tiny").attention_impl == (
        "auto"
    )
    args = parser.parse_args(["--attention-impl", "torch", "--device", "cpu"])
    assert main.engine_config(args, "tiny").attention_impl == "torch"


def test_a_build_lock_dies_with_its_holder(tmp_path):
    """A process killed while it builds leaves no lock behind (torch's lock file did, and every
    later build, ``make test`` and engine starts waited on it forever)."""
    import signal
    import subprocess
    import sys

    lock = tmp_path / "k.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from engine.paged_kernel import acquire; "
            f"acquire(__import__('pathlib').Path({str(lock)!r}), 5); print('held', flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TimeoutError, match="building the kernel"):
            paged_kernel.acquire(lock, 0.5)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        fd = paged_kernel.acquire(lock, 5)  # the kernel released the dead holder's lock
        import os

        os.close(fd)
    finally:
        holder.kill()
        holder.wait()


def test_a_built_kernel_is_imported_without_the_build_lock(kernel):
    """Engines start by importing the built file: a build lock held elsewhere does not stop them."""
    import os
    import subprocess
    import sys

    root = paged_kernel.cache_root()
    name = f"{paged_kernel.NAME}-{paged_kernel.build_key()}"
    assert (root / name / f"{paged_kernel.NAME}.so").exists()
    fd = paged_kernel.acquire(root / f"{name}.lock", 30)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "engine.paged_kernel"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
    finally:
        os.close(fd)
    assert done.returncode == 0 and "built" in done.stdout, done.stdout + done.stderr
