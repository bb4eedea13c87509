"""For the LoRA tests: the reference, transformers' own tiny Llama with an adapter merged into its
weights (``W + scaling * B @ A``, as PEFT's ``merge_and_unload`` does), generating greedily (the
engine never merges: it adds the low-rank deltas per row, engine/lora_layers.py, so equal greedy
ids show the two are the same function); and ``write_adapter`` for adapters made by hand."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.lora import WEIGHTS_FILE, read_adapter_config
from engine.tiny import ensure_tiny_model


def merged_model(adapter: str | Path | None):
    """The tiny model in float32, with ``adapter``'s deltas merged in (None: the base model)."""
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32).eval()
    if adapter is None:
        return model
    config = read_adapter_config(adapter, max_rank=64)
    tensors = load_file(str(Path(adapter) / WEIGHTS_FILE))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." in key:
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
                params[name] += config.scaling * (b @ a)
    return model


class Reference:
    """Greedy continuations of the base model and of each merged adapter, memoised."""

    def __init__(self, adapters: dict[str | None, str | Path | None]):
        self.models = {name: merged_model(path) for name, path in adapters.items()}
        self.memo: dict = {}

    def __call__(self, name: str | None, prompt: list[int], max_tokens: int) -> list[int]:
        key = (name, tuple(prompt), max_tokens)
        if key not in self.memo:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = self.models[name].generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                )
            self.memo[key] = out[0, len(prompt) :].tolist()
        return self.memo[key]


def write_adapter(path: Path, tensors: dict, **config) -> str:
    """A PEFT adapter directory at ``path`` with ``tensors`` and a rank-2 config (``config``
    overrides its fields)."""
    path.mkdir(exist_ok=True)
    raw = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none",
           "target_modules": ["q_proj"], **config}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(raw))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)
