"""The simulated engine in-process: the step-time model's arithmetic, the profiles' numbers and
KV capacity, the fit, deterministic outputs of exactly max_tokens, stops, pacing, the CLI, and
that none of it imports torch or transformers."""

import argparse
import subprocess
import sys
import time

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, ScheduledSeq
from engine.sequence import Sequence
from engine.server.main import add_arguments
from engine.sim.fit import fit_cost, fit_error
from engine.sim.profiles import CPU_TINY, PROFILES, get_profile
from engine.sim.runner import Lateness, OutputTokens, SimulatedRunner
from engine.sim.step_time import StepCost, StepShape, chunk_pairs, shape_of

H100 = "h100-llama3.1-8b"


def sim_engine(profile: str = H100, speedup: float = 1000.0, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(simulate=profile, simulate_speedup=speedup, **config))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return sim_engine()


# ----- the step-time model -----------------------------------------------------------------------
def test_step_time_arithmetic():
    cost = StepCost(0.01, 1e-4, 1e-3, 1e-6, 1e-9)
    shape = StepShape(prefill_tokens=100, decode_seqs=4, context_tokens=1000, prefill_pairs=5050)
    assert cost.seconds(shape) == pytest.approx(0.01 + 0.01 + 0.004 + 0.001 + 5.05e-6)
    assert cost.seconds(StepShape(0, 0, 0, 0)) == 0.0  # nothing scheduled, nothing paid


def test_shape_of_a_mixed_batch():
    prompt = Sequence(list(range(96)), SamplingParams())  # a prefill chunk after 64 computed
    decoding = Sequence(list(range(50)), SamplingParams())
    decoding.token_ids += [7] * 49  # 49 outputs: the next decode attends 99 + 1 positions
    batch = ScheduledBatch([ScheduledSeq(prompt, 64, 32), ScheduledSeq(decoding, 99, 1)], [])
    assert chunk_pairs(64, 32) == 32 * 64 + 32 * 33 // 2
    assert shape_of(batch) == StepShape(32, 1, 96 + 100, chunk_pairs(64, 32))


# ----- profiles ----------------------------------------------------------------------------------
def test_gpu_profiles_follow_their_arithmetic():
    h100, a100 = get_profile(H100), get_profile("a100-40gb-llama3.1-8b")
    assert h100.cost.base_s == 6.48e-3 and a100.cost.base_s == pytest.approx(1 / 75)
    # 0.9 x 80 GiB - 8,030,261,248 x 2 B of weights - 2 GiB, over 128 KiB per token
    assert h100.kv_tokens == int((0.9 * 80 * 2**30 - 2 * 8_030_261_248 - 2 * 2**30) // 131072)
    assert (h100.kv_tokens, h100.num_kv_blocks(16)) == (450_907, 28_181)
    assert (a100.kv_tokens, a100.num_kv_blocks(16)) == (155_995, 9_749)
    # KV read at the bandwidth the batch-1 TPOT implies (16.06 GB per 6.48 ms)
    assert h100.cost.per_context_token_s == pytest.approx(131072 / (2 * 8_030_261_248 / 6.48e-3))
    assert h100.max_model_len == 131_072 and (h100.max_num_seqs, a100.max_num_seqs) == (1024, 256)
    assert all(p.sources for p in PROFILES.values())


def test_fitted_cpu_tiny_reproduces_a_step_time():
    c = CPU_TINY.cost
    shape = StepShape(256, 8, 256 + 8 * 300, chunk_pairs(0, 256))
    expected = (
        c.base_s
        + 256 * c.per_prefill_token_s
        + 8 * c.per_decode_seq_s
        + 2656 * c.per_context_token_s
        + chunk_pairs(0, 256) * c.per_prefill_pair_s
    )
    assert c.seconds(shape) == pytest.approx(expected)
    assert 0.005 < c.seconds(shape) < 0.5  # a CPU step of a few hundred tokens: tens of ms
    assert all(v >= 0 for v in c.as_dict().values()) and c.base_s > 0


def test_fit_recovers_coefficients_and_drops_negative_terms():
    shapes = [
        StepShape(p, d, ctx, chunk_pairs(0, p))
        for p in (0, 16, 128, 512)
        for d in (0, 1, 8, 32)
        for ctx in (p + d * 64, p + d * 700)
        if p or d
    ]
    truth = CPU_TINY.cost
    fitted = fit_cost(shapes, [truth.seconds(s) for s in shapes])
    for name, value in truth.as_dict().items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6, abs=1e-12)
    assert fit_error(fitted, shapes, [truth.seconds(s) for s in shapes])["rms_ms"] < 1e-6
    no_pairs = StepCost(0.004, 2e-4, 1e-4, 1e-5, 0.0)
    seconds = [no_pairs.seconds(s) * (1 + 0.02 * (-1) ** i) for i, s in enumerate(shapes)]
    assert all(v >= 0 for v in fit_cost(shapes, seconds).as_dict().values())


def test_kv_capacity_and_limits_from_the_profile():
    e = sim_engine()
    assert (e.block_manager.num_blocks, e.max_model_len) == (28_181, 131_072)
    assert sim_engine(num_kv_blocks=64).block_manager.num_blocks == 64
    assert sim_engine(kv_cache_memory=2**30).block_manager.num_blocks == 2**30 // 131072 // 16
    assert sim_engine(block_size=32).block_manager.num_blocks == 450_907 // 32
    assert sim_engine(max_model_len=4096).max_model_len == 4096
    assert sim_engine("cpu-tiny").block_manager.num_blocks == 43_690 // 16


# ----- outputs -----------------------------------------------------------------------------------
def test_outputs_are_deterministic_and_never_eos(engine):
    prompts = ["the same prompt twice", list(range(10, 60))]
    first = engine.generate(prompts, SamplingParams(max_tokens=40))
    again = sim_engine().generate(prompts, SamplingParams(max_tokens=40))  # another engine
    assert [r["token_ids"] for r in first] == [r["token_ids"] for r in again]
    assert first[0]["token_ids"] != first[1]["token_ids"]
    seeded = engine.generate(prompts[:1], SamplingParams(max_tokens=40, seed=7))[0]
    assert seeded["token_ids"] != first[0]["token_ids"]  # the seed is part of the request
    for r in first + [seeded]:
        assert not set(r["token_ids"]) & engine.eos_token_ids
        assert all(0 <= t < engine.runner.vocab_size for t in r["token_ids"])
        assert r["text"] == engine.tokenizer.decode(r["token_ids"], skip_special_tokens=True)


def test_every_request_generates_exactly_max_tokens(engine):
    lengths = [1, 2, 7, 16, 33, 64, 100]
    prompts = [[5 + i] * (3 + 11 * i) for i in range(len(lengths))]
    params = [SamplingParams(max_tokens=n, temperature=0.7) for n in lengths]
    results = engine.generate(prompts, params)
    assert [len(r["token_ids"]) for r in results] == lengths
    assert {r["finish_reason"] for r in results} == {"length"}


def test_stop_token_ids_and_stop_strings_go_through_the_real_stop_logic(engine):
    prompt = "stop me if you can"
    full = engine.generate([prompt], SamplingParams(max_tokens=60))[0]
    ids, text = full["token_ids"], full["text"]
    stop_id = ids[20]
    stopped = engine.generate([prompt], SamplingParams(max_tokens=60, stop_token_ids=[stop_id]))[0]
    assert stopped["token_ids"] == ids[: ids.index(stop_id) + 1]
    assert stopped["finish_reason"] == "stop"
    middle = len(text) // 2
    needle = next(
        text[i : i + 3] for i in range(middle, len(text)) if "\ufffd" not in text[i : i + 3]
    )
    by_text = engine.generate([prompt], SamplingParams(max_tokens=60, stop=[needle]))[0]
    assert by_text["text"] == text[: text.index(needle)] and by_text["finish_reason"] == "stop"


def test_eos_is_drawn_only_when_the_request_asks_for_it():
    tokens = OutputTokens(vocab_size=8, eos_token_ids={0, 2})
    seq = Sequence([1, 2, 3], SamplingParams())
    drawn = []
    for _ in range(300):
        drawn.append(tokens.next_token(seq))
        seq.append_token(drawn[-1])
    assert set(drawn) == {1, 3, 4, 5, 6, 7}
    asking = Sequence([1, 2, 3], SamplingParams(stop_token_ids=[2]))
    for _ in range(300):
        asking.append_token(tokens.next_token(asking))
    assert 2 in asking.output_token_ids and 0 not in asking.output_token_ids


# ----- pacing ------------------------------------------------------------------------------------
def test_a_step_lasts_its_modeled_time_divided_by_the_speedup():
    real_time = sim_engine(speedup=1.0, max_num_batched_tokens=2048)
    real_time.add_request("a", list(range(4, 1004)), SamplingParams(max_tokens=2))
    started = time.monotonic()
    real_time.step()  # a 1000-token prefill: 6.5 + 23.5 + 0.5 ms on an H100
    elapsed = time.monotonic() - started
    modeled = real_time.runner.modeled_s
    assert modeled == pytest.approx(0.0305, abs=0.001)
    assert modeled <= elapsed < modeled + 0.05
    config = EngineConfig(simulate=H100, simulate_speedup=4.0)
    runner = SimulatedRunner(config, PROFILES[H100], vocab_size=8, eos_token_ids=set())
    runner.step_s = 0.2
    started = time.monotonic()
    runner.end_step(started)
    assert 0.05 <= time.monotonic() - started < 0.15


def test_steps_that_outlast_their_model_are_counted_and_reported(caplog):
    lateness = Lateness(period_s=0.0)
    lateness.record(-0.01)  # on time: 10 ms to spare
    with caplog.at_level("WARNING", logger="engine.sim"):
        lateness.record(0.25)
    assert (lateness.steps, lateness.late, lateness.late_s) == (2, 1, 0.25)
    assert "1 of 2 steps took longer than modeled" in caplog.text


# ----- command line and imports ------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="runengine")
    add_arguments(p)
    return p


def test_cli_lists_profiles_and_rejects_unknown_ones(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse would wrap a profile name at its hyphens
    help_text = parser().format_help()
    assert all(name in help_text for name in PROFILES) and "--simulate-speedup" in help_text
    args = parser().parse_args(["--simulate", "cpu-tiny", "--simulate-speedup", "2.5"])
    assert (args.simulate, args.simulate_speedup) == ("cpu-tiny", 2.5)
    for bad in (["--simulate", "h100"], ["--simulate", H100, "--simulate-speedup", "0"]):
        with pytest.raises(SystemExit) as exc:
            parser().parse_args(bad)
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'h100'" in err and H100 in err and "must be > 0" in err


NO_TORCH = """
import argparse
import sys
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.server import app, frontend, main, rank
engine = LLMEngine(EngineConfig(simulate="cpu-tiny", simulate_speedup=1000.0))
assert len(engine.generate(["hi"], SamplingParams(max_tokens=3))[0]["token_ids"]) == 3
parser = argparse.ArgumentParser()
main.add_arguments(parser)
args = parser.parse_args(["--simulate", "h100-llama3.1-8b"])
tokenizer = main.front_tokenizer(main.model_directory(args), args.simulate)
config = main.engine_config(args, engine.model_path)
assert (config.max_num_seqs, config.max_num_batched_tokens, config.device) == (1024, 8192, "cpu")
assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
assert not heavy, heavy
"""


def test_the_simulated_path_imports_neither_torch_nor_transformers(repo_root):
    run = subprocess.run(
        [sys.executable, "-c", NO_TORCH], cwd=repo_root, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
