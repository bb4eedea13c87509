"""Tests for the built-in tiny model (engine/tiny.py): build, determinism, loading, concurrency."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import tiny

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR_NAME = f"tiny-llama-{tiny.TINY_MODEL_VERSION}"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """One build shared by the read-only tests of this module (a build takes a few seconds)."""
    return tiny.ensure_tiny_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def loaded(built):
    """(tokenizer, model) loaded through the Auto* classes, as the engine loads any model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(built), AutoModelForCausalLM.from_pretrained(built).eval()


def _file_bytes(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


# --- build output ------------------------------------------------------------------------------


def test_layout(built):
    assert built.name == MODEL_DIR_NAME
    names = {p.name for p in built.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    # Nothing but the finished model and the lock file is left in the cache root.
    assert sorted(p.name for p in built.parent.iterdir()) == sorted(
        [MODEL_DIR_NAME, f".tiny-llama-{tiny.TINY_MODEL_VERSION}.lock"]
    )


@pytest.mark.slow
def test_build_is_deterministic(built, tmp_path):
    tiny.build_tiny_model(tmp_path)
    again = _file_bytes(tmp_path)
    first = _file_bytes(built)
    assert again["model.safetensors"] == first["model.safetensors"]
    assert again["tokenizer.json"] == first["tokenizer.json"]
    assert again == first  # configs too


def test_config(built):
    cfg = json.loads((built / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["vocab_size"] == 4096
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (256, 6, 768)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (8, 4)
    assert cfg["max_position_embeddings"] == 32768
    assert cfg["tie_word_embeddings"] is False
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (0, 2, 3)
    gen = json.loads((built / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]  # <|im_end|>, <|endoftext|>
    assert gen.get("do_sample", False) is False
    assert "repetition_penalty" not in gen


def test_model_params_and_weights(loaded):
    import torch

    tok, model = loaded
    assert model.dtype == torch.float32
    n_params = sum(p.numel() for p in model.parameters())
    assert 5_000_000 <= n_params <= 8_000_000
    assert model.config.vocab_size == len(tok) == 4096
    sd = model.state_dict()
    assert torch.equal(sd["model.norm.weight"], torch.ones(256))
    assert abs(sd["lm_head.weight"].std().item() - tiny.WEIGHT_STD) < 0.005
    assert not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])


def test_greedy_margins_are_wide(loaded):
    """Guards the reason for WEIGHT_STD: typical top-1/top-2 logit gaps dwarf float32 noise."""
    import torch

    _, model = loaded
    ids = torch.randint(4, 4096, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        top2 = model(ids).logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert gaps.median().item() > 0.1


# --- tokenizer -----------------------------------------------------------------------------------


def test_special_tokens(loaded):
    tok, _ = loaded
    assert tok.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    ) == [0, 1, 2, 3]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|endoftext|>",
        "<|im_end|>",
        "<|pad|>",
    )
    # Special tokens in text are single ids, not split into bytes.
    assert tok.encode("<|im_start|>user") == [1] + tok.encode("user")


def test_no_automatic_bos(loaded):
    tok, _ = loaded
    text = "The assert statement, in plain words."
    ids = tok(text).input_ids
    assert ids == tok.encode(text) == tok.backend_tokenizer.encode(text).ids
    assert tok.bos_token_id not in ids
    assert tok.decode(ids) == text


def test_decode_roundtrip_bytes(loaded):
    tok, _ = loaded
    for text in ["  leading spaces", "tabs\tand\nnewlines\n", "ünïcödé ✓ 日本語", "x" * 50]:
        assert tok.decode(tok.encode(text)) == text


def test_chat_template(loaded):
    tok, _ = loaded
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt == text[: -len("<|im_start|>assistant\n")]
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    assert list(ids) == tok.encode(text)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


# --- loading the way the engine does -----------------------------------------------------------

_OFFLINE_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path).eval()
ids = tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                              tokenize=True, return_dict=False)
prompt = torch.tensor([list(ids)])
out = model.generate(prompt, max_new_tokens=8, do_sample=False)
print(json.dumps({"cls": type(model).__name__, "new": out.shape[1] - prompt.shape[1]}))
"""


@pytest.mark.slow
def test_loads_offline_in_fresh_process(built):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", _OFFLINE_LOAD, str(built)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cls"] == "LlamaForCausalLM"
    assert 1 <= result["new"] <= 8


def test_cli_prints_path(built):
    proc = subprocess.run(
        [sys.executable, "-m", "engine.tiny", "--cache-dir", str(built.parent)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(built)


# --- cache handling ----------------------------------------------------------------------------


def _race_worker(cache_dir: str, barrier, results) -> None:
    barrier.wait()  # start every process's ensure at the same moment
    path, did_build = tiny._ensure(cache_dir)
    results.put((str(path), did_build))


@pytest.mark.slow
def test_concurrent_ensure_builds_once(built, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    # A temp dir as a killed builder would leave it: must be cleaned, never promoted.
    stale = cache / f".tiny-llama-{tiny.TINY_MODEL_VERSION}.tmp-dead"
    stale.mkdir()
    (stale / "config.json").write_text("{}")

    n = 4
    ctx = multiprocessing.get_context("spawn")  # no fork after torch has started threads
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=_race_worker, args=(str(cache), barrier, results)) for _ in range(n)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=300) for _ in range(n)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    assert {path for path, _ in outcomes} == {str(cache / MODEL_DIR_NAME)}
    assert sum(did_build for _, did_build in outcomes) == 1
    assert not stale.exists()
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [MODEL_DIR_NAME, f".tiny-llama-{tiny.TINY_MODEL_VERSION}.lock"]
    )
    # Built in another process, yet byte-identical to the in-process build.
    assert _file_bytes(cache / MODEL_DIR_NAME) == _file_bytes(built)


def test_existing_model_is_reused(built):
    before = (built / "model.safetensors").stat().st_mtime_ns
    path, did_build = tiny._ensure(built.parent)
    assert (path, did_build) == (built, False)
    assert (built / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_incomplete_final_dir_is_rebuilt(tmp_path):
    final = tmp_path / MODEL_DIR_NAME
    final.mkdir()
    (final / "config.json").write_text("{}")  # e.g. an interrupted manual copy
    path, did_build = tiny._ensure(tmp_path)
    assert path == final and did_build
    assert (final / "model.safetensors").is_file()


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DPMESH_CACHE_DIR", str(tmp_path))
    assert tiny.default_cache_dir() == tmp_path
    monkeypatch.delenv("DPMESH_CACHE_DIR")
    assert tiny.default_cache_dir() == Path.home() / ".cache" / "dpmesh"


# --- resolve_model_path ------------------------------------------------------------------------


def test_resolve_tiny_uses_cache_env(built, monkeypatch):
    monkeypatch.setenv("DPMESH_CACHE_DIR", str(built.parent))
    assert tiny.resolve_model_path("tiny") == str(built)


def test_resolve_local_dir_returned_as_is(built):
    assert tiny.resolve_model_path(str(built)) == str(built)


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.2-1B", "gpt2", "", "/no/such/dir"])
def test_resolve_rejects_non_local(name):
    with pytest.raises(ValueError, match="not supported|no config.json|local"):
        tiny.resolve_model_path(name)


def test_resolve_rejects_dir_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        tiny.resolve_model_path(str(tmp_path))
