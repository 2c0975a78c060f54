"""The configuration catalogue (jaxpar.checks): every rule is broken by its own example and
by nothing else first, the base configs pass every rule, and the docs page is current."""

import dataclasses
import pathlib

import pytest

from jaxpar.checks import CATALOGUE, base_config, by_id, example_config, validate
from jaxpar.checks.docs import COMMAND, markdown
from jaxpar.checks.rule import BASES
from jaxpar.config import Config, flatten
from jaxpar.errors import ConfigError

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "config_checks.md"
EXAMPLES = [(rule, example) for rule in CATALOGUE for example in rule.examples]


@pytest.mark.parametrize(
    "rule, example", EXAMPLES, ids=[f"{r.id}:{' '.join(e)}" for r, e in EXAMPLES]
)
def test_example_breaks_its_rule(rule, example):
    with pytest.raises(ConfigError) as info:  # on the CPU but for a rule only a GPU breaks (Rule.platform)
        validate(example_config(rule, example), rule.devices, rule.platform)
    assert info.value.rule == rule.id, f"{' '.join(example)} was refused by {info.value.rule}: {info.value}"
    assert any(f in str(info.value) for f in rule.fields), f"{info.value} names none of {rule.fields}"


@pytest.mark.parametrize("name", [pytest.param(b, marks=pytest.mark.smoke) if b == "llama" else b for b in BASES])  # smoke: checks
def test_base_configs_pass_every_rule(name):
    sizes = validate(base_config(name), 8, "cpu")
    assert sizes["data"] == 8


def test_rules_are_unique_and_complete():
    ids = [rule.id for rule in CATALOGUE]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    keys = {k for name in BASES for k in flatten(base_config(name))}
    sections = {f.name for f in dataclasses.fields(Config)} | {"mesh.hosts"}
    for rule in CATALOGUE:
        assert rule.example and rule.summary and rule.fields, rule.id
        assert set(rule.fields) <= keys | sections, (rule.id, set(rule.fields) - keys - sections)
        assert by_id(rule.id) is rule
    assert CATALOGUE[0].needs == "devices" and all(r.needs != "devices" for r in CATALOGUE[1:])


def test_validate_skips_platform_rules_without_one():
    config = example_config(by_id("ragged-exchange-needs-gpu"))
    assert validate(config, 8)["data"] == 8  # no platform: the backend rules do not run
    with pytest.raises(ConfigError, match="ragged_all_to_all") as info:
        validate(config, 8, "cpu")
    assert info.value.rule == "ragged-exchange-needs-gpu"


def test_fp8_with_float32_compute_is_refused_for_gpus_alone():
    """The GPU compiler cannot compile FP8 matmuls writing float32 (an H100's deviceless
    compile of the llama recipe on 8 devices: "failed to legalize operation 'arith.mulf'"),
    where the CPU runs them (tests/equivalence/test_fp8.py's equivalence runs): refused for GPUs only,
    with the fix; bfloat16 compute passes."""
    config = example_config(by_id("fp8-float32-compute-on-gpu"))
    assert config.train.compute_dtype == "float32" and validate(config, 8, "cpu")["data"] == 8
    with pytest.raises(ConfigError, match=r"^train.matmul_dtype=fp8 with train.compute_dtype=float32 does not compile "
                                          r"for GPUs: .* set train.compute_dtype=bfloat16") as info:
        validate(config, 8, "gpu")
    assert info.value.rule == "fp8-float32-compute-on-gpu"
    assert validate(dataclasses.replace(config, train=dataclasses.replace(config.train, compute_dtype="bfloat16")), 8,
                    "gpu")["data"] == 8


def test_docs_page_is_current():
    assert COMMAND in DOCS.read_text().splitlines()[2]
    assert DOCS.read_text() == markdown(), f"docs/config_checks.md is stale; regenerate it: {COMMAND}"


# The model's own checks (jaxpar.model: its config's `check` and `mesh_divides`) on the MoE
# and MLP bases, which the catalogue's examples (on the llama base) do not reach.
MODEL_EXAMPLES = [
    ("moe", ["model.num_experts=0"], "model-contract", "model.num_experts=0"),
    ("moe", ["model.rope_theta=-1"], "model-contract", "model.rope_theta=-1.0 must be positive"),
    ("llama", ["model.norm_eps=0"], "model-contract", "model.norm_eps=0.0 must be positive"),
    ("moe", ["model.top_k=5"], "model-contract", "model.top_k=5"),
    ("moe", ["model.routing=random"], "choice-values", "model.routing='random'"),
    ("moe", ["model.capacity_factor=0"], "model-contract", "model.capacity_factor=0"),
    ("moe", ["model.aux_loss_weight=-1"], "model-contract", "model.aux_loss_weight=-1"),
    ("moe", ["mesh.context=2"], "model-contract", "model.routing=capacity"),
    ("moe", ["mesh.expert=8"], "mesh-divides-model", "mesh.expert=8 does not divide model.num_experts=4"),
    ("mlp", ["model.hidden=0"], "model-contract", "model.hidden=0"),
    ("mlp", ["mesh.context=2"], "context-needs-attention-helper", "'attention' capability"),
    ("mlp", ["mesh.stage=2"], "pipeline-needs-stages", "'stages' capability"),
    ("mlp", ["train.matmul_dtype=fp8"], "matmul-dtype", "train.matmul_dtype=fp8: model MLPConfig does not run its "
     "matmuls through jaxpar's projection helpers (column_project / row_project; it declares no 'projections' "
     "capability), and FP8 applies only there, so nothing would run in FP8; set train.matmul_dtype=compute"),
]


@pytest.mark.parametrize("base, overrides, rule_id, text", MODEL_EXAMPLES, ids=[" ".join(e[1]) + f"@{e[0]}" for e in MODEL_EXAMPLES])
def test_model_checks_are_asked_of_the_model(base, overrides, rule_id, text):
    from jaxpar.config import apply_overrides

    with pytest.raises(ConfigError) as info:
        validate(apply_overrides(base_config(base), overrides), 8, "cpu")
    assert info.value.rule == rule_id and text in str(info.value), (info.value.rule, str(info.value))


def test_a_model_without_the_contract_is_refused_by_name():
    @dataclasses.dataclass(frozen=True)
    class Half:
        task = "lm"

        def build(self, rngs):
            raise AssertionError("not reached")

    with pytest.raises(ConfigError, match="model Half lacks param_count, flops_per_token") as info:
        validate(Config(model=Half()), 8, "cpu")
    assert info.value.rule == "model-contract"


def test_no_check_tests_a_model_class():
    """Checks ask the model (jaxpar.model), never test which class it is."""
    import re

    for path in (pathlib.Path(__file__).resolve().parents[2] / "jaxpar").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"isinstance\([^)]*(LlamaConfig|MoEConfig|MLPConfig)", text), path
        imports_models = re.search(r"^\s*(from jaxpar\.models|import jaxpar\.models)", text, re.M)
        # the base configs of the catalogue's examples, the default config, the planner's presets
        assert not imports_models or path.name in ("config.py", "presets.py", "__init__.py"), path
