"""Runs a transformers causal LM over the paged KV cache.

The model is loaded through ``AutoModelForCausalLM`` exactly as a user's local checkpoint is,
with ``attn_implementation`` set to ``engine.paged_attention``'s function, registered in
transformers' ``AttentionInterface``. A Llama-architecture model then runs through
``engine.native_llama`` (``EngineConfig.model_impl``): the same function with fused projections
and far fewer ops; anything else runs through transformers' decoder layers, with only attention
ours. Either way each step's attention reads a ``PagedContext`` built once per step
(``engine.paged_context``), so a cached prefix is never recomputed.

With ``attention_impl="cpp"`` (``EngineConfig``; ``auto`` picks it when it compiles) the decodes
take ``engine.paged_kernel``, a C++ kernel that reads every row's blocks where they lie in the
pool; else torch's attention, with cascade groups for shared prefixes on the CPU.

LoRA adapters (``EngineConfig.lora_modules``) are loaded here at start (``engine.lora_layers``)
and applied by the native forward pass only; each step groups its rows by the adapter their
sequence names (``SamplingParams.lora_name``).

Arrows: this module sits above the forward pass. It imports ``engine.native_llama``,
``engine.lora_layers``, ``engine.paged_attention`` and ``engine.paged_context``; none of them
imports it back.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM

from engine import paged_kernel
from engine.config import EngineConfig
from engine.lora_layers import LoRAAdapter, load_adapter, lora_batch
from engine.native_llama import NativeLlama, unsupported_reason
from engine.paged_attention import ATTN_IMPLEMENTATION
from engine.paged_context import PagedContext, build_context
from engine.sampler import sample
from engine.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model and the KV pool of one engine; turns a scheduled batch into sampled tokens."""

    def __init__(self, config: EngineConfig, model_path: str):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            # cuDNN's attention builds an execution plan for every new shape it sees (~2.6 ms of
            # CPU a call, measured on an H200 with torch 2.11), and every prefill's length is a
            # new shape: the first bf16 run there made 820 output tok/s, the same run with the
            # plans cached 7,459. Flash and memory-efficient attention need no plan.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.block_size = config.block_size
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                model_path,
                dtype="auto" if config.dtype == "auto" else getattr(torch, config.dtype),
                attn_implementation=ATTN_IMPLEMENTATION,
            )
            .to(self.device)
            .eval()
        )
        self.dtype = self.model.dtype  # "auto" resolved: the checkpoint's own dtype
        self.native = self._native_model(config.model_impl)
        self.model_impl = "transformers" if self.native is None else "native"
        self.adapters = self._load_adapters(config)
        mc = self.model.config
        self.num_layers = mc.num_hidden_layers
        self.num_kv_heads = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
        self.head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        self.num_kv_blocks = config.num_kv_blocks or max(
            1, (config.kv_cache_memory or config.DEFAULT_KV_MEMORY) // self.bytes_per_block
        )
        shape = (
            2,
            self.num_layers,
            self.num_kv_heads,
            self.num_kv_blocks,
            self.block_size,
            self.head_dim,
        )
        self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.generator = torch.Generator(device="cpu").manual_seed(config.seed)
        # steps whose decodes attended to a shared prefix: as a group (torch), or in place by
        # each row (cpp: counted when two decode rows start at the same block)
        self.cascade_steps = 0
        self.decode_kernel = self._decode_kernel(config.attention_impl, mc)
        self.attention_impl = "torch" if self.decode_kernel is None else "cpp"
        logger.info(
            "KV pool: %d blocks x %d tokens, %.1f MiB",
            self.num_kv_blocks,
            self.block_size,
            self.kv_bytes / 2**20,
        )

    def _native_model(self, model_impl: str):
        """``engine.native_llama``'s forward pass for the model, or None for transformers'."""
        if model_impl == "transformers":
            return None
        reason = unsupported_reason(self.model)
        if reason is None:
            return NativeLlama(self.model)
        if model_impl == "native":
            raise ValueError(f"model_impl='native' cannot run this model: {reason}")
        logger.info("transformers forward pass: no native one for this model (%s)", reason)
        return None

    def _load_adapters(self, config: EngineConfig) -> dict[str, LoRAAdapter]:
        """Every ``--lora-modules`` adapter, by name, in the model's dtype on its device. Only
        the native forward pass applies them: on transformers' path they would be silently
        ignored, so that is refused here."""
        if not config.lora_modules:
            return {}
        if self.native is None:
            raise ValueError(
                "LoRA adapters (--lora-modules) need the native forward pass "
                "(engine/native_llama.py), and this engine runs transformers' "
                f"(model_impl={config.model_impl!r}, {type(self.model).__name__})"
            )
        adapters = {}
        for module in config.lora_modules:
            adapters[module.name] = load_adapter(
                module, self.model, config.max_lora_rank, self.dtype, self.device
            )
            logger.info("LoRA adapter %s loaded from %s", module.name, module.path)
        return adapters

    def _decode_kernel(self, attention_impl: str, mc):
        """``engine.paged_kernel``'s compiled decode function, or None for the torch path."""
        if attention_impl == "torch":
            return None
        heads = mc.num_attention_heads
        reason = None
        if self.device.type != "cpu":
            reason = f"device {self.device.type}"
        elif self.dtype not in paged_kernel.DTYPES:
            reason = f"dtype {self.dtype}"
        elif self.head_dim > 256 or heads % self.num_kv_heads or heads // self.num_kv_heads > 16:
            reason = f"{heads} heads, {self.num_kv_heads} KV heads, head_dim {self.head_dim}"
        elif paged_kernel.load() is None:
            reason = f"it did not build ({paged_kernel.error()})"
        if reason is None:
            logger.info("attention: cpp paged decode kernel (engine/paged_kernel.py)")
            return paged_kernel.load().paged_decode
        if attention_impl == "cpp":
            raise ValueError(f"attention_impl='cpp' cannot run here: {reason}")
        logger.info("attention: torch (no cpp paged decode kernel: %s)", reason)
        return None

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return getattr(self.model.config, "max_position_embeddings", None) or 2048

    def end_step(self, started: float) -> None:
        """The engine's end-of-step hook; a real forward pass has already taken its time (the
        simulated runner sleeps here until its modeled end)."""

    @property
    def bytes_per_block(self) -> int:
        item = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * item

    @property
    def kv_layout(self) -> dict:
        """What a block's KV is, for a transfer's handshake (engine/kv_transfer.py): both ends
        must agree on all of it."""
        return {
            "layers": self.num_layers,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    def export_blocks(self, block_ids: list[int]) -> bytes:
        """The K and V of every layer for ``block_ids``, in that order, as raw bytes (layout:
        [2, layers, kv_heads, len(block_ids), block_size, head_dim] of ``kv_layout``'s dtype).
        Called from a transfer thread: the blocks are held, so no step writes them meanwhile."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = self.kv.index_select(3, index).contiguous().cpu()
        return data.view(torch.uint8).numpy().tobytes()

    def import_blocks(self, block_ids: list[int], data: bytes) -> None:
        """Write ``export_blocks``' bytes (from another engine with the same layout) into
        ``block_ids``."""
        shape = (2, self.num_layers, self.num_kv_heads, len(block_ids), self.block_size,
                 self.head_dim)  # fmt: skip
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        values = raw.view(self.dtype).reshape(shape).to(self.device)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv.index_copy_(3, index, values)

    @property
    def kv_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """One vector per input: the last token's final hidden state, L2-normalized (what vLLM
        serves for a decoder-only model converted to embeddings: last-token pooling,
        normalized). A plain forward pass each, no KV kept: embeddings share no cache."""
        out = []
        for ids in inputs:
            tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
            hidden = self.model.base_model(input_ids=tokens).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(hidden.float(), dim=0).tolist())
        return out

    def _context(self, batch: ScheduledBatch) -> PagedContext:
        """The step's attention metadata (``engine.paged_context``); counts the step in
        ``cascade_steps`` when its decodes read a shared prefix."""
        # a runner without the attribute (a test's stand-in) takes the torch path
        kernel = getattr(self, "decode_kernel", None)
        paged, shared = build_context(
            batch, self.kv, self.block_size, self.device, self.dtype, kernel
        )
        if shared:
            self.cascade_steps += 1
        return paged

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        """One forward pass over the batch; returns one sampled token per sampling item, in
        order."""
        input_ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        lora_rows: dict[str, list[int]] = {}  # adapter name -> its rows of the flat batch
        for item in batch.items:
            end = item.start + item.num_tokens
            if item.seq.params.lora_name is not None:
                rows = lora_rows.setdefault(item.seq.params.lora_name, [])
                rows += range(len(input_ids), len(input_ids) + item.num_tokens)
            input_ids += item.seq.token_ids[item.start : end]
            positions += range(item.start, end)
            if item.samples:
                last.append(len(input_ids) - 1)
        paged = self._context(batch)
        keep = torch.tensor(last if last else [len(input_ids) - 1], device=self.device)
        ids = torch.tensor(input_ids, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        if self.native is not None:
            lora = lora_batch(self.adapters, lora_rows, len(input_ids), self.device)
            logits = self.native.forward(ids, pos, keep, paged, lora)
        else:
            logits = self.model(
                input_ids=ids[None],
                position_ids=pos[None],
                use_cache=False,
                logits_to_keep=keep,
                paged=paged,
            ).logits[0]
        if not last:
            return []
        seqs = [item.seq for item in batch.items if item.samples]
        return sample(logits.float(), seqs, self.generator)
