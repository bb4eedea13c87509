"""LoRA adapters in the native forward pass: their weights, fused like the base model's, and one
step's rows grouped by adapter.

A LoRA adapter adds ``scaling * B @ A`` to a linear layer's weight, which the engine never merges:
one step batches sequences of several adapters and of none. ``NativeLlama`` fuses q|k|v and
gate|up into one matmul each, so an adapter's weights are fused the same way, once at load: the
A matrices of a group are stacked by rows (``[r_q + r_k + r_v, hidden]``: one matmul gives every
member's low-rank activations) and the B matrices, times ``scaling``, are placed block-diagonally
(``[q_out + k_out + v_out, r_q + r_k + r_v]``: one matmul puts each member's delta in its columns
of the fused output; a member the adapter does not target is a zero block). The extra flops of
the zero blocks are a few percent of the base matmul for ranks up to 64.

Each step, ``LoRABatch`` holds, for every adapter some sequence of the step uses, the rows of the
flat batch that are its tokens (None when all are); ``LoRABatch.add`` adds
``(x[rows] @ A.T) @ B.T`` to those rows of a projection's output: two small matmuls per adapter,
no loop over tokens. A step in which no sequence uses an adapter has no ``LoRABatch`` at all, so
the base path runs exactly as it does without adapters (bit for bit).

Arrows: ``engine.model_runner`` loads adapters here and builds each step's ``LoRABatch``;
``engine.native_llama`` calls ``LoRABatch.add``. This module imports ``engine.lora`` only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.lora import LoRAModulePath, read_adapter_config

# NativeLlama's fused projections: name -> (the decoder layer's submodule, its linears in order)
GROUPS = {
    "qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o": ("self_attn", ("o_proj",)),
    "gate_up": ("mlp", ("gate_proj", "up_proj")),
    "down": ("mlp", ("down_proj",)),
}
_PARENT = {module: parent for parent, modules in GROUPS.values() for module in modules}
# PEFT's names in adapter_model.safetensors (the adapter's own name is not in them)
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")


@dataclass
class LoRAWeights:
    """One fused projection's adapter weights: ``delta = F.linear(F.linear(x, a), b)``."""

    a: torch.Tensor  # [sum of the members' ranks, in_features]
    b: torch.Tensor  # [fused out_features, sum of ranks], block-diagonal, scaling folded in


@dataclass
class LoRAAdapter:
    """An adapter loaded for one model: per decoder layer, its weights by fused projection name
    (a projection it does not adapt is absent)."""

    name: str
    path: str
    rank: int
    scaling: float
    layers: list[dict[str, LoRAWeights]]


def load_adapter(
    module: LoRAModulePath, model, max_rank: int, dtype: torch.dtype, device: torch.device
) -> LoRAAdapter:
    """Read ``module``'s PEFT adapter and check it against ``model`` (a transformers Llama-like
    causal LM): every tensor a known layer's A or B of the config's rank, shaped for that linear.
    ValueError naming the adapter and the first problem."""
    from safetensors.torch import load_file

    config = read_adapter_config(module.path, max_rank)
    try:
        tensors = load_file(str(config.weights_path), device="cpu")
        pairs = _pairs(tensors, model, config.rank)
    except ValueError as exc:
        raise ValueError(f"LoRA adapter {module.name!r} ({module.path}): {exc}") from None
    layers = []
    for index, layer in enumerate(model.model.layers[: model.config.num_hidden_layers]):
        fused = {}
        for group, (parent, members) in GROUPS.items():
            linears = [getattr(getattr(layer, parent), m) for m in members]
            found = [pairs.get((index, m)) for m in members]
            weights = _fuse(found, [lin.weight.shape[0] for lin in linears], config.scaling)
            if weights is not None:
                fused[group] = LoRAWeights(weights.a.to(device, dtype), weights.b.to(device, dtype))
        layers.append(fused)
    return LoRAAdapter(module.name, module.path, config.rank, config.scaling, layers)


def _pairs(tensors: dict[str, torch.Tensor], model, rank: int) -> dict:
    """``{(layer, module): (A, B)}`` in float32, every name and shape checked against ``model``."""
    num_layers = model.config.num_hidden_layers
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None or _PARENT.get(match[3]) != match[2]:
            raise ValueError(f"unexpected tensor {key!r} (only LoRA A/B of a decoder layer's "
                             "q/k/v/o/gate/up/down projections are supported)")  # fmt: skip
        layer, module, half = int(match[1]), match[3], match[4]
        if layer >= num_layers:
            raise ValueError(f"{key!r} is for layer {layer}; the model has {num_layers} layers")
        halves.setdefault((layer, module), {})[half] = tensor.float()
    if not halves:
        raise ValueError("no LoRA weights in the adapter")
    pairs = {}
    for (layer, module), ab in sorted(halves.items()):
        where = f"layers.{layer}.{_PARENT[module]}.{module}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where} has lora_{''.join(ab)} but not both lora_A and lora_B")
        out_features, in_features = getattr(
            getattr(model.model.layers[layer], _PARENT[module]), module
        ).weight.shape
        want = {"A": (rank, in_features), "B": (out_features, rank)}
        for half, shape in want.items():
            if tuple(ab[half].shape) != shape:
                raise ValueError(f"{where}.lora_{half} is {list(ab[half].shape)}; the model and "
                                 f"the adapter's rank {rank} need {list(shape)}")  # fmt: skip
        pairs[(layer, module)] = (ab["A"], ab["B"])
    return pairs


def _fuse(found: list, outs: list[int], scaling: float) -> LoRAWeights | None:
    """The members' (A, B) pairs (None: not adapted) as one fused projection's weights, in
    float32; None when no member is adapted."""
    present = [(i, pair) for i, pair in enumerate(found) if pair is not None]
    if not present:
        return None
    a = torch.cat([pair[0] for _, pair in present])
    b = torch.zeros(sum(outs), a.shape[0])
    starts = [sum(outs[:i]) for i in range(len(outs))]
    col = 0
    for i, (_, lora_b) in present:
        rank = lora_b.shape[1]
        b[starts[i] : starts[i] + outs[i], col : col + rank] = lora_b * scaling
        col += rank
    return LoRAWeights(a, b)


@dataclass
class LoRABatch:
    """One step's adapters: each with the rows of the flat batch that use it (None: every row)."""

    groups: list[tuple[LoRAAdapter, torch.Tensor | None]]

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[rows] += scaling * (x[rows] @ A.T) @ B.T`` for each adapter, in place; ``x`` is
        the projection's input, ``out`` its (fused) output."""
        for adapter, rows in self.groups:
            weights = adapter.layers[layer].get(projection)
            if weights is None:
                continue
            if rows is None:
                out += F.linear(F.linear(x, weights.a), weights.b)
            else:
                delta = F.linear(F.linear(x.index_select(0, rows), weights.a), weights.b)
                out.index_add_(0, rows, delta)


def lora_batch(
    adapters: dict[str, LoRAAdapter],
    rows: dict[str, list[int]],
    num_tokens: int,
    device: torch.device,
) -> LoRABatch | None:
    """The step's ``LoRABatch`` from each used adapter's rows (``rows``: name -> row indices);
    None when no row uses one (the base path, untouched)."""
    if not rows:
        return None
    groups = []
    for name, indices in rows.items():
        index = None if len(indices) == num_tokens else torch.tensor(indices, device=device)
        groups.append((adapters[name], index))
    return LoRABatch(groups)
