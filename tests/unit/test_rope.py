"""RoPE frequencies, with Llama 3.1's scaling, against the published per-frequency rule
written out plainly (Meta's llama-models `apply_scaling`); float32, 1e-6 relative."""

import math

import numpy as np
import pytest

from jaxpar.config import Config, apply_overrides
from jaxpar.checks import validate
from jaxpar.errors import ConfigError
from jaxpar.models.llama import LlamaConfig, rope_frequencies

LLAMA_3_1 = dict(rope_theta=500_000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                 rope_original_max_positions=8192)


def published(head_dim, theta, factor, low, high, original):
    """One frequency at a time, as the Llama 3.1 release computes them."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(freq)
        elif wavelength > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_llama3_scaling_matches_the_published_rule(head_dim):
    cfg = LlamaConfig(head_dim=head_dim, **LLAMA_3_1)
    ours = np.asarray(rope_frequencies(head_dim, cfg))
    want = published(head_dim, 500_000.0, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(ours, want, rtol=1e-6)
    plain = np.asarray(rope_frequencies(head_dim, LlamaConfig(head_dim=head_dim, rope_theta=500_000.0)))
    assert ours[0] == plain[0] and ours[-1] == pytest.approx(plain[-1] / 8, rel=1e-6)  # short kept, long slowed
    kept, slowed = np.isclose(ours, plain), np.isclose(ours, plain / 8)
    assert kept.any() and slowed.any() and (~kept & ~slowed).any()  # all three bands are exercised


def test_no_scaling_is_plain_rope():
    np.testing.assert_array_equal(np.asarray(rope_frequencies(16, LlamaConfig())),
                                  np.asarray(10_000.0 ** (-np.arange(8, dtype=np.float32) / 8), np.float32))


@pytest.mark.parametrize("overrides,needle", [
    (["model.rope_scaling_factor=0.5"], "model.rope_scaling_factor=0.5 must be at least 1"),
    (["model.rope_scaling_factor=8", "model.rope_high_freq_factor=1"], "model.rope_high_freq_factor=1.0 must exceed"),
    (["model.rope_original_max_positions=0"], "model.rope_original_max_positions=0 must be positive"),
])
def test_bad_scaling_is_refused(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        validate(apply_overrides(Config(model=LlamaConfig()), overrides), 8)
