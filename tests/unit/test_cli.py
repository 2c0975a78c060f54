"""The command line (jaxpar.commands): parsing, refusals, paths, the version line. A whole
`jaxpar train` run is tests/scenarios/test_cli.py."""

import pytest

from jaxpar.commands import main
from jaxpar.recipes import resolve_config


def test_mesh_overrides_replace_the_recipe_layout():
    assert resolve_config("llama", [], 8).mesh.fsdp == 2
    c = resolve_config("llama", ["mesh.data=8"], 8)
    assert (c.mesh.data, c.mesh.fsdp, c.mesh.tensor) == (8, 1, 1)
    one = resolve_config("llama", [], 1)
    assert (one.mesh.fsdp, one.mesh.tensor) == (1, 1)


def test_unknown_key_is_rejected_with_valid_keys(capsys):
    assert main(["train", "llama", "--set", "train.stpes=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'train.stpes': train has no 'stpes' (did you mean train.steps?); valid keys: train.steps" in err


def test_unknown_recipe(capsys):
    assert main(["train", "nope"]) == 2
    assert "unknown recipe 'nope'; use one of deepseek, gemma3, llama, llama_long, llama_pp, mistral, mlp_dp, moe, qwen3, qwen3_moe" in capsys.readouterr().err


def test_print_config(capsys):
    assert main(["train", "mlp_dp", "--print-config"]) == 0
    assert "train.microbatches=4" in capsys.readouterr().out


def test_the_paths_sample_and_export_read_back_are_recorded_absolute(tmp_path, monkeypatch):
    """data.tokenizer and checkpoint.init_from, given relative (as the docs' hf:tests/golden/...
    does), are made absolute at train time, so a run's checkpoint reads them from any folder."""
    import pathlib

    root = pathlib.Path(__file__).parents[2]
    monkeypatch.chdir(root)
    config = resolve_config("hf:tests/golden/llama_tied", ["data.tokenizer=tests/golden/llama_tied/tokenizer.json"], 8)
    assert config.data.tokenizer == str(root / "tests/golden/llama_tied/tokenizer.json")
    assert config.checkpoint.init_from == str(root / "tests/golden/llama_tied")
    monkeypatch.chdir(tmp_path)
    config = resolve_config("llama", ["checkpoint.init_from=hf/model", "data.tokenizer="], 8)
    assert (config.checkpoint.init_from, config.data.tokenizer) == (str(tmp_path / "hf/model"), "")  # unset stays unset


@pytest.mark.parametrize("bad", ["--cpu-devices=0"])
def test_bad_cpu_devices(bad, capsys):
    assert main(["train", "llama", bad]) == 2


def test_png_paths_are_checked_before_compile(tmp_path, capsys):
    """--png under a file is one line before anything compiles; missing folders are made."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["explain", "llama_pp", "--png", str(blocker / "x.png")]) == 2
    assert "cannot create the folder" in capsys.readouterr().err
    assert main(["schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--png", str(tmp_path / "new" / "x.png")]) == 0
    assert (tmp_path / "new" / "x.png").is_file()


def test_jaxpar_warnings_print_as_one_line():
    """The CLI prints jaxpar's warnings without Python's file and source line; others as usual."""
    from jaxpar.commands.common import one_line_warning
    from jaxpar.loop.checkpoint import UnreadableCheckpoint

    assert one_line_warning("step 2 cannot be read", UnreadableCheckpoint, "loop.py", 57) == (
        "jaxpar: warning: step 2 cannot be read\n")
    assert "loop.py:57" in one_line_warning("other", UserWarning, "loop.py", 57)


def test_version_names_jax_jaxlib_and_the_checkout_s_commit(capsys):
    import pathlib
    import shutil
    import subprocess
    from importlib.metadata import version

    with pytest.raises(SystemExit):
        main(["--version"])
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"jaxpar {version('jaxpar')}") and "\n" not in out
    assert f" | jax {version('jax')} | jaxlib {version('jaxlib')} | Python " in out
    root = pathlib.Path(__file__).resolve().parents[2]
    if (root / ".git").exists() and shutil.which("git"):
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        assert f"(commit {head.strip()[:12]})" in out


def test_the_commit_is_read_from_the_git_files(tmp_path):
    """A branch's ref file, packed refs, a detached HEAD, a worktree's .git file; no .git: none."""
    from jaxpar.commands import checkout_commit

    a, b, c = "a" * 40, "b" * 40, "c" * 40
    git = tmp_path / "repo" / ".git"
    (git / "refs/heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs/heads/main").write_text(a + "\n")
    assert checkout_commit(git.parent) == a
    (git / "refs/heads/main").unlink()
    (git / "packed-refs").write_text(f"# pack-refs with: peeled\n{c} refs/heads/other\n{b} refs/heads/main\n")
    assert checkout_commit(git.parent) == b
    worktree = tmp_path / "tree"
    (git / "worktrees/tree").mkdir(parents=True)
    (git / "worktrees/tree/HEAD").write_text("ref: refs/heads/other\n")
    (git / "worktrees/tree/commondir").write_text("../..\n")
    worktree.mkdir()
    (worktree / ".git").write_text(f"gitdir: {git / 'worktrees/tree'}\n")
    assert checkout_commit(worktree) == c
    (git / "HEAD").write_text(a + "\n")
    assert checkout_commit(git.parent) == a
    assert checkout_commit(tmp_path / "elsewhere") is None


def test_plan_draws_its_bar_only_on_a_terminal(monkeypatch, capsys):
    """Into a pipe or a log (stderr not a terminal): no carriage-return bar, one plain line."""
    import sys

    import jaxpar.plan

    asked = []

    def plan(*args, progress, **kwargs):
        asked.append(progress)
        return [], {"hardware": jaxpar.plan.Hardware()}

    monkeypatch.setattr(jaxpar.plan, "plan", plan)
    monkeypatch.setattr(jaxpar.plan, "render", lambda *args: "the table")
    command = ["plan", "--model", "llama", "--devices", "8", "--hbm-gb", "1"]
    assert main(command) == 0
    captured = capsys.readouterr()
    assert asked == [False] and "\r" not in captured.err and captured.out.endswith("the table\n")
    assert captured.err.startswith("compiling the 4 fastest estimates of llama's layouts, each remat policy's fastest "
                                   "first (up to 12 until one fits)")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert main(command) == 0 and asked[-1] is True and "compiling" not in capsys.readouterr().err
    assert main(command + ["--json"]) == 0 and asked[-1] is False


def test_the_start_line_names_what_the_mesh_does_not_show():
    """train's start line: ZeRO's stage and offloads, sequence parallelism only where tensor
    splits, context parallelism's kernel, remat; nothing of these for plain data parallel."""
    from jaxpar.commands.train import _strategies_summary
    from jaxpar.train import build

    def line(*overrides):
        return _strategies_summary(build(resolve_config("llama", list(overrides), 8)))

    assert line("parallel.zero.stage=3", "model.remat=full") == "zero-3 | sequence parallel | remat full | "
    assert line("mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1") == ""  # sequence_parallel on, tensor=1: no effect
    assert line("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.context=8",
                "parallel.context.impl=ulysses") == "context ulysses | "


def test_a_set_value_without_its_equals_sign_is_named(capsys):
    """`--set mesh.tensor 4` reads as KEY VALUE to a person and as a stray "4" to argparse."""
    assert main(["train", "llama", "--set", "mesh.tensor", "4"]) == 2
    assert capsys.readouterr().err.strip() == ("jaxpar: error: --set mesh.tensor: an override is KEY=VALUE in one "
                                               "word; write --set mesh.tensor=4")
