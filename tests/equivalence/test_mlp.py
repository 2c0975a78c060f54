"""The seed's MLP: gradient accumulation over microbatches equals one large batch, and the
data-parallel run equals one device (fp32, 1e-5 relative)."""


from jaxpar import recipes
from jaxpar.config import apply_overrides
from jaxpar.testing import check, compare, reference_run, run_layout


def test_accumulation_and_data_parallel_equal_one_large_batch():
    config = apply_overrides(recipes.load("mlp_dp"), ["train.global_batch=64", "train.steps=3"])
    one_batch = reference_run(apply_overrides(config, ["train.microbatches=1"]))
    accumulated = run_layout(apply_overrides(config, ["train.microbatches=4", "mesh.data=8"]))
    assert config.train.microbatches == 4
    check(compare(accumulated, one_batch), 1e-5, where="mlp data=8 x 4 microbatches vs one device, one batch")


def test_mlp_learns():
    config = apply_overrides(recipes.load("mlp_dp"), ["train.steps=30", "train.global_batch=64"])
    run = run_layout(config, steps=30)
    assert run.losses[-1] < 0.75 * run.losses[0], run.losses
