"""The native Llama forward pass (engine.native_llama) against transformers' modules.

The tiny model must take the native path (these tests fail if it silently falls back); on a step
mix of prefills, prefix-cache hits, chunked prefill and cascade decodes the native path samples
the tokens the transformers path samples, from the same logits; a model the native path does not
take still runs, through transformers, token-exact; Mistral (no sliding window) and Qwen2 models
take the native path and match transformers' own ``generate``.
"""

import random
import shutil

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import engine.model_runner as model_runner
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.native_llama import NativeLlama
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.tiny import ensure_tiny_model

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(8, 4000) for _ in range(length)]


def make_engine(**kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    return LLMEngine(EngineConfig(block_size=16, **kw))


def greedy_reference(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
            outs.append(out[0, len(prompt) :].tolist())
    return outs


def save_variant(model, tmp_path) -> str:
    """``model`` saved as a model directory with the tiny model's tokenizer."""
    model.save_pretrained(tmp_path)
    tiny = ensure_tiny_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, tmp_path / name)
    return str(tmp_path)


def test_tiny_llama_takes_the_native_path():
    engine = make_engine(num_kv_blocks=4)
    assert engine.runner.model_impl == "native"
    assert isinstance(engine.runner.native, NativeLlama)
    forced = make_engine(num_kv_blocks=4, model_impl="transformers")
    assert forced.runner.model_impl == "transformers" and forced.runner.native is None
    # one copy of the weights: the transformers modules see rows of the fused tensors
    layer, native = engine.runner.model.model.layers[0], engine.runner.native.layers[0]
    assert layer.self_attn.k_proj.weight.untyped_storage().data_ptr() == (
        native.qkv.untyped_storage().data_ptr()
    )
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == (
        native.gate_up.untyped_storage().data_ptr()
    )


def _run_mixed(model_impl: str, dtype: str, monkeypatch) -> tuple[list, list, LLMEngine]:
    """Prefix-cache hits, chunked prefill, cascade decodes and a lone prompt in one engine;
    returns the outputs and every sampled step's logits."""
    logits = []

    def recording_sample(step_logits, seqs, generator):
        logits.append(step_logits.clone())
        return sample(step_logits, seqs, generator)

    monkeypatch.setattr(model_runner, "sample", recording_sample)
    rng = random.Random(7)
    system = random_prompt(rng, 100)
    engine = make_engine(model_impl=model_impl, dtype=dtype, max_num_batched_tokens=64)
    engine.generate([system + random_prompt(rng, 3)], GREEDY)  # the shared prefix is cached
    prompts = [system + random_prompt(rng, n) for n in (1, 9, 40)] + [random_prompt(rng, 70)]
    before = engine.runner.cascade_steps
    outs = engine.generate(prompts, GREEDY)
    assert engine.runner.cascade_steps - before >= MAX_TOKENS - 2
    assert [o["num_cached_tokens"] for o in outs] == [96, 96, 96, 0]
    return outs, logits, engine


# The native path runs transformers' ops in transformers' order, so on most of this project's
# CPUs the logits agree bit for bit in both dtypes; the tolerances leave room for a BLAS that sums
# a fused matmul's rows in another order (seen 2026-12-03 on one AMD EPYC machine: 1.01e-5 in
# fp32, greedy tokens still equal). A wrong op moves logits by far more than either.
@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-4), ("bfloat16", 2**-6)])
def test_native_matches_transformers_on_a_mixed_batch(dtype, atol, monkeypatch):
    native_outs, native_logits, engine = _run_mixed("auto", dtype, monkeypatch)
    assert engine.runner.model_impl == "native"
    ref_outs, ref_logits, _ = _run_mixed("transformers", dtype, monkeypatch)
    assert len(native_logits) == len(ref_logits)
    worst = max((a - b).abs().max().item() for a, b in zip(native_logits, ref_logits, strict=True))
    assert worst <= atol
    if dtype == "float32":  # bf16 greedy ties may flip (see tests/engine/test_exactness_bf16.py)
        assert [o["token_ids"] for o in native_outs] == [o["token_ids"] for o in ref_outs]


def test_unsupported_model_falls_back_to_transformers(tmp_path):
    """Linear RoPE scaling is not the native path's: the engine runs transformers' modules and
    still matches transformers' ``generate``; asking for the native path is an error."""
    tiny = ensure_tiny_model()
    config = AutoConfig.from_pretrained(tiny)
    config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    model_dir = save_variant(AutoModelForCausalLM.from_pretrained(tiny, config=config), tmp_path)
    engine = make_engine(model=model_dir)
    assert engine.runner.model_impl == "transformers" and engine.runner.native is None
    rng = random.Random(3)
    prompts = [random_prompt(rng, n) for n in (5, 40)]
    outs = engine.generate(prompts, GREEDY)
    assert [o["token_ids"] for o in outs] == greedy_reference(model_dir, prompts)
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        make_engine(model=model_dir, num_kv_blocks=4, model_impl="native")


@pytest.mark.parametrize(
    ("config_class", "model_class"),
    [(MistralConfig, MistralForCausalLM), (Qwen2Config, Qwen2ForCausalLM)],
)
def test_other_llama_architectures_take_the_native_path(config_class, model_class, tmp_path):
    """Mistral without a sliding window, and Qwen2 (q/k/v biases: random here, so they count),
    built from the tiny Llama's weights: native, and token-exact against ``generate``."""
    llama = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32)
    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
    config = config_class(
        **{k: getattr(llama.config, k) for k in keys},
        sliding_window=None,
        tie_word_embeddings=False,
    )
    model = model_class(config)
    missing = model.load_state_dict(llama.state_dict(), strict=False).missing_keys
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name in missing:  # Qwen2's q/k/v biases
            assert name.endswith("_proj.bias"), name
            bias = model.get_parameter(name)
            bias.copy_(torch.randn(bias.shape, generator=generator) * 0.08)
    model_dir = save_variant(model, tmp_path)
    engine = make_engine(model=model_dir, model_impl="native")
    assert engine.runner.model_impl == "native"
    rng = random.Random(4)
    prompts = [random_prompt(rng, n) for n in (3, 33)]
    outs = engine.generate(prompts, GREEDY)
    assert [o["token_ids"] for o in outs] == greedy_reference(model_dir, prompts)


def test_model_impl_flag_and_validation():
    import argparse

    from engine.server import main

    with pytest.raises(ValueError, match="model_impl"):
        EngineConfig(model_impl="vllm")
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    assert main.engine_config(parser.parse_args(["--device", "cpu"]), "tiny").model_impl == "auto"
    args = parser.parse_args(["--model-impl", "transformers", "--device", "cpu"])
    assert main.engine_config(args, "tiny").model_impl == "transformers"
