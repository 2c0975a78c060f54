"""`jaxpar explain` where pipeline stages hold different numbers of layers
(parallel.pipeline.layers): the executor's passes weigh each chunk by its layers, the memory
rows count the zero rows that pad every chunk to the widest as the stack rests
(jaxpar.pipeline.split), the title the model's own parameters, and the schedule shows the
layers of each virtual stage. The even layout's own test: test_pipeline.py's
test_explain_accounts_for_the_stages (2% there as here)."""

import pytest

from jaxpar.config import apply_overrides
from jaxpar.inspect import inspect_step
from jaxpar.inspect.explain import explain, render
from jaxpar.inspect.pipelined import expert_passes, gather_passes, pipeline_recompute
from jaxpar.pipeline.program import compile_schedule
from jaxpar.pipeline.split import StageSplit
from jaxpar.train import build

from ..unit.test_pipeline import deep_llama  # noqa: F401  the fixture, shared
from .test_deepseek import tiny_deepseek  # noqa: F401  the fixture, shared


def _explained(config, overrides: list[str]) -> dict:
    trainer = build(apply_overrides(config, overrides))
    return explain(trainer, inspect_step(trainer))


def _ratios(doc: dict) -> dict[str, float]:
    return {r["name"]: r["ratio"] for r in doc["memory"] if r["ratio"] is not None}


@pytest.mark.parametrize("schedule,p,v,counts", [("1f1b", 2, 1, (1, 3)), ("zb-h1", 4, 1, (0, 2, 1, 1)),
                                                 ("interleaved", 2, 2, (1, 2, 1, 0))])
def test_the_executor_s_passes_weigh_each_chunk_by_its_layers(schedule, p, v, counts):
    """The forms of w = a virtual stage's share of the layers, and with equal chunks today's
    (n-1)/n ones, exactly."""
    program = compile_schedule(schedule, p, 4, v, StageSplit(p, v, counts))
    first, last = 1 - counts[0] / sum(counts), 1 - counts[-1] / sum(counts)  # 1 - w of the first and last
    if program.split:
        gathers, experts = last + 2 * first + 3, 2 * last + 4 * first + 4
    else:
        gathers, experts = last + 3, 4 + 2 * last
    assert pipeline_recompute(program)[0] == pytest.approx(gathers / 3)  # the same passes, over a plain step's 3
    assert gather_passes(program) == pytest.approx(gathers)
    assert expert_passes(program) == pytest.approx(experts)
    even, n = compile_schedule(schedule, p, 4, v), p * v
    split = even.split
    assert pipeline_recompute(even)[0] == ((n - 1) + (n - 1) * 2 * split + n * 3) / (3 * n)
    assert expert_passes(even) == ((2 * (n - 1) + 4 * (n - 1) + 4 * n) / n if split else (6 * (n - 1) + 4) / n)


def test_explain_accounts_for_stages_of_1_and_3_layers(deep_llama):  # noqa: F811  the fixture imported above
    """1F1B over stage 2 x data 2 x tensor 2, ZeRO-1: the first stage stores its layer and 2
    zero rows. Model state (padding included) and matmul FLOPs (the last stage's forward, 3
    layers of 4, left to its backward: x 1.083, with equal shares x 1.167 read 0.922), the
    traffic over data and over stage: each within 2% of its formula."""
    doc = _explained(deep_llama, ["mesh.stage=2", "mesh.data=2", "mesh.tensor=2", "parallel.zero.stage=1",
                                  "parallel.pipeline.layers=1,3"])
    rows = _ratios(doc)
    assert rows["parameters"] == pytest.approx(1.0, abs=0.02) and rows["model state"] == pytest.approx(1.0, abs=0.02), rows
    for key in ("flops", "gradient_traffic", "pipeline_traffic", "pipeline_gradient_traffic"):
        assert doc[key]["ratio"] == pytest.approx(1.0, abs=0.02), (key, doc[key])
    assert doc["params"] == deep_llama.model.param_count()  # the model's, not the stored rows'
    assert {k: doc["pipeline"][k] for k in ("layers", "widest", "padding_rows")} == \
        {"layers": "1,3", "widest": 3, "padding_rows": [2, 0]}
    text = render(doc)
    assert "layers per virtual stage 1,3" in text and "zero rows per stage 2 0" in text
    assert "2 zero rows, 33% of the stack as stored" in doc["memory_formula"]


def test_explain_accounts_for_uneven_interleaved_chunks(deep_llama):  # noqa: F811  the fixture imported above
    """Interleaved over stage 2 x fsdp 2 x tensor 2, chunks of 1, 2, 1 and 0 layers, each
    device storing 2 zero rows. Memory and the traffic over stage within 2%. The fsdp
    gathers move the model's layers, not the stored rows (counting those read 0.52): the
    formula is an upper bound the compiler stays within 10% of, sharing gathers between a
    recompute and its backward (even chunks read 0.900); matmul FLOPs within 3% below
    (even chunks read 0.963; equal shares read 1.031)."""
    doc = _explained(deep_llama, ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.pipeline.schedule=interleaved",
                                  "parallel.pipeline.chunks=2", "parallel.pipeline.layers=1,2,1,0"])
    rows = _ratios(doc)
    assert rows["parameters"] == pytest.approx(1.0, abs=0.02) and rows["model state"] == pytest.approx(1.0, abs=0.02), rows
    for key in ("pipeline_traffic", "pipeline_gradient_traffic"):
        assert doc[key]["ratio"] == pytest.approx(1.0, abs=0.02), (key, doc[key])
    assert 0.97 <= doc["flops"]["ratio"] <= 1.0, doc["flops"]
    assert 0.9 <= doc["gradient_traffic"]["ratio"] <= 1.0, doc["gradient_traffic"]
    assert doc["pipeline"]["padding_rows"] == [2, 2]
    assert "layers per virtual stage 1,2,1,0: each padded to the widest, 2 rows" in render(doc)


def test_expert_all_to_alls_follow_each_stage_s_layers(tiny_deepseek):  # noqa: F811  the fixture imported above
    """DeepSeek, whole-model layers 1,2: the dense layer alone on the first stage (its MoE
    stack 0 rows of 2), both MoE layers on the last, whose forward waits for its backward:
    4 all-to-alls a layer and microbatch, not the 5 of equal shares. Memory and the
    all-to-alls within 0.1%, as with equal stages (test_deepseek.py)."""
    doc = _explained(tiny_deepseek, ["mesh.stage=2", "mesh.expert=2", "mesh.data=2", "train.microbatches=2",
                                     "model.routing=capacity", "parallel.pipeline.layers=1,2"])
    rows = _ratios(doc)
    assert rows["parameters"] == pytest.approx(1.0, abs=1e-3) and rows["model state"] == pytest.approx(1.0, abs=1e-3), rows
    assert doc["expert_traffic"]["ratio"] == pytest.approx(1.0, abs=1e-3), doc["expert_traffic"]
    assert "4 per layer" in doc["expert_traffic_formula"]
    assert {k: doc["pipeline"][k] for k in ("layers", "padding_rows")} == {"layers": "1,2", "padding_rows": [2, 0]}
