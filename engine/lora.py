"""LoRA adapters as vLLM serves them: what ``--lora-modules`` names, and a PEFT adapter's config.

A served adapter is a ``LoRAModulePath`` (vLLM's name and fields): the name a request puts in its
``model`` field, the PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``) and
optionally the base model's name that ``/v1/models`` reports as its ``parent``. ``--lora-modules``
takes vLLM's two spellings: ``name=path`` and the JSON object
``{"name": ..., "path": ..., "base_model_name": ...}``.

``read_adapter_config`` checks the config alone (no weights, no torch), so the front refuses a bad
adapter before it starts a rank; ``engine.lora_layers`` loads the weights, checks them against the
model and applies them in the forward pass. An adapter's name also keys its prefix-cache blocks
(``engine.digests.namespace``): its KV is not the base model's.

Arrows: imported by ``engine.config`` and the server glue; imports nothing of the engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_MAX_LORA_RANK = 16  # vLLM's default --max-lora-rank

# the linear layers an adapter may target: those of a Llama decoder layer
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's ``LoRAModulePath``)."""

    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self):
        for key in ("name", "path"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(f"a LoRA module's {key} must be a non-empty string, got {value!r}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"base_model_name must be a string, got {self.base_model_name!r}")


def parse_lora_module(text: str) -> LoRAModulePath:
    """``name=path`` or vLLM's JSON form; ValueError naming what is wrong."""
    if not text.lstrip().startswith("{"):
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"expected name=path or a JSON object, got {text!r}")
        return LoRAModulePath(name, path)
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON {text!r}: {exc}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    unknown = set(fields) - {"name", "path", "base_model_name"}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)} in {text!r}")
    return LoRAModulePath(fields.get("name"), fields.get("path"), fields.get("base_model_name"))


def check_names(modules: tuple[LoRAModulePath, ...], model_names: set[str]) -> None:
    """Adapter names must be unique and differ from the base model's names: a request's ``model``
    picks exactly one of them."""
    seen: set[str] = set()
    for module in modules:
        if module.name in seen:
            raise ValueError(f"LoRA adapter name {module.name!r} is given twice")
        if module.name in model_names:
            raise ValueError(f"LoRA adapter name {module.name!r} is the base model's name")
        seen.add(module.name)


@dataclass(frozen=True)
class AdapterConfig:
    """What the engine uses of a PEFT ``adapter_config.json``."""

    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str  # a list in the file, or PEFT's regex / "all-linear"

    @property
    def scaling(self) -> float:
        """PEFT's: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS_FILE


def read_adapter_config(path: str | Path, max_rank: int = DEFAULT_MAX_LORA_RANK) -> AdapterConfig:
    """The checked config of the PEFT LoRA adapter in directory ``path``. ValueError for anything
    this engine would serve wrongly: not LoRA, a rank over ``max_rank``, biases, DoRA, per-module
    ranks, extra trained modules, a target outside a decoder layer's linears, a missing file."""
    where = Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (where / name).is_file():
            raise ValueError(f"LoRA adapter {str(path)!r} has no {name}")
    try:
        raw = json.loads((where / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {str(path)!r}: unreadable {CONFIG_FILE}: {exc}") from None
    problem = _unsupported(raw, max_rank)
    if problem:
        raise ValueError(f"LoRA adapter {str(path)!r}: {problem}")
    targets = raw.get("target_modules")
    return AdapterConfig(
        where,
        raw["r"],
        float(raw.get("lora_alpha", 8)),  # PEFT's default alpha
        bool(raw.get("use_rslora", False)),
        targets if isinstance(targets, str) else tuple(targets),
    )


def _unsupported(raw, max_rank: int) -> str | None:
    """Why this engine cannot serve the adapter that ``raw`` configures; None when it can."""
    if not isinstance(raw, dict):
        return f"{CONFIG_FILE} must hold a JSON object"
    if raw.get("peft_type") != "LORA":
        return f"peft_type must be 'LORA', got {raw.get('peft_type')!r}"
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        return f"r must be a positive integer, got {rank!r}"
    if rank > max_rank:
        return f"LoRA rank {rank} is greater than max_lora_rank {max_rank} (--max-lora-rank)"
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        return f"lora_alpha must be a number, got {alpha!r}"
    if raw.get("bias", "none") != "none":
        return f"bias {raw['bias']!r} is not supported (only 'none')"
    for flag in ("fan_in_fan_out", "use_dora"):
        if raw.get(flag):
            return f"{flag} is not supported"
    for field in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if raw.get(field):
            return f"{field} is not supported (got {raw[field]!r})"
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        return None  # a regex or "all-linear": the weights' names say which modules are adapted
    if not isinstance(targets, list) or not targets:
        return f"target_modules must be a non-empty list or a string, got {targets!r}"
    others = [t for t in targets if t not in TARGET_MODULES]
    if others:
        return f"target modules {others} are not supported (only {', '.join(TARGET_MODULES)})"
    return None
