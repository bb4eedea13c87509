"""What a request's ``model`` may name: the base model, by its served name or its model id, and
each LoRA adapter of ``--lora-modules`` by its own name (vLLM's ``OpenAIServingModels``).

``adapter`` turns a request's ``model`` into the adapter it asks for (None: the base model) or a
404, the same on every generation path; answers echo ``answer_name`` (the adapter's name, else the
served name); ``/v1/models`` lists ``cards``: the base model first (routers read its card as the
engine's model), then one card per adapter whose ``parent`` is its base model, as vLLM lists them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.lora import LoRAModulePath
from serving.openai_fields import APIError

OWNED_BY = "dpmesh"


@dataclass(frozen=True)
class ServedModels:
    name: str  # --served-model-name (else --model)
    model_id: str  # --model
    root: str  # the base model's directory
    max_model_len: int
    adapters: tuple[LoRAModulePath, ...] = ()

    def adapter(self, model) -> str | None:
        """The LoRA adapter ``model`` names; None for the base model or no ``model`` at all.
        APIError 404 (OpenAI's NotFoundError) for a name this engine does not serve."""
        if model is None or model in (self.name, self.model_id):
            return None
        if any(module.name == model for module in self.adapters):
            return model
        raise APIError(
            404, f"The model `{model}` does not exist.", param="model", type="NotFoundError"
        )

    def answer_name(self, lora_name: str | None) -> str:
        """The ``model`` an answer reports: the adapter that ran, else the served name."""
        return lora_name or self.name

    def cards(self) -> list[dict]:
        created = int(time.time())
        base = {
            "id": self.name,
            "object": "model",
            "created": created,
            "owned_by": OWNED_BY,
            "root": self.root,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        adapters = [
            {
                **base,
                "id": module.name,
                "root": module.path,
                "parent": module.base_model_name or self.name,
            }
            for module in self.adapters
        ]
        return [base, *adapters]
