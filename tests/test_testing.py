"""jaxpar.testing.fast_compiles: one compilation cache for the run, shared through the
environment, and XLA's CPU backend at optimisation level 0 unless XLA_FLAGS chose a level."""

import os

import jax
import jax.numpy as jnp

from jaxpar.testing import CACHE_DIR, fast_compiles


def test_one_cache_for_the_run_reached_by_this_process_and_its_children():
    cache = fast_compiles()  # again: conftest called it first
    assert cache == os.environ[CACHE_DIR] == os.environ["JAX_COMPILATION_CACHE_DIR"] == jax.config.jax_compilation_cache_dir
    before = set(os.listdir(cache))
    jax.jit(lambda x: x * 3.0 + 0.25)(jnp.arange(7.0)).block_until_ready()  # a program no other test compiles
    assert set(os.listdir(cache)) - before, "nothing was written to the cache"
    assert os.environ["XLA_FLAGS"].count("--xla_backend_optimization_level=0") == 1  # idempotent


def test_a_chosen_optimisation_level_is_kept(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2")
    fast_compiles()
    assert os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=2"
