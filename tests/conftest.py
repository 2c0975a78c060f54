"""8 CPU devices for every test and fast compiles (jaxpar.testing.fast_compiles: one
compilation cache for the run, XLA's CPU backend unoptimised), set before JAX starts, for
the processes tests start too; tiny models only. After every test: no process it started is
still running."""

import atexit
import hashlib
import os
import pathlib
import pickle
import shutil
import signal
import tempfile
import uuid

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.testing import COMPILE_LOG, CompileLog, fast_compiles, force_cpu_devices  # noqa: E402

fast_compiles()
force_cpu_devices(8)
# benchmarks/suite_compiles.py: each trace, lowering and compile of the run, by test
COMPILES = CompileLog(os.environ[COMPILE_LOG]) if os.environ.get(COMPILE_LOG) else None

# The single-device reference runs of this test run, shared by its xdist workers (the first
# process makes the folder; the workers it starts inherit it). Never kept from one run to the
# next: a reference made by other code would compare against the wrong thing.
REFERENCES = "JAXPAR_TEST_REFERENCES"
if REFERENCES not in os.environ:
    os.environ[REFERENCES] = tempfile.mkdtemp(prefix="jaxpar-test-references-")
    atexit.register(shutil.rmtree, os.environ[REFERENCES], ignore_errors=True)

import pytest  # noqa: E402

from jaxpar.config import Config, TrainConfig  # noqa: E402
from jaxpar.testing import reference_run  # noqa: E402
from jaxpar.models.llama import LlamaConfig  # noqa: E402


@pytest.fixture
def tiny_llama() -> Config:
    """fp32 so sharded runs can be compared with the single-device run to 1e-5."""
    return Config(
        model=LlamaConfig(vocab_size=128, embed=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8, mlp=64),
        train=TrainConfig(steps=3, global_batch=16, seq_len=16, compute_dtype="float32"),
    )


@pytest.fixture(scope="session")
def reference():
    """reference(config) -> the single-device Run, computed once per config per session."""
    runs: dict = {}
    shared = pathlib.Path(os.environ[REFERENCES])

    def get(config):
        key = repr(config)
        if key not in runs:
            runs[key] = shared_run(shared / f"{hashlib.sha256(key.encode()).hexdigest()}.pkl", config)
        return runs[key]

    return get


def shared_run(path: pathlib.Path, config):
    """The reference run of `config`, computed by whichever xdist worker asks first and read
    by the others from the run's cache. A worker asking while another computes it waits for
    it (a lock beside the file): the longest tests run first on both workers, and the
    layouts of one model ask for its reference at once."""
    import fcntl

    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return pickle.loads(path.read_bytes())
        run = reference_run(config)
        partial = path.with_suffix(f".{os.getpid()}")
        partial.write_bytes(pickle.dumps(run))
        partial.rename(path)  # whole or absent
        return run


# ------------------------------------------------------------------ the tiers, and the longest tests first

# Each test lives in the folder of its tier and carries the tier's marker, so `pytest -m unit`
# runs the unit tier (docs/testing.md, "The tiers"). The smoke subset is marked where each of its
# tests is written (@pytest.mark.smoke, or a parameter's marks=pytest.mark.smoke).
TESTS = pathlib.Path(__file__).resolve().parent
TIERS = {  # folder -> marker
    "unit": "unit",  # nothing compiles a training step: config, checks, rules, schedules, data, formulas, kernels
    "equivalence": "equivalence",  # trainers built and their steps compiled: layouts against one device, golden logits
    "scenarios": "scenario",  # processes started, killed, resumed, preempted; jaxpar train end to end
}

# The longest tests (10-45 s each on 2 cores: several processes, or many compiles) run
# first, so the workers end together instead of one finishing a long test alone.
LONGEST_FIRST = (
    "tests/scenarios/test_distributed.py::test_sigterm_saves_at_an_agreed_step",
    "tests/scenarios/test_text_data.py::test_text_run_resumed_on_two_processes",
    "tests/scenarios/test_matrix.py::test_the_cells_that_abort_most_compile_in_forked_children",
    "tests/scenarios/test_checkpoint.py::test_killed_anywhere_and_resumed",
    "tests/equivalence/test_deepseek.py::test_latent_attention_and_deepseek_moe_equal_single_device",
    "tests/equivalence/test_gemma3.py::test_local_and_global_layers_in_an_interleaved_pipeline",
    "tests/equivalence/test_pipeline.py::test_pipelined_training_equals_single_device",
    "tests/equivalence/test_pipeline.py::test_llama_pp_recipe_trains_in_bfloat16",
    "tests/equivalence/test_fp8.py::test_fp8_loss_within_one_percent_of_bf16",
    "tests/scenarios/test_distributed.py::test_a_process_that_stops_responding",
    "tests/equivalence/test_gradient_compression.py::test_cross_host_bytes_are_the_formula",
    "tests/equivalence/test_your_model.py::test_explain_accounts_for_a_user_model_on_a_pipeline",
    "tests/scenarios/test_distributed.py::test_each_process_reads_only_its_rows",
    "tests/scenarios/test_finetune.py::test_a_hugging_face_llama_is_fine_tuned",
    "tests/equivalence/test_preference.py::test_dpo_starts_at_log_2",
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark each test with its folder's tier; a test module outside the tier folders is an
    error (every test has a tier). The LONGEST_FIRST tests go to the front, in that order (a
    stable sort: every worker collects the same order)."""
    for item in items:
        try:
            folder = pathlib.Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:  # not under tests/: no tier to give it
            continue
        if folder not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in one of tests/{{{','.join(TIERS)}}}/ "
                                    "(docs/testing.md, \"The tiers\")")
        item.add_marker(TIERS[folder])

    def rank(item) -> int:
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))

    items.sort(key=rank)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if COMPILES is not None:
        COMPILES.test = item.nodeid
    yield


# ------------------------------------------------------------------ no process left behind

TAG = "JAXPAR_TEST_TAG"


def _tagged(tag: str) -> dict[int, str]:
    """pid -> command line of every other process whose environment carries TAG=tag (Linux)."""
    needle, found = f"{TAG}={tag}".encode() + b"\0", {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read():
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        found[int(pid)] = c.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
    found.pop(os.getpid(), None)
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Every process a test starts inherits a tag unique to the test; one still running when
    the test ends (a launcher whose check failed, a child in its own session) is killed and
    the test errors, naming it: the next tests, and whatever runs after the suite, must not
    share the cores with it."""
    if not os.path.exists("/proc/self/environ"):
        yield
        return
    tag = os.environ[TAG] = uuid.uuid4().hex
    yield
    left = _tagged(tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"processes still running after the test (killed now): {left}"
