"""jaxpar.testing.fast_compiles: one compilation cache for the run, shared through the
environment, and XLA's CPU backend at optimisation level 0 unless XLA_FLAGS chose a level;
CompileLog and benchmarks/suite_compiles.py, which account for where a run's time goes."""

import importlib.util
import json
import os
import pathlib
import random

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.testing import CACHE_DIR, CompileLog, fast_compiles


def test_one_cache_for_the_run_reached_by_this_process_and_its_children():
    cache = fast_compiles()  # again: conftest called it first
    assert cache == os.environ[CACHE_DIR] == os.environ["JAX_COMPILATION_CACHE_DIR"] == jax.config.jax_compilation_cache_dir
    before = set(os.listdir(cache))
    offset = random.random()  # a program no other test, nor an earlier run keeping its cache (JAXPAR_TEST_XLA_CACHE), compiled
    jax.jit(lambda x: x * 3.0 + offset)(jnp.arange(7.0)).block_until_ready()
    assert set(os.listdir(cache)) - before, "nothing was written to the cache"
    assert os.environ["XLA_FLAGS"].count("--xla_backend_optimization_level=0") == 1  # idempotent


def test_a_chosen_optimisation_level_is_kept(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2")
    fast_compiles()
    assert os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=2"


def test_the_compile_log_records_each_stage_under_its_test_and_the_benchmark_sums_them(tmp_path):
    log = CompileLog(str(tmp_path))
    log.test = "tests/test_x.py::test_y"
    try:
        jax.jit(lambda x: x * 5.0 - 0.75)(np.arange(3.0, dtype=np.float32)).block_until_ready()  # no other test compiles it
    finally:
        log.close()
    assert not jax.config.jax_log_compiles
    records = [json.loads(line) for line in (tmp_path / f"{os.getpid()}.jsonl").read_text().splitlines()]
    assert sorted(r["kind"] for r in records) == ["compile", "lowering", "tracing"], records
    assert all(r["test"] == "tests/test_x.py::test_y" and r["fn"] == "<lambda>" and r["s"] >= 0 for r in records), records

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "suite_compiles.py"
    spec = importlib.util.spec_from_file_location("suite_compiles", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    output = "2.50s call     tests/test_x.py::test_y\n0.50s setup    tests/test_x.py::test_y\n1 passed in 3.10s (0:00:03)\n"
    s = bench.summary(bench.read_logs(tmp_path), bench.durations(output), output, top=5)
    assert (s["passed"], s["wall_s"], s["test_seconds_summed"]) == (1, 3.1, 3.0)
    assert s["programs"][0]["program"] == "<lambda>" and s["programs"][0]["compiles"] == 1
    assert s["tests"][0]["test"] == "tests/test_x.py::test_y" and s["tests"][0]["compiles"] == 1
    assert s["files"][0] == {"file": "tests/test_x.py", "test_seconds": 3.0,
                             "jax_seconds": round(sum(r["s"] for r in records), 1)}
