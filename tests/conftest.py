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


# ------------------------------------------------------------------ the smoke subset

SMOKE = {  # `pytest -m smoke`: each strategy once, for the inner loop; the whole suite is the net
    "test_llama_equivalence.py::test_layout_equals_single_device[dp_fsdp_tp_sp_two_hosts_loss_chunks]": "data, FSDP, tensor, sequence",
    "test_zero.py::test_zero_stage_equals_single_device[zero3_dp4_tp2_sp]": "ZeRO-3",
    "test_zeropp.py::test_hpz_equals_single_device": "ZeRO++ hpZ",
    "test_zeropp.py::test_quantized_all_gather_equals_reference[source0-target0]": "int8 collectives",
    "test_zeropp.py::test_optimizer_offload_equals_single_device_and_rests_on_host": "host offload",
    "test_gradient_compression.py::test_lossless_settings_equal_the_single_device_run[topk_zero3]": "gradient compression",
    "test_context_training.py::test_context_parallel_training_equals_single_device[ring]": "context: ring",
    "test_context_training.py::test_context_parallel_training_equals_single_device[ulysses_tp_sp_fsdp]": "context: Ulysses",
    "test_moe_training.py::test_dropless_routing_equals_single_device[expert4_tensor2]": "expert parallel",
    "test_pipeline.py::test_pipelined_training_equals_single_device[1f1b_dp_tp_sp_zero1_collective_matmul]": "pipeline, 1F1B",
    "test_pipeline.py::test_executor_equals_reference[interleaved-2-4-2]": "pipeline, interleaved",
    "test_pipeline.py::test_executor_equals_reference[zb-h1-4-5-1]": "pipeline, zero bubble",
    "test_collective_matmul.py::test_equals_whole_array_matmul[bidirectional-row-4]": "collective matmul",
    "test_training.py::test_loss_is_normalised_by_tokens_not_microbatches": "gradient accumulation",
    "test_training.py::test_bf16_compute_stays_close_to_fp32": "mixed precision",
    "test_zero.py::test_remat_policy_equals_single_device[selective]": "remat",
    "test_xla_options.py::test_step_with_the_overlap_preset_equals_the_single_device_run": "XLA overlap preset",
    "test_inspect.py::test_zero_memory_and_traffic_match_the_paper[3]": "explain",
    "test_checkpoint.py::test_resumed_run_repeats_the_uninterrupted_one_bitwise[float32-compute]": "checkpoints",
    "test_distributed.py::test_each_process_reads_only_its_rows": "several processes",
    "test_checks.py::test_base_configs_pass_every_rule[llama]": "config checks",
    "test_cli.py::test_train_writes_metrics": "jaxpar train",
}


# The longest tests (10-45 s each on 2 cores: several processes, or many compiles) run
# first, so the workers end together instead of one finishing a long test alone.
LONGEST_FIRST = (
    "tests/test_distributed.py::test_sigterm_saves_at_an_agreed_step",
    "tests/test_text_data.py::test_text_run_resumed_on_two_processes",
    "tests/test_matrix.py::test_the_cells_that_abort_most_compile_in_forked_children",
    "tests/test_checkpoint.py::test_killed_anywhere_and_resumed",
    "tests/test_deepseek.py::test_latent_attention_and_deepseek_moe_equal_single_device",
    "tests/test_gemma3.py::test_local_and_global_layers_in_an_interleaved_pipeline",
    "tests/test_pipeline.py::test_pipelined_training_equals_single_device",
    "tests/test_pipeline.py::test_llama_pp_recipe_trains_in_bfloat16",
    "tests/test_fp8.py::test_fp8_loss_within_one_percent_of_bf16",
    "tests/test_distributed.py::test_a_process_that_stops_responding",
    "tests/test_gradient_compression.py::test_cross_host_bytes_are_the_formula",
    "tests/test_your_model.py::test_explain_accounts_for_a_user_model_on_a_pipeline",
    "tests/test_distributed.py::test_each_process_reads_only_its_rows",
    "tests/test_finetune.py::test_a_hugging_face_llama_is_fine_tuned",
    "tests/test_preference.py::test_dpo_starts_at_log_2",
)


def pytest_collection_modifyitems(config, items):
    """Mark the SMOKE tests. Collecting the whole suite, a listed test that does not exist
    (renamed, removed) is an error, so the subset cannot shrink unseen. The LONGEST_FIRST
    tests go to the front, in that order (a stable sort: every worker collects the same order)."""
    def rank(item) -> int:
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))

    items.sort(key=rank)
    collected = {item.nodeid.removeprefix("tests/"): item for item in items}
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not (
        config.option.keyword or config.getoption("lf", False))
    missing = sorted(SMOKE.keys() - collected.keys())
    if whole_suite and missing:
        raise pytest.UsageError(f"tests/conftest.py SMOKE names tests that do not exist: {missing}")
    for nodeid in SMOKE.keys() & collected.keys():
        collected[nodeid].add_marker(pytest.mark.smoke)


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
