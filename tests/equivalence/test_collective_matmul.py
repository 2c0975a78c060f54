"""Collective matmul (jaxpar.kernels.collective_matmul) equals the whole-array matmul, values
and gradients, fp32 to 1e-5 normwise relative, for tensor axes of 2, 3, 4 and 8 devices,
unidirectional and bidirectional, alone and beside a data axis; its compiled program moves
data only by collective-permute (no all-gather, no reduce-scatter), in n-1 or n//2 dependent
hops; bad shapes and names give one clear ValueError.

Here the Llama step's projections as rings (a compiled training step); the kernels themselves:
tests/unit/test_collective_matmul.py."""

import pytest

from jaxpar.inspect.hlo import collectives


# ---------------------------------------------------------------- several weights, and the model


@pytest.mark.parametrize("impl", ["ring", "bidirectional"])
def test_model_projections_become_rings(impl):
    """parallel.tensor.collective_matmul: the Llama step's sequence-parallel gathers and scatters
    over tensor become collective-permutes. What stays (under a fifth of the plain step's
    gather and scatter bytes) is two activation-sized all-gathers of the backward pass,
    outside the projections."""
    from jaxpar.config import Config, TrainConfig, apply_overrides
    from jaxpar.train import build
    from jaxpar.models.llama import LlamaConfig

    config = Config(
        model=LlamaConfig(vocab_size=128, embed=32, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=4, mlp=64),
        train=TrainConfig(global_batch=16, seq_len=16, compute_dtype="float32"),
    )
    layout = ["mesh.data=2", "mesh.tensor=4", "parallel.tensor.sequence_parallel=true"]

    def over_tensor(value: str) -> dict[str, int]:
        trainer = build(apply_overrides(config, layout + [f"parallel.tensor.collective_matmul={value}"]))
        text = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile().as_text()
        out: dict[str, int] = {}
        for c in collectives(text, trainer.mesh):
            if c.axes == ("tensor",):
                out[c.kind] = out.get(c.kind, 0) + c.bytes_per_step
        return out

    plain, rings = over_tensor("none"), over_tensor(impl)
    moved = lambda found: found.get("all-gather", 0) + found.get("reduce-scatter", 0)
    assert "collective-permute" not in plain and rings["collective-permute"] > 0
    assert moved(rings) < 0.2 * moved(plain), (plain, rings)
