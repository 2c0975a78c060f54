"""parallel.attention: which attention runs over an unsharded sequence.

`flash` (jaxpar's blockwise kernel) equals the reference attention, values and gradients,
fp32 to 1e-5, with packed segments, and trains a sharded Llama to the single-device run's
numbers. `cudnn` (cuDNN's fused kernel through jax.nn.dot_product_attention) runs on GPUs
only: here its choice is tested (auto picks it exactly where it applies, and an explicit
request where it cannot run is refused before compile), not its numbers.

Here the sharded Llama run; the kernel and the choice, which compile no training step, are
tests/unit/test_attention_choice.py.
"""

from jaxpar.config import apply_overrides
from jaxpar.testing import check, compare, run_layout


def test_flash_trains_a_sharded_llama_like_one_device(tiny_llama, reference):
    """Blocks of 8 over a 16-token sequence: two query and two key tiles."""
    config = apply_overrides(tiny_llama, ["parallel.attention=flash", "parallel.context.block=8"])
    run = run_layout(apply_overrides(config, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]))
    check(compare(run, reference(tiny_llama)), 1e-5, where="attention=flash")
