"""The in-process engine: add requests, step, stream outputs, abort. One engine is one DP rank.

Arrows: this module is the top of the in-process engine. It imports the scheduler, the block
manager and the detokenizer, and at load time one runner: ``engine.model_runner`` (the model)
or, with ``EngineConfig.simulate``, ``engine.sim.runner`` (a step-time model). No runner and
nothing under ``engine.sim`` imports it back; what drives an ``LLMEngine`` (``engine.server.rank``,
``engine.bench``, ``engine.fit_step_time``) sits above it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.stats import CacheStats
from engine.tiny import resolve_model_path

# "engine", not this module's name: the ranks' "Scheduled prefill batch" and [Cache Stats]
# lines go out under it, and tests/engine/test_scheduler.py picks them out by that name.
logger = logging.getLogger("engine")


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas, not totals)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    # a prefill for a remote decode: the prompt's full blocks, held here until pulled
    held_block_ids: list[int] | None = None
    # with a request's first token: its prefill chunks as (start, end) wall-clock seconds and
    # tokens, for the front's trace spans (serving/tracing.py)
    prefill_chunks: list[tuple[float, float, int]] | None = None


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    stop_ids: set[int] = field(default_factory=set)
    hold_key: str | None = None  # a prefill for a remote decode: hold its blocks under this
    cached_tokens: int | None = None  # what to report as cached (a decode: the prefill side's)


@dataclass
class Held:
    """A finished prefill's full prompt blocks, kept for a decode rank to pull
    (engine/kv_transfer.py), until ``deadline`` (monotonic)."""

    block_ids: list[int]
    digests: list[int]
    deadline: float
    cached_tokens: int  # what the prefill found cached: the decode side reports it


def load_model(config: EngineConfig, model_path: str):
    """(tokenizer, runner, EOS ids) for ``config``: the model through transformers, or with
    ``config.simulate`` the step-time model of ``engine.sim``, which imports neither torch nor
    transformers (so both are imported here, not at module level)."""
    if config.simulate:
        from engine.sim.runner import load_simulated

        return load_simulated(config, model_path)
    from transformers import AutoTokenizer

    from engine.model_runner import ModelRunner

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return tokenizer, ModelRunner(config, model_path), _eos_ids(model_path, tokenizer)


def _eos_ids(model_path: str, tokenizer) -> set[int]:
    from transformers import GenerationConfig

    ids = set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class LLMEngine:
    """``step()`` is schedule → run → postprocess. Not thread-safe: one owner drives it.

    The runner is the model (``ModelRunner``) or, with ``config.simulate``, a step-time model
    (``engine.sim.runner.SimulatedRunner``); everything else is the same code either way."""

    def __init__(self, config: EngineConfig, log_prefix: str = ""):
        self.config = config
        self.log = (
            logging.LoggerAdapter(logger, {}) if not log_prefix else _Prefixed(logger, log_prefix)
        )
        self.model_path = resolve_model_path(config.model)
        self.lora_names = {module.name for module in config.lora_modules}
        self.tokenizer, self.runner, self.eos_token_ids = load_model(config, self.model_path)
        model_len = self.runner.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.cache_stats = CacheStats(self.log, config.stats_interval)
        self.requests: dict[str, _Request] = {}
        self.held: dict[str, Held] = {}  # hold key -> held blocks
        self.new_holds: list[str] = []  # hold keys since ``take_new_holds``
        self.kv_transfer_timeout_s = 480.0  # vLLM's default wait for a decode to pull

    # ----- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        hold_key: str | None = None,
        cached_tokens: int | None = None,
    ) -> Sequence:
        """Queue a request (a text ``prompt`` is encoded with the tokenizer's special tokens, as
        vLLM's ``LLM.generate`` encodes it). Raises ValueError (nothing queued) for an empty or
        too long prompt, a duplicate id, or a prompt that could never fit the KV pool.
        ``hold_key``: a prefill for a remote decode, whose prompt blocks stay held under that key
        when it ends (``held``; the key is the request id for vLLM's protocol, the bootstrap room
        for SGLang's); ``cached_tokens``: the cached count to report instead of this rank's own
        (a decode reports its prefill's)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if hold_key is not None and (hold_key in self.held or self._holding(hold_key)):
            raise ValueError(f"KV is already held under {hold_key!r}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(ids, params)
        seq = Sequence(ids, params, request_id=request_id, block_size=self.config.block_size)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        self.requests[request_id] = _Request(
            seq,
            IncrementalDetokenizer(self.tokenizer, params.stop),
            stop_ids,
            hold_key,
            cached_tokens,
        )
        self.scheduler.add(seq)
        return seq

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        if params.lora_name is not None and params.lora_name not in self.lora_names:
            raise ValueError(f"LoRA adapter {params.lora_name!r} is not loaded (--lora-modules)")
        vocab = self.runner.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}"
            )
        need = -(-(len(ids) + params.max_tokens) // self.config.block_size)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"the request needs {need} KV blocks; this rank has {self.block_manager.num_blocks}"
            )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request in any state and free its blocks. Returns False if it is unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req.seq, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----- prefill/decode disaggregation (engine/kv_transfer.py) ------------------------------
    def _holding(self, key: str) -> bool:
        return any(r.hold_key == key for r in self.requests.values())

    def take_new_holds(self) -> list[tuple[str, Held]]:
        """The holds made since the last call (for the transfer server to offer)."""
        keys, self.new_holds = self.new_holds, []
        return [(k, self.held[k]) for k in keys if k in self.held]

    def release_held(self, key: str) -> bool:
        """Give back a prefill's held blocks (pulled, or given up). False if none are held."""
        held = self.held.pop(key, None)
        if held is None:
            return False
        self.block_manager.release(held.block_ids)
        return True

    def expire_held(self, now: float, withdraw=lambda key: True) -> list[str]:
        """Release the holds past their deadline that ``withdraw(key)`` lets go (the transfer
        server's: not one being pulled now)."""
        expired = [k for k, h in self.held.items() if h.deadline <= now and withdraw(k)]
        for key in expired:
            self.log.warning("KV held under %s was never pulled: released", key)
            self.release_held(key)
        return expired

    def import_prefix(
        self,
        prompt_ids: list[int],
        first: int,
        data: bytes,
        count: int,
        params: SamplingParams | None = None,
    ) -> int:
        """Cache full blocks ``first .. first + count`` of ``prompt_ids`` from KV computed by
        another engine (``data``: ``runner.export_blocks``' bytes), kept as cached blocks so the
        request that follows hits them like any prefix (``params``: the request's, whose
        ``cache_salt`` keys the blocks). Blocks ``0 .. first`` are those found cached here when
        the pull began; they are pinned meanwhile, and if some were evicted since, the chain is
        cut there and the request recomputes from the gap. Returns the blocks imported."""
        seq = Sequence(prompt_ids, params or SamplingParams(), block_size=self.config.block_size)
        manager = self.block_manager
        local = manager.cached_prefix(seq, first)
        manager.pin(local)
        try:
            if len(local) < first or not manager.can_import(count):
                return 0
            block_ids = manager.import_blocks(count)
            self.runner.import_blocks(block_ids, data)
            manager.publish_imported(seq, first, block_ids)
            return count
        finally:
            manager.release(local)

    # ----- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.monotonic()
        batch = self.scheduler.schedule()
        if not batch.items:
            return []
        self._log_prefill(batch)
        began = time.time()
        tokens = self.runner.run(batch)
        if batch.prefills:
            ended = time.time()
            for p in batch.prefills:
                p.seq.prefill_chunks.append((began, ended, p.num_tokens))
        outputs = self._postprocess(batch, tokens)
        self.runner.end_step(started)
        return outputs

    def _log_prefill(self, batch: ScheduledBatch) -> None:
        for item in batch.items:
            seq = item.seq
            if item.start == seq.num_cached_tokens and not seq.num_preemptions and item.is_prefill:
                self.cache_stats.record(seq.num_prompt_tokens, seq.num_cached_tokens)
        prefills = batch.prefills
        if prefills:
            # "cached" is the prefix-cache hit, reported with a prompt's first chunk; the later
            # chunks of a chunked prefill start after tokens computed in earlier steps, which are
            # no hit
            cached = [p.start if p.start == p.seq.num_cached_tokens else 0 for p in prefills]
            self.log.info(
                "Scheduled prefill batch: %d reqs, %d new tokens (cached: %s, new: %s), "
                "req_ids: %s",
                len(prefills),
                sum(p.num_tokens for p in prefills),
                cached,
                [p.num_tokens for p in prefills],
                tuple(p.seq.seq_id for p in prefills),
            )

    def _postprocess(self, batch: ScheduledBatch, tokens: list[int]) -> list[RequestOutput]:
        outputs = []
        it = iter(tokens)
        for item in batch.items:
            if not item.samples:
                continue
            token = next(it)
            req = self.requests.get(item.seq.request_id)
            if req is None or req.seq is not item.seq:
                continue  # aborted during this step
            outputs.append(self._advance(req, token))
        return outputs

    def _advance(self, req: _Request, token: int) -> RequestOutput:
        seq = req.seq
        seq.append_token(token)
        reason, matched_stop_string = None, False
        if token in req.stop_ids:
            reason = "stop"
        elif req.detok.add(seq.output_token_ids):
            reason, matched_stop_string = "stop", True
        elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason:
            # like vLLM: a stop token's own text is not part of the output
            if token in req.stop_ids:
                req.detok.flush(seq.output_token_ids[:-1])
            elif not matched_stop_string:
                req.detok.flush(seq.output_token_ids)
            held = self._hold(seq, req.hold_key) if req.hold_key is not None else None
            self.scheduler.finish(seq, reason)
            del self.requests[seq.request_id]
        return RequestOutput(
            seq.request_id,
            [token],
            req.detok.delta(reason is not None),
            reason is not None,
            reason,
            seq.num_prompt_tokens,
            seq.num_cached_tokens if req.cached_tokens is None else req.cached_tokens,
            seq.num_output_tokens,
            held.block_ids if reason and held else None,
            seq.prefill_chunks if seq.num_output_tokens == 1 else None,
        )

    def _hold(self, seq: Sequence, key: str) -> Held:
        """Keep ``seq``'s full prompt blocks (all computed: its first token is sampled)."""
        count = seq.num_prompt_tokens // self.config.block_size
        held = Held(
            self.block_manager.hold(seq, count),
            [seq.digest(i) for i in range(count)],
            time.monotonic() + self.kv_transfer_timeout_s,
            seq.num_cached_tokens,
        )
        self.held[key] = held
        self.new_holds.append(key)
        return held

    # ----- convenience -----------------------------------------------------------------------
    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[dict]:
        """Run ``prompts`` to completion together; returns text, token ids and cache counts."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{i}-{id(self)}" for i in range(len(prompts))]
        results = {
            rid: {"text": "", "token_ids": [], "finish_reason": None, "num_cached_tokens": 0}
            for rid in ids
        }
        for rid, prompt, p in zip(ids, prompts, params_list, strict=False):
            self.add_request(rid, prompt, p)
        while self.has_unfinished_requests():
            for out in self.step():
                r = results[out.request_id]
                r["text"] += out.new_text
                r["token_ids"] += out.new_token_ids
                r["num_cached_tokens"] = out.num_cached_tokens
                r["finish_reason"] = out.finish_reason
        return [results[rid] for rid in ids]


class _Prefixed(logging.LoggerAdapter):
    """Prefixes every line with the rank, e.g. ``[DP0] Scheduled prefill batch: …``."""

    def __init__(self, base: logging.Logger, prefix: str):
        super().__init__(base, {})
        self.prefix = prefix

    def process(self, msg, kwargs):
        return f"{self.prefix} {msg}", kwargs
