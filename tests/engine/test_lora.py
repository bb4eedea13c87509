"""LoRA adapters in the engine (vLLM's semantics), in process: greedy ids with an adapter equal
transformers' on the merged weights, a batch mixing adapters and the base model gives each what
it gets alone, an adapter's prefix-cache blocks are its own, and a bad adapter is refused with a
message that names the problem. The server's side is tests/engine/test_lora_server.py."""

from __future__ import annotations

import argparse
import json
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.digests import namespace
from engine.llm_engine import LLMEngine
from engine.lora import LoRAModulePath, parse_lora_module, read_adapter_config
from engine.lora_layers import load_adapter
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.server.flags import add_arguments, engine_config
from engine.server.main import check_lora_modules
from engine.tiny_lora import build_tiny_adapter, ensure_tiny_adapter
from tests.engine.lora_reference import Reference, write_adapter

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters() -> dict[str, str]:
    return {"one": str(ensure_tiny_adapter(1)), "two": str(ensure_tiny_adapter(2))}


@pytest.fixture(scope="module")
def engine(adapters):
    modules = tuple(LoRAModulePath(name, path) for name, path in adapters.items())
    return LLMEngine(EngineConfig(model="tiny", num_kv_blocks=256, lora_modules=modules))


@pytest.fixture(scope="module")
def reference(adapters):
    return Reference({None: None, **adapters})


def prompts(seed: int, *lengths: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 4000) for _ in range(n)] for n in lengths]


def greedy(name: str | None, max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, lora_name=name, **kw)


def test_an_adapter_is_the_merged_model_and_not_the_base(engine, reference):
    for prompt in prompts(1, 6, 70):
        got = engine.generate([prompt], greedy("one"))[0]["token_ids"]
        assert got == reference("one", prompt, MAX_TOKENS)
        assert got != reference(None, prompt, MAX_TOKENS)  # so this test can fail
    engine.block_manager.check_integrity()


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(engine, reference):
    """Base, adapter one and adapter two in the same steps (prefills and decodes together)."""
    batch = prompts(2, 9, 33, 17, 50)
    names = [None, "one", "two", "one"]
    together = engine.generate(batch, [greedy(n) for n in names])
    assert engine.runner.adapters.keys() == {"one", "two"}
    for prompt, name, out in zip(batch, names, together, strict=True):
        alone = engine.generate([prompt], greedy(name))[0]
        assert out["token_ids"] == alone["token_ids"] == reference(name, prompt, MAX_TOKENS)
    assert len({tuple(o["token_ids"]) for o in together}) == len(batch)


def cached(engine, prompt, name, salt=None) -> int:
    return engine.generate([prompt], greedy(name, 1, cache_salt=salt))[0]["num_cached_tokens"]


def test_an_adapters_prefix_blocks_are_its_own(engine):
    (prompt,) = prompts(3, 5 * 16 + 3)
    assert cached(engine, prompt, "one") == 0
    assert cached(engine, prompt, "one") == 5 * 16  # the same adapter shares its blocks
    assert cached(engine, prompt, "two") == 0  # another adapter's KV is not this one's
    assert cached(engine, prompt, None) == 0  # nor is the base model's
    assert cached(engine, prompt, "one", salt="t") == 0  # a tenant of adapter one: its own
    assert cached(engine, prompt, "one", salt="t") == 5 * 16
    assert cached(engine, prompt, None, salt="t") == 0
    assert cached(engine, prompt, "two") == 5 * 16
    seq = Sequence(prompt, greedy("one", cache_salt="t"), block_size=16)
    assert seq.namespace == namespace("t", "one") != namespace("t") != namespace(None, "one")
    engine.block_manager.check_integrity()


def test_the_engine_refuses_an_adapter_it_has_not_loaded(engine):
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        engine.add_request("unknown-adapter", [10, 11], greedy("nope"))
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="lora_name"):
        SamplingParams(lora_name="")


def test_transformers_forward_pass_refuses_adapters(adapters):
    module = LoRAModulePath("one", adapters["one"])
    config = EngineConfig(model="tiny", num_kv_blocks=8, model_impl="transformers",
                          lora_modules=(module,))  # fmt: skip
    with pytest.raises(ValueError, match="need the native forward pass"):
        LLMEngine(config)


def test_tiny_adapters_are_deterministic_and_differ_by_seed(tmp_path, adapters):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    build_tiny_adapter(tmp_path / "a", seed=1)
    build_tiny_adapter(tmp_path / "b", seed=2)
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        built = (tmp_path / "a" / file).read_bytes()
        assert built == (ensure_tiny_adapter(1) / file).read_bytes()
    assert (tmp_path / "a" / "adapter_model.safetensors").read_bytes() != (
        tmp_path / "b" / "adapter_model.safetensors"
    ).read_bytes()
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16


# ----- loading: the fused layout, and what is refused ------------------------------------------
def test_a_partial_adapter_fills_only_its_modules_columns_of_the_fused_projection(engine, tmp_path):
    """q and v adapted, k not (a zero block), rsLoRA scaling: the fused delta of layer 0 is
    ``scaling * x @ (B @ A).T`` in q's and v's columns and zero in k's."""
    build_tiny_adapter(tmp_path, seed=5, rank=4, alpha=8, targets=("q_proj", "v_proj"),
                       use_rslora=True)  # fmt: skip
    config = read_adapter_config(tmp_path)
    assert config.scaling == 8 / 2  # alpha / sqrt(r)
    model = engine.runner.model
    adapter = load_adapter(LoRAModulePath("qv", str(tmp_path)), model, 16, torch.float32,
                           torch.device("cpu"))  # fmt: skip
    assert set(adapter.layers[0]) == {"qkv"}
    tensors = load_file(config.weights_path)
    x = torch.randn(3, model.config.hidden_size)
    weights = adapter.layers[0]["qkv"]
    got = F.linear(F.linear(x, weights.a), weights.b)
    attn = model.model.layers[0].self_attn
    q, k = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    prefix = "base_model.model.model.layers.0.self_attn"

    def delta(module):
        a, b = (tensors[f"{prefix}.{module}.lora_{h}.weight"] for h in "AB")
        return config.scaling * x @ (b @ a).T

    torch.testing.assert_close(got[:, :q], delta("q_proj"))
    assert not got[:, q : q + k].any()
    torch.testing.assert_close(got[:, q + k :], delta("v_proj"))


Q = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
GOOD = {Q.format(0, "A"): torch.zeros(2, 256), Q.format(0, "B"): torch.zeros(256, 2)}
BAD_WEIGHTS = [
    ({Q.format(6, "A"): torch.zeros(2, 256), Q.format(6, "B"): torch.zeros(256, 2)},
     "layer 6; the model has 6 layers"),
    ({Q.format(0, "A"): torch.zeros(2, 128), Q.format(0, "B"): torch.zeros(256, 2)},
     r"lora_A is \[2, 128\]"),
    ({Q.format(0, "A"): torch.zeros(2, 256), Q.format(0, "B"): torch.zeros(512, 2)},
     r"lora_B is \[512, 2\]"),
    ({Q.format(0, "A"): torch.zeros(2, 256)}, "not both lora_A and lora_B"),
    ({**GOOD, "base_model.model.lm_head.lora_A.weight": torch.zeros(2, 256)}, "unexpected tensor"),
]  # fmt: skip


@pytest.mark.parametrize(("tensors", "message"), BAD_WEIGHTS)
def test_weights_that_do_not_fit_the_model_are_refused(engine, tmp_path, tensors, message):
    path = write_adapter(tmp_path / "bad", tensors)
    with pytest.raises(ValueError, match=message):
        load_adapter(LoRAModulePath("bad", path), engine.runner.model, 16, torch.float32,
                     torch.device("cpu"))  # fmt: skip


BAD_CONFIGS = [
    ({"r": 32}, "LoRA rank 32 is greater than max_lora_rank 16"),
    ({"peft_type": "IA3"}, "peft_type must be 'LORA'"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"target modules \['lm_head'\]"),
    ({"bias": "all"}, "bias 'all'"),
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
]


@pytest.mark.parametrize(("config", "message"), BAD_CONFIGS)
def test_configs_this_engine_would_serve_wrongly_are_refused(tmp_path, config, message):
    path = write_adapter(tmp_path / "bad", GOOD, **config)
    with pytest.raises(ValueError, match=message):
        read_adapter_config(path, max_rank=16)


def test_a_directory_without_an_adapter_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        read_adapter_config(tmp_path)


def test_lora_modules_spellings():
    assert parse_lora_module("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert parse_lora_module("x=/p=q") == LoRAModulePath("x", "/p=q")
    spelled = '{"name": "sql", "path": "/a/b", "base_model_name": "base"}'
    assert parse_lora_module(spelled) == LoRAModulePath("sql", "/a/b", "base")
    unknown_field = '{"name": "x", "path": "/p", "rank": 8}'
    for bad in ("sql", "=/a", "sql=", "{not json", '{"name": "x"}', unknown_field, "[1]"):
        with pytest.raises(ValueError):
            parse_lora_module(bad)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-lora-rank", "4"], "LoRA rank 8 is greater than max_lora_rank 4"),
        (["--model-impl", "transformers"], "needs the native forward pass"),
        (["--served-model-name", "one"], "'one' is the base model's name"),
    ],
)
def test_the_front_refuses_adapters_no_rank_could_serve(adapters, flags, message):
    """Checked before any rank starts (engine/server/main.py), from the flags alone."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--lora-modules", f"one={adapters['one']}", *flags])
    with pytest.raises(SystemExit, match=message):
        check_lora_modules(args)
    twice = parser.parse_args(["--lora-modules", f"one={adapters['one']}", "one=/elsewhere"])
    with pytest.raises(SystemExit, match="'one' is given twice"):
        check_lora_modules(twice)
    config = engine_config(parser.parse_args(["--lora-modules", f"one={adapters['one']}"]), "m")
    assert config.lora_modules == (LoRAModulePath("one", adapters["one"]),)
