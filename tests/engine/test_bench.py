"""Smoke tests of the in-process benchmark command (no timing assertions: numbers are
machine-bound). Thread counts are left alone (``main`` and ``--threads`` set torch's
process-wide setting)."""

import re

from engine import bench


def quick_args(*argv):
    args = bench.parse_args(["--quick", *argv])
    args.threads = None  # EngineConfig(num_threads=None): leave torch's setting as it is
    return args


def test_memory_part_prints_its_table(capsys):
    result = bench.bench_memory(quick_args("--kv-memory-mib", "8"))
    out = capsys.readouterr().out
    assert re.search(r"configured kv_cache_memory +8\.0", out)
    assert result["configured"] == 8 * 2**20 and 0 < result["allocated"] <= result["configured"]


def test_time_to_first_token_reports_cache_hits():
    engine = bench.make_engine(quick_args(), kv_cache_memory=None, num_kv_blocks=128)
    prefix = list(range(100, 164))
    _, cached = bench.time_to_first_token(engine, "a", prefix + [7, 8])
    assert cached == 0
    seconds, cached = bench.time_to_first_token(engine, "b", prefix + [9, 10])
    assert cached == 64 and seconds > 0


def test_table_alignment(capsys):
    bench.print_table("T", ["name", "value"], [["a", 1], ["longer", 22.5]])
    assert capsys.readouterr().out.splitlines()[1:] == [
        "T",
        "name    value",
        "------  -----",
        "a           1",
        "longer   22.5",
    ]
