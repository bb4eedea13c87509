"""Engine configuration: one dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from engine.lora import DEFAULT_MAX_LORA_RANK, LoRAModulePath

DTYPES = ("auto", "float32", "bfloat16", "float16")
# "auto": the native forward pass (engine.native_llama) when the model qualifies, else
# transformers'; "native" requires it; "transformers" always runs the transformers modules.
MODEL_IMPLS = ("auto", "native", "transformers")
# single-token decode attention: "cpp" is engine.paged_kernel (a C++ extension built at first use
# that reads the paged pool in place), "torch" gathers blocks for SDPA (and cascade groups);
# "auto" takes cpp when it builds and runs the model (CPU, float32/bfloat16), else torch.
ATTENTION_IMPLS = ("auto", "torch", "cpp")


@dataclass
class EngineConfig:
    """Sizes and limits of one engine (one DP rank).

    The KV pool is sized either by ``num_kv_blocks`` or by ``kv_cache_memory`` (bytes); when
    neither is given, ``DEFAULT_KV_MEMORY`` bytes are used (with ``simulate``: the profile's
    capacity).

    ``simulate`` names a profile of ``engine.sim.profiles``: the model's forward pass is replaced
    by that profile's step-time model (``engine.sim``), everything else stays the real engine.
    ``simulate_speedup`` divides the modeled step times (2.0 runs the simulation twice as fast).
    """

    model: str = "tiny"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # a prefill with more tokens than this left is long: short prompts jump it (engine.scheduler);
    # None: half of max_num_batched_tokens; 0: off (strict FCFS)
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None  # None: the model's own limit
    device: str = "cpu"
    dtype: str = "auto"  # "auto" (the checkpoint's own dtype), "float32", "bfloat16", "float16"
    model_impl: str = "auto"  # one of MODEL_IMPLS
    attention_impl: str = "auto"  # one of ATTENTION_IMPLS
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    stats_interval: int = 100  # log [Cache Stats] every this many finished requests
    enable_prefix_caching: bool = True
    seed: int = 0
    simulate: str | None = None
    simulate_speedup: float = 1.0
    # prefill/decode disaggregation (engine/kv_transfer.py): None (both), "prefill" or "decode"
    disaggregation_mode: str | None = None
    kv_transfer_host: str = "127.0.0.1"  # where a prefill rank listens for pulls
    kv_transfer_timeout_s: float = 480.0  # a held prefill not pulled by then is released
    # for testing a router's pin check: these paths serve requests as if no rank was asked for
    # (as SGLang 0.5.19's /v1/responses does: sglang#38729)
    debug_ignore_rank_paths: tuple[str, ...] = ()
    # LoRA adapters every rank loads at start (engine/lora.py); a request names one in ``model``
    lora_modules: tuple[LoRAModulePath, ...] = ()
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK

    DEFAULT_KV_MEMORY = 256 * 1024 * 1024

    def __post_init__(self):
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be > 0, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least one block")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {threshold}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(
                f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {self.model_impl!r}"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"attention_impl must be one of {', '.join(ATTENTION_IMPLS)}, "
                f"got {self.attention_impl!r}"
            )
        if self.max_lora_rank <= 0:
            raise ValueError(f"max_lora_rank must be > 0, got {self.max_lora_rank}")
        if not self.simulate_speedup > 0:
            raise ValueError(f"simulate_speedup must be > 0, got {self.simulate_speedup}")

    def long_prefill_threshold(self) -> int:
        """``long_prefill_token_threshold`` with its default (half the step's budget) filled in."""
        if self.long_prefill_token_threshold is None:
            return self.max_num_batched_tokens // 2
        return self.long_prefill_token_threshold
