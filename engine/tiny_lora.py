"""LoRA adapters for the tiny model, built locally the way the tiny model is (``engine.tiny``).

``ensure_tiny_adapter(seed)`` returns a PEFT-format adapter directory (``adapter_config.json`` and
``adapter_model.safetensors`` with PEFT's tensor names) for the tiny model, building it on first use
into the cache directory under the tiny model's lock-and-rename (``engine.tiny.build_once``).
Different seeds give different adapters; the same seed gives the same bytes.

PEFT initialises B to zeros, which makes a fresh adapter a no-op; here A and B are both seeded
Gaussians (``LORA_STD``), so an adapter changes the model: with rank 8 and alpha 16 (scaling 2)
the added ``2 * B @ A`` has a std of about 0.03 per weight, beside the base weights' 0.08, enough
that greedy continuations differ from the base model's within a few tokens while the logits keep
the base model's scale (and its wide top-1 margins, so tests may compare greedy ids exactly).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from engine.lora import ATTENTION_MODULES, CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE
from engine.tiny import TINY_MODEL_VERSION, build_once

TINY_LORA_VERSION = "v1"  # bump whenever the output changes
LORA_RANK = 8
LORA_ALPHA = 16
LORA_STD = 0.06
DEFAULT_SEED = 1


def ensure_tiny_adapter(
    seed: int = DEFAULT_SEED, cache_dir: str | os.PathLike | None = None
) -> Path:
    """The directory of the tiny model's adapter number ``seed``, built first if missing: every
    linear of every decoder layer adapted, rank ``LORA_RANK``. Safe from many processes at once."""
    name = f"tiny-llama-{TINY_MODEL_VERSION}-lora-{TINY_LORA_VERSION}-seed{seed}"
    required = (CONFIG_FILE, WEIGHTS_FILE)
    build = lambda out: build_tiny_adapter(out, seed, cache_dir=cache_dir)  # noqa: E731
    return build_once(cache_dir, name, required, build)[0]


def build_tiny_adapter(
    out_dir: str | os.PathLike,
    seed: int = DEFAULT_SEED,
    *,
    rank: int = LORA_RANK,
    alpha: float = LORA_ALPHA,
    targets: tuple[str, ...] = TARGET_MODULES,
    use_rslora: bool = False,
    std: float = LORA_STD,
    cache_dir: str | os.PathLike | None = None,
) -> None:
    """Write an adapter into ``out_dir`` (which must exist); no locking, deterministic. Tests use
    the keywords for adapters of other shapes (a rank over the limit, some modules only);
    ``cache_dir``: where the tiny model is (its config gives the shapes)."""
    out = Path(out_dir)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": use_rslora,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_weights(out / WEIGHTS_FILE, _model_config(cache_dir), seed, rank, targets, std)


def _write_weights(path: Path, config, seed: int, rank: int, targets, std: float) -> None:
    """A and B of every targeted linear, drawn in a fixed order from one seeded generator, under
    PEFT's names: ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``,
    A ``[rank, in_features]``, B ``[out_features, rank]``."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in targets:
            out_features, in_features = _linear_shape(config, module)
            parent = "self_attn" if module in ATTENTION_MODULES else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            a = torch.randn((rank, in_features), generator=g) * std
            b = torch.randn((out_features, rank), generator=g) * std
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _model_config(cache_dir):
    from transformers import AutoConfig

    from engine.tiny import ensure_tiny_model

    return AutoConfig.from_pretrained(ensure_tiny_model(cache_dir))


def _linear_shape(config, module: str) -> tuple[int, int]:
    """(out_features, in_features) of a Llama decoder layer's ``module``."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    shapes = {
        "q_proj": (config.num_attention_heads * head_dim, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, config.num_attention_heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    return shapes[module]


def main(argv: list[str] | None = None) -> None:
    """``python -m engine.tiny_lora [--seed N] [--cache-dir DIR]``: build if needed, print the
    adapter's path (for ``runengine --lora-modules name=PATH``)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    print(ensure_tiny_adapter(args.seed, args.cache_dir))


if __name__ == "__main__":
    main()
