"""``SimulatedRunner``: what ``ModelRunner`` is to the engine, without a model.

It takes the scheduler's batch like the real runner, returns one token per sampling sequence,
and makes the step last what the profile's step-time model says: ``LLMEngine.step`` calls
``end_step`` after postprocessing, and the runner sleeps until the step's modeled end, so the
Python work of the step (scheduling, detokenizing) is part of the modeled time, not added to it.
"""

from __future__ import annotations

import logging
import struct
import time

import numpy as np
import xxhash

from engine.config import EngineConfig
from engine.sim.profiles import Profile, get_profile
from engine.sim.step_time import shape_of

logger = logging.getLogger(__name__)

_POSITION = struct.Struct("<Q")
_SEED = struct.Struct("<q")
BEHIND_LOG_PERIOD_S = 30.0


class OutputTokens:
    """Deterministic output ids, like Dynamo's mocker: output token ``i`` of a request is a hash
    of (its prompt, its seed, ``i``) mapped onto the vocabulary minus the EOS ids. A request
    therefore runs to ``max_tokens`` unless a stop string turns up in its text or it lists
    stop_token_ids (those it may draw, EOS ids included: asking for them is asking to stop)."""

    def __init__(self, vocab_size: int, eos_token_ids: set[int]):
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)

    def _stream(self, seq) -> tuple[int, list[int]]:
        # memoised on the sequence, like the sampler's per-request generator
        stream = getattr(seq, "sim_stream", None)
        if stream is None:
            prompt = np.asarray(seq.token_ids[: seq.num_prompt_tokens], dtype="<i4").tobytes()
            seed = -1 if seq.params.seed is None else seq.params.seed
            digest = xxhash.xxh64_intdigest(_SEED.pack(seed) + prompt)
            never = self.eos_token_ids - set(seq.params.stop_token_ids)
            stream = seq.sim_stream = (digest, sorted(t for t in never if 0 <= t < self.vocab_size))
        return stream

    def next_token(self, seq) -> int:
        """The token ``seq`` generates next (its output position is ``num_output_tokens``)."""
        seed, excluded = self._stream(seq)
        pick = xxhash.xxh64_intdigest(_POSITION.pack(seq.num_output_tokens), seed)
        token = pick % (self.vocab_size - len(excluded))
        for skipped in excluded:  # ascending: shift past every excluded id at or below it
            if token < skipped:
                break
            token += 1
        return token


class Lateness:
    """Counts steps whose Python work outlasted their modeled time and says so now and then:
    such a simulation is bound by this CPU, not by the profile."""

    def __init__(self, period_s: float = BEHIND_LOG_PERIOD_S):
        self.period_s = period_s
        self.steps = self.late = 0
        self.late_s = 0.0
        self._last_log = time.monotonic()

    def record(self, overrun_s: float) -> None:
        self.steps += 1
        if overrun_s <= 0:
            return
        self.late += 1
        self.late_s += overrun_s
        now = time.monotonic()
        if now - self._last_log >= self.period_s:
            self._last_log = now
            logger.warning(
                "simulation behind its model: %d of %d steps took longer than modeled "
                "(%.3f s in all); fewer ranks or a smaller --simulate-speedup keep it honest",
                self.late,
                self.steps,
                self.late_s,
            )


class SimulatedRunner:
    """Stands in for ``ModelRunner``: the same attributes the engine reads (``num_kv_blocks``,
    ``vocab_size``, ``max_position_embeddings``), ``run(batch)`` returns the step's tokens at once,
    and ``end_step(started)`` sleeps until ``started`` + the modeled step time / speedup."""

    def __init__(
        self, config: EngineConfig, profile: Profile, vocab_size: int, eos_token_ids: set[int]
    ):
        self.profile = profile
        self.speedup = config.simulate_speedup
        self.block_size = config.block_size
        self.num_kv_blocks = config.num_kv_blocks or profile.num_kv_blocks(
            config.block_size, config.kv_cache_memory
        )
        self.vocab_size = vocab_size
        self.max_position_embeddings = profile.max_model_len
        self.tokens = OutputTokens(vocab_size, eos_token_ids)
        self.lateness = Lateness()
        self.step_s = 0.0  # modeled time of the step in progress
        self.modeled_s = 0.0  # all steps so far

    # prefill/decode disaggregation (engine/kv_transfer.py): no KV exists here, so a pull moves
    # none; the decode rank waits out the modeled transfer time instead (``transfer_s``)
    @property
    def kv_layout(self) -> dict:
        return {"simulate": self.profile.name, "block_size": self.block_size}

    def export_blocks(self, block_ids: list[int]) -> bytes:
        return b""

    def import_blocks(self, block_ids: list[int], data: bytes) -> None:
        """Nothing to write: a simulated rank has no KV."""

    def transfer_s(self, num_blocks: int) -> float:
        """The modeled wall time of pulling ``num_blocks`` blocks, at this run's speedup."""
        return self.profile.transfer_seconds(num_blocks * self.block_size) / self.speedup

    def run(self, batch) -> list[int]:
        self.step_s = self.profile.cost.seconds(shape_of(batch))
        self.modeled_s += self.step_s
        return [self.tokens.next_token(item.seq) for item in batch.items if item.samples]

    def end_step(self, started: float) -> None:
        """Sleep until the modeled end of the step that began at ``started`` (monotonic)."""
        remaining = started + self.step_s / self.speedup - time.monotonic()
        self.step_s = 0.0
        self.lateness.record(-remaining)
        if remaining > 0:
            time.sleep(remaining)


def load_simulated(config: EngineConfig, model_path: str):
    """(tokenizer, runner, eos ids) of a simulated engine: the model directory's tokenizer (no
    transformers) and a ``SimulatedRunner`` for ``config.simulate``."""
    from engine.tokenizer import load_tokenizer

    profile = get_profile(config.simulate)
    tokenizer = load_tokenizer(model_path)
    eos = set(tokenizer.eos_token_ids)
    return tokenizer, SimulatedRunner(config, profile, len(tokenizer), eos), eos
