"""`jaxpar plan` (jaxpar.plan): the layouts it considers can all run, the formula estimates
order them sensibly, the roofline is the stated arithmetic, and the best plan it prints
trains as printed.

Here the compiles in child processes; the estimates and the arithmetic: tests/unit/test_plan.py."""

import math

from jaxpar.config import apply_overrides
from jaxpar.plan import Hardware, plan, render


def test_plan_compiles_the_best_layouts_and_its_overrides_train(tiny_llama):
    """A tiny Llama on 8 devices as 2 hosts of 4: the fastest estimate is compiled, fits,
    and its --set list trains (several compiled, one aborting: the next test)."""
    import jax

    from jaxpar.train import build
    from jaxpar.loop.run import run

    planned, facts = plan(tiny_llama.model, jax.devices(), hbm_gb=1.0, hosts=2, seq_len=16, global_batch=16,
                          compile_top=1, progress=False)
    assert facts["compiled"] == 1 and facts["candidates"] > 20
    best = planned[0]
    assert best.compiled and 0 < best.memory <= facts["budget_bytes"]
    assert 0 < best.prediction["mfu"] < 1
    text = render(planned, facts, 1.0, "jaxpar train tiny --set train.global_batch=16 --set train.seq_len=16")
    assert "best: predicted" in text
    command = next(line.strip() for line in text.splitlines() if line.strip().startswith("jaxpar train tiny"))
    sets = command.split("--set ")[1:]  # the command as printed, batch and sequence included, trains
    assert [s.strip() for s in sets[2:]] == best.overrides
    config = apply_overrides(tiny_llama, [s.strip() for s in sets] + ["train.steps=1"])
    history = run(build(config), progress=False)
    assert len(history) == 1 and math.isfinite(history[0]["loss"])


def test_a_compile_that_aborts_is_reported_failed_and_the_plan_goes_on(tiny_llama, tmp_path, monkeypatch):
    """jaxpar.plan.compile_one: each layout compiles in a child process. Here the first child
    dies as XLA does on a failed CHECK (its fatal line, a stack trace, SIGABRT); that layout
    is reported failed with XLA's line, and the next one compiles and ranks first."""
    import sys

    from jaxpar.plan import compile_one

    first = tmp_path / "first-compile"
    crash = (f"import os, sys\nif not os.path.exists({str(first)!r}):\n    open({str(first)!r}, 'w').close()\n"
             "    sys.stderr.write('F0101 00:00:00.000000 1 spmd_partitioner.cc:1] Check failed: a stand-in\\n'\n"
             "                     '*** Check failure stack trace: ***\\n    @ 0x7f0000000000 (unknown)\\n')\n"
             "    os.abort()\n"
             "from jaxpar.plan.compile_one import main\nsys.exit(main(sys.argv[1:]))\n")
    monkeypatch.setattr(compile_one, "COMMAND", [sys.executable, "-c", crash])
    import jax

    planned, facts = plan(tiny_llama.model, jax.devices(), hbm_gb=1.0, hosts=2, seq_len=16, global_batch=16,
                          compile_top=1, progress=False)
    assert facts["compiled"] == 2 and facts["failed"] == 1
    assert planned[0].compiled and planned[0].memory <= facts["budget_bytes"]
    assert planned[-1].failed == "compile aborted (SIGABRT) in XLA or the runtime: Check failed: a stand-in"
    assert not planned[-1].compiled and not planned[-1].refused
    text = render(planned, facts, 1.0)
    assert "(1 failed)" in text and "failed: compile aborted (SIGABRT)" in text and "best: predicted" in text


def test_a_compile_that_overruns_or_exits_without_a_result_says_so(monkeypatch):
    import sys

    import jax

    from jaxpar.plan import compile_one

    args = (None, [], jax.devices(), 16, 16, Hardware(), 0.0)
    monkeypatch.setattr(compile_one, "COMMAND", [sys.executable, "-c", "import time; time.sleep(60)"])
    assert compile_one.compile_in_child(*args, timeout_s=0.5) == {
        "failed": "compile took longer than 0.5 s (--compile-timeout); stopped it"}
    monkeypatch.setattr(compile_one, "COMMAND", [sys.executable, "-c", "raise MemoryError('no room')"])
    assert compile_one.compile_in_child(*args, timeout_s=60) == {
        "failed": "compile process exited with status 1 and no result: MemoryError: no room"}


def test_the_dots_formula_is_what_the_layer_loop_keeps():
    """The growth from one sequence to two of the forward layer loop's stacks, a layer's
    share, under remat dots with the blockwise attention the planner compiles on CPUs: the
    formula's matmul outputs, plus the kernel's row statistics and one more stream-wide
    array the CPU stand-in keeps (12% here; the 0.9B H100 program with cuDNN's attention
    keeps 673 MiB a layer where the formula says 672)."""
    import jax

    from jaxpar.config import Config, TrainConfig
    from jaxpar.inspect import formulas
    from jaxpar.inspect.hlo import loop_stacks
    from jaxpar.models.llama import LlamaConfig
    from jaxpar.train import build

    model = LlamaConfig(vocab_size=128, embed=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, mlp=256,
                        remat="dots")
    stacks = []
    for batch in (1, 2):
        config = Config(model=model, train=TrainConfig(global_batch=batch, seq_len=64, compute_dtype="bfloat16"))
        trainer = build(apply_overrides(config, ["parallel.attention=flash"]), jax.devices()[:1])
        text = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile().as_text()
        stacks.append(loop_stacks(text, 2)[0])
    kept = (stacks[1] - stacks[0]) / 2
    formula = formulas.matmul_outputs_bytes_per_layer(64, 1, 128, 2 * 128 + 2 * 64, 2 * 256)
    assert formula <= kept <= 1.15 * formula
