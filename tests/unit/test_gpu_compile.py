"""The GPU compile report (benchmarks/gpu_compile.py): which recipes it compiles, how an error
becomes an outcome, and its one-line rows; nothing compiles (that needs the CUDA plugin and
about an hour)."""

import importlib.util
import pathlib
import sys

from jaxpar.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("jaxpar_benchmarks_gpu_compile", ROOT / "benchmarks" / "gpu_compile.py")
gpu_compile = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpu_compile
_spec.loader.exec_module(gpu_compile)


def test_every_recipe_file_and_every_golden_checkpoint_is_compiled():
    names = gpu_compile.recipes_to_compile()
    shipped = {p.stem for p in (ROOT / "recipes").glob("*.py") if p.stem != "__init__"}
    weights = {p.name for p in (ROOT / "tests" / "golden").iterdir() if list(p.glob("model*.safetensors"))}
    assert shipped and shipped <= set(names)
    assert {f"hf:tests/golden/{w}" for w in weights} <= set(names)
    families = ("llama_tied", "llama_untied", "mixtral", "qwen3", "qwen3_moe", "qwen3_tied", "gemma3", "mistral",
                "deepseek_v3", "deepseek_v3_plain")
    assert {f"hf:tests/golden/{f}" for f in families} <= set(names)
    # not checkpoints: chat fixtures, a PEFT adapter (no config.json; hf: refuses them)
    assert "hf:tests/golden/chat" not in names and "hf:tests/golden/peft_llama_tied" not in names
    assert len(names) == len(set(names)) == len(shipped) + len([p for p in (ROOT / "tests" / "golden").iterdir()
                                                                 if (p / "config.json").is_file()])


def test_a_config_error_before_compile_is_refused_anything_else_failed():
    def raised(e):
        try:
            raise e
        except Exception as caught:  # noqa: BLE001
            return caught

    refused = gpu_compile.failure(raised(ConfigError("train.matmul_dtype=fp8: no\nsecond line")), "build")
    assert (refused["outcome"], refused["phase"]) == ("REFUSED", "build")
    assert refused["message"] == "ConfigError: train.matmul_dtype=fp8: no"  # its first line only
    assert refused["where"].startswith("tests/unit/test_gpu_compile.py:")
    assert gpu_compile.failure(raised(ConfigError("x")), "trace")["outcome"] == "REFUSED"
    assert gpu_compile.failure(raised(ConfigError("x")), "compile")["outcome"] == "FAILED"
    failed = gpu_compile.failure(raised(ValueError("attend: cudnn takes values of ...")), "trace")
    assert (failed["outcome"], failed["message"]) == ("FAILED", "ValueError: attend: cudnn takes values of ...")


def test_a_child_that_dies_keeps_what_it_told_and_the_phase_it_died_in():
    told = gpu_compile.TOLD
    output = "\n".join([told + '{"layout": "stage=2", "attention": "reference", "phase": "trace"}', "noise",
                        told + '{"layout": "stage=2", "attention": "reference", "phase": "compile"}', "F0101 boom"])
    known, rest = gpu_compile.known_before_death(output)
    assert known == {"layout": "stage=2", "attention": "reference", "phase": "compile"}
    assert rest == "noise\nF0101 boom"  # what the dead child said, for its one-line cause
    assert gpu_compile.known_before_death("Segmentation fault")[0] == {"phase": "start"}


def test_a_kernel_the_row_resolved_to_but_the_program_lacks_is_named():
    ok = {"attention": "cudnn", "matmul_dtype": "fp8", "custom_calls": ["__cudnn$fmhaSoftmax"],
          "gemms": {"bf16 x bf16": 3, "f8e4m3fn x f8e5m2": 56}}
    assert gpu_compile.missing_kernels(ok) == []
    lacking = gpu_compile.missing_kernels({**ok, "custom_calls": [], "gemms": {"bf16 x bf16": 40}})
    assert len(lacking) == 2 and "cuDNN" in lacking[0] and "FP8" in lacking[1]
    assert gpu_compile.missing_kernels({**ok, "attention": "ring/jax", "matmul_dtype": "compute", "gemms": {}}) == []
    offload = {**ok, "remat": "offload", "host_temp_bytes": 262144}
    assert gpu_compile.missing_kernels(offload) == []
    assert "host memory" in gpu_compile.missing_kernels({**offload, "host_temp_bytes": 0})[0]


def test_each_row_is_one_line_under_the_header():
    base = {"recipe": "deepseek", "variant": "default", "layout": "data=2 expert=4", "attention": "cudnn"}
    rows = [{**base, "outcome": "OK", "compile_s": 61.25, "memory_bytes": 3 * 2**20, "missing": []},
            {**base, "outcome": "OK", "compile_s": 1.0, "memory_bytes": 1, "missing": ["no FP8 GEMM"]},
            {**base, "outcome": "REFUSED", "phase": "build", "message": "ConfigError: train.compute_dtype=float32"},
            {"recipe": "x", "variant": "fp8", "outcome": "FAILED", "phase": "crash", "message": "compile aborted"}]
    lines = [gpu_compile.line(r) for r in rows]
    assert all("\n" not in t for t in lines)
    assert lines[0].split() == ["deepseek", "default", "data=2", "expert=4", "cudnn", "61.2s", "3.0Mi", "OK"]
    assert lines[1].endswith("OK; no FP8 GEMM")
    assert lines[2].endswith("REFUSED (build): ConfigError: train.compute_dtype=float32")
    assert lines[3].split()[:6] == ["x", "fp8", "?", "?", "-", "-"]
    assert lines[3].endswith("FAILED (crash): compile aborted")
    # the columns line up with the header's
    assert lines[0].index("cudnn") == gpu_compile.HEADER.index("attention")


def test_the_docs_table_has_a_row_per_recipe_and_a_column_per_variant():
    ok = {"outcome": "OK", "compile_s": 14.6, "memory_bytes": 16 * 2**20, "missing": [], "layout": "data=8",
          "attention": "cudnn"}
    rows = [{**ok, "recipe": "llama", "variant": "default"},
            {**ok, "recipe": "llama", "variant": "fp8", "missing": ["x"]},
            {"recipe": "mlp_dp", "variant": "fp8", "outcome": "REFUSED", "phase": "build",
             "message": "ConfigError: no"}]
    table = gpu_compile.markdown(rows)
    assert table[:4] == ["| recipe | layout | attention | default | fp8 |", "|---|---|---|---|---|",
                         "| llama | data=8 | cudnn | 15 s, 16.0 MiB | 15 s, 16.0 MiB (see below) |",
                         "| mlp_dp | ? | ? |  | **REFUSED** |"]
    assert table[5:] == ["- llama fp8: OK; x", "- mlp_dp fp8: REFUSED (build): ConfigError: no"]
