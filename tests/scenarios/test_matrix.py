"""The composition matrix (benchmarks/matrix.py): its cells, and the few that matter most for
XLA aborts compiled here, each in a forked child, so an abort fails one test with its signal
and stderr instead of killing pytest. The whole matrix trains every cell through the CLI
and compares it with one device; it takes half an hour, so it is a benchmark, not a test."""

import importlib.util
import itertools
import json
import pathlib
import signal
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("jaxpar_benchmarks_matrix", ROOT / "benchmarks" / "matrix.py")
matrix = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = matrix  # dataclasses look their module up there
_spec.loader.exec_module(matrix)

# The cells most likely to abort in XLA's partitioner: a pipeline's shard_map around fsdp
# gathers and tensor collectives, a context kernel nested inside pipeline stages, expert
# all-to-alls beside tensor and fsdp, and ZeRO-3 gathers under sequence parallelism.
# Left to other tests: zero3 x tensor+sp (tests/equivalence/test_zero.py trains ZeRO-3 over data x
# tensor+sp against one device) and 1f1b x fsdp x tensor+sp (tests/equivalence/test_pipeline.py trains
# stage x fsdp x tensor at the llama recipe's shape, where the partitioner once aborted).
COMPILED = ("interleaved x ring x tensor+sp", "fsdp x expert x tensor")
TIMEOUT_S = 120  # per cell

# One interpreter imports JAX and jaxpar once (no backend started), then forks a child per
# cell that resolves the cell's config as `jaxpar train` does, builds the trainer on the
# cell's devices and compiles the step on abstract inputs (nothing runs). The parent
# reports how each child ended: 0 compiled, 2 a ConfigError, 1 a traceback, or a signal.
FORK_EACH = r"""
import json, os, resource, sys, time, traceback
resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))  # an abort leaves no core file
from jaxpar.mesh import force_cpu_devices
force_cpu_devices(8)
import jax  # noqa: F401
from jaxpar.recipes import resolve_config
from jaxpar.errors import ConfigError
from jaxpar.train import build
import jaxpar.models.llama, jaxpar.models.moe  # noqa: F401

def compile_cell(recipe, devices, overrides):
    config = resolve_config(recipe, overrides, devices)
    trainer = build(config, jax.devices()[:devices])
    trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()

timeout = float(sys.argv[1])
for spec in sys.argv[2:]:
    cell = json.loads(spec)
    err_path = cell["log"]
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        try:
            compile_cell(cell["recipe"], cell["devices"], cell["overrides"])
        except ConfigError as e:
            print(f"jaxpar: error: {e}", file=sys.stderr, flush=True)
            os._exit(2)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stderr.flush()
        os._exit(0)
    status = None
    while time.perf_counter() - t0 < timeout:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        status = None
    if status is None:
        ended = {"timeout": timeout}
    elif os.WIFSIGNALED(status):
        ended = {"signal": os.WTERMSIG(status)}
    else:
        ended = {"exit": os.WEXITSTATUS(status)}
    print(json.dumps({"cell": cell["name"], "seconds": round(time.perf_counter() - t0, 1), **ended}), flush=True)
"""


def test_every_pair_of_axes_is_a_cell_once_and_no_cell_doubles_an_axis():
    cells = matrix.cells()
    names = [c.name for c in cells]
    assert len(names) == len(set(names))
    for c in cells:
        assert len(set(c.axes)) == len(c.axes), c.name  # no two strategies of a cell on one axis
        assert c.devices == matrix.DEGREE ** len(c.strategies)
        sizes = [int(o.split("=")[1]) for o in c.overrides if o.split("=")[0] in {f"mesh.{a}" for a in matrix.AXES}]
        assert len(sizes) == len(matrix.AXES) and sizes.count(matrix.DEGREE) == len(c.strategies)  # the whole mesh named
        assert ("parallel.tensor.sequence_parallel=true" in c.overrides) == ("tensor+sp" in c.strategies)
        plain = "moe" if "expert" in c.strategies else "llama"
        variant = matrix.VARIANTS.get(c.family)
        assert c.recipe == (variant[0] if variant else plain if c.family in ("", "lora") else c.family)
        assert ("lora.rank=4" in c.overrides) == (c.family == "lora")
        assert all(o in c.overrides for o in (variant[1] if variant else ()))
    pairs = {frozenset(c.strategies) for c in cells if len(c.strategies) == 2 and not c.family}
    expected = {frozenset(p) for p in itertools.combinations(matrix.BY_NAME, 2)
                if matrix.BY_NAME[p[0]].axis != matrix.BY_NAME[p[1]].axis}
    assert pairs == expected and len(expected) == 112  # 17 strategies on 6 axes
    triples = {frozenset(c.strategies) for c in cells if len(c.strategies) == 3}
    for wanted in ({"1f1b", "fsdp", "tensor"}, {"zb-h1", "ring", "tensor+sp"}, {"fsdp", "ulysses", "tensor+sp"},
                   {"expert", "tensor", "fsdp"}):
        assert wanted in triples
    deepseek = {c.strategies: c for c in cells if c.family == "deepseek"}  # every pair with expert, two triples
    assert {frozenset(k) for k in deepseek if len(k) == 2} == {p for p in expected if "expert" in p}
    assert [o for o, _ in deepseek[("1f1b", "data", "expert")].adapted] == ["train.microbatches=2"]  # MTP on too
    # the window's cells (ring beside all but expert, and two more) and QK-norm's (tensor+sp beside all but expert)
    mistral = [c.strategies for c in cells if c.family == "mistral"]
    assert len(mistral) == 15 and all("ring" in s for s in mistral[:13]) and ("ulysses", "tensor") in mistral
    qwen3 = [c.strategies for c in cells if c.family == "qwen3"]
    assert len(qwen3) == 14 and all("tensor+sp" in s and "expert" not in s for s in qwen3)
    qwen3_moe = {frozenset(c.strategies) for c in cells if c.family == "qwen3_moe"}  # expert beside all but context
    assert qwen3_moe == {p for p in expected if "expert" in p and not p & {"ring", "ulysses", "allgather"}}
    gemma3 = [c.strategies for c in cells if c.family == "gemma3"]  # the ring beside all but expert, and three more
    assert len(gemma3) == 16 and all("ring" in s for s in gemma3[:13]) and ("interleaved", "tensor") in gemma3
    # key/value heads fewer than mesh.tensor: beside a strategy of each axis, every context kernel
    kv = [c for c in cells if c.family in ("kv1", "gemma3_1b")]
    assert {c.axes[0] for c in kv} == {"stage", "data", "fsdp", "context"} and all("tensor" in c.axes for c in kv)
    assert {s for c in kv for s in c.strategies} >= {"ring", "ulysses", "allgather", "tensor", "tensor+sp"}
    for name in COMPILED:
        assert name in names
    # DiLoCo's references keep its settings and its groups, each group on one device
    diloco = [c for c in cells if c.family.startswith("diloco")]
    assert len(diloco) == 10 and all(matrix.GROUPS_MESH in c.reference_key[1] for c in diloco)
    assert all(any(o.startswith("parallel.diloco.") for o in c.reference_key[1]) for c in diloco)
    assert not any(matrix.GROUPS_MESH in c.reference_key[1] for c in cells if not c.family.startswith("diloco"))
    pipelined = [c for c in cells if "stage" in c.axes]
    assert all("train.microbatches=2" in c.overrides for c in pipelined)
    assert all("parallel.pipeline.chunks=2" in c.overrides for c in pipelined if "interleaved" in c.strategies)


def test_list_prints_every_cell_and_runs_nothing(capsys):
    assert matrix.main(["--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"{len(matrix.cells())} cells"
    assert out[0].startswith("gpipe x data ") and "mesh.stage=2 mesh.data=2" in out[0]
    assert matrix.main(["--list", "--only", "zero3 x tensor"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0].strip() for line in out[:-1]] == ["zero3 x tensor", "zero3 x tensor+sp",
                                                                   "zero3 x tensor+sp [qwen3]", "zero3 x tensor+sp [lora]",
                                                                   "zero3 x tensor [kv1]", "zero3 x tensor [muon]",
                                                                   "zero3 x tensor [qk_clip]"]


def test_the_cells_that_abort_most_compile_in_forked_children(tmp_path):
    by_name = {c.name: c for c in matrix.cells()}
    specs = [json.dumps({"name": n, "recipe": by_name[n].recipe, "devices": by_name[n].devices,
                         "overrides": by_name[n].overrides, "log": str(tmp_path / f"{by_name[n].slug}.log")})
             for n in COMPILED]
    out = subprocess.run([sys.executable, "-c", FORK_EACH, str(TIMEOUT_S), *specs], capture_output=True, text=True,
                         timeout=TIMEOUT_S * len(COMPILED) + 60, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    ended = {r["cell"]: r for r in map(json.loads, out.stdout.splitlines())}
    problems = []
    for name in COMPILED:
        r = ended.get(name, {})
        if r.get("exit") == 0:
            continue
        log = (tmp_path / f"{by_name[name].slug}.log")
        tail = log.read_text()[-2500:] if log.exists() else ""
        how = (f"killed by {signal.Signals(r['signal']).name} (an XLA abort, most likely)" if "signal" in r else
               f"still compiling after {r['timeout']:.0f} s" if "timeout" in r else
               "refused by a ConfigError" if r.get("exit") == 2 else f"exit {r.get('exit')}")
        cell = by_name[name]
        command = matrix.repro(matrix.train_argv(cell.recipe, cell.devices, cell.overrides))
        problems.append(f"{name}: {how}; reproduce with `{command}`\n{tail}")
    assert not problems, "\n\n".join(problems)
