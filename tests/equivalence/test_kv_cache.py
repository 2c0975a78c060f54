"""Sampling with a key/value cache (jaxpar.sharding.kv_cache, jaxpar.generate.sample): the
cached attention kernel against the plain reference, and the cached tokens against the
cache-free path token for token (greedy and drawn) on a user's own model (examples/gpt2.py:
it names no cache) and on the layouts tests/equivalence/test_sample.py and tests/equivalence/test_gemma3.py run."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import apply_overrides
from jaxpar.errors import ConfigError
from jaxpar.kernels.attention import reference_attention
from jaxpar.kernels.attention.cached import cached_attention, write
from jaxpar.sharding.kv_cache import caching
from jaxpar.testing import initial_state
from jaxpar.train import build
from jaxpar.generate.sample import generate_batch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))


@pytest.mark.parametrize("window", [0, 3])
def test_cached_attention_equals_the_reference_however_the_keys_arrived(window):
    """Keys and values written as a prompt of 5 then one token at a time, each row at its own
    places (row 1's prompt is 3 long; garbage past it is overwritten or masked), attend as
    the reference over the whole sequence: queries at every place, at 1e-6."""
    b, s, h, g, k = 2, 8, 4, 2, 8
    rng = np.random.default_rng(0)
    q, key, value = (jnp.asarray(rng.normal(size=(b, s, n, k)), jnp.float32) for n in (h, g, g))
    want = reference_attention(q, key, value, window=window)
    cache = [jnp.asarray(1e3 * rng.normal(size=(b, s, g, k)), jnp.float32) for _ in range(2)]  # garbage to start
    prompt = jnp.asarray([5, 3])
    # row 1's prompt is 3 long: its places 3 and 4 are written with padding's garbage, then rewritten
    cache = [write(c, x[:, :5].at[1, 3:].set(999.0), jnp.zeros(b, jnp.int32)) for c, x in zip(cache, (key, value))]
    for t in range(5):  # the rest, a token a step; row 1 rewrites its places 3 and 4
        at = prompt + t
        step = [jnp.take_along_axis(x, jnp.minimum(at, s - 1)[:, None, None, None], axis=1) for x in (key, value)]
        keep = at < s
        cache = [jnp.where(keep[:, None, None, None], write(c, x, jnp.minimum(at, s - 1)), c)
                 for c, x in zip(cache, step)]
    got = cached_attention(q, *cache, jnp.broadcast_to(jnp.arange(s), (b, s)), window)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
    one = cached_attention(q[:, 6:7], *cache, jnp.asarray([[6], [6]]), window)  # a single query, as a decode step
    np.testing.assert_allclose(one, want[:, 6:7], atol=1e-6, rtol=1e-6)


def test_a_model_meets_its_cache_through_attend_alone():
    """Entries are made in the order attention is called, then read back in it; a call
    beyond the entries made is refused; attention that is not causal is refused."""
    from jaxpar.sharding import attend

    q = jnp.ones((1, 2, 2, 4))
    with caching(jnp.asarray([[0, 1]]), 4, None) as made:
        attend(q, q, q)
        attend(q, q, jnp.ones((1, 2, 2, 6)))  # values of a head size of their own (MLA)
    assert [(k.shape, v.shape) for k, v in made.made] == [((1, 4, 2, 4), (1, 4, 2, 4)), ((1, 4, 2, 4), (1, 4, 2, 6))]
    with caching(jnp.asarray([[2]]), 4, made.made[:1]) as reading, pytest.raises(ValueError, match="more attention"):
        attend(q[:, :1], q[:, :1], q[:, :1])
        attend(q[:, :1], q[:, :1], q[:, :1])
    assert len(reading.made) == 1
    with caching(jnp.asarray([[0, 1]]), 4, None), pytest.raises(ValueError, match="not causal"):
        attend(q, q, q, causal=False)


def test_a_users_own_model_samples_with_the_cache_as_without(tiny_llama, monkeypatch):
    """examples/gpt2.py (learned positions, its own attention module, scan_layers) under
    fsdp 2 x tensor 2 with sequence parallelism: three prompts of different lengths, greedy
    and drawn with top-k and top-p, the same tokens with and without the cache, and the same
    logits (fp32, to 1e-5 of their scale) at every place a token is drawn for: an untrained
    model's greedy tokens hardly depend on the context, so only the logits show a cache
    written at the wrong places. Under context parallelism the cache is refused when asked
    for and left out when not."""
    import gpt2

    from jaxpar.generate import sample

    config = apply_overrides(gpt2.recipe(), ["train.compute_dtype=float32", "train.seq_len=16", "train.global_batch=4"])
    trainer = build(apply_overrides(config, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]))
    params = initial_state(trainer).params
    prompts = [[1, 2, 3, 4, 5], [6, 7], [7, 8, 9, 10, 11, 12, 13, 14]]
    seen: dict[tuple, np.ndarray] = {}  # (cached, settings, row, place): the logits drawn from
    key = []

    def drawing(logits_BV, places, *rest):  # every draw's logits, as the draw sees them
        def record(logits, places):
            for row, place in enumerate(places[:len(prompts)].tolist()):
                seen[(*key, row, place)] = np.array(logits[row])

        jax.debug.callback(record, logits_BV, places)
        return draw(logits_BV, places, *rest)

    draw = sample.draw
    monkeypatch.setattr(sample, "draw", drawing)
    for number, settings in enumerate(({}, {"temperature": 0.9, "top_k": 50, "top_p": 0.8, "seed": 4})):
        key[:] = [True, number]
        cached = generate_batch(trainer, params, prompts, 6, kv_cache=True, **settings)
        key[:] = [False, number]
        recomputed = generate_batch(trainer, params, prompts, 6, kv_cache=False, **settings)
        jax.effects_barrier()
        places = sorted({k[2:] for k in seen if k[1] == number})
        assert len(places) == len(prompts) * 6 and all((c, number, *p) in seen for c in (True, False) for p in places)
        for place in places:
            with_cache, without = seen[(True, number, *place)], seen[(False, number, *place)]
            np.testing.assert_allclose(with_cache, without, rtol=0, atol=1e-5 * np.max(np.abs(without)),
                                       err_msg=f"{settings}, (row, place) {place}")
        assert cached == recomputed, settings
    assert "cached_steps" in trainer.derived and "next_token_step" in trainer.derived  # built once, reused
    ring = build(apply_overrides(config, ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "mesh.context=4"]))
    with pytest.raises(ConfigError, match=r"^kv_cache=True with mesh.context=4: a cached step runs one token a row"):
        generate_batch(ring, params, prompts, 2, kv_cache=True)
    from jaxpar.generate.sample import uses_kv_cache

    assert uses_kv_cache(ring, None) is False and uses_kv_cache(trainer, None) is True


def test_top_p_keeps_the_fewest_likeliest_tokens_that_reach_it():
    from jaxpar.generate.sample import choose

    logits = jnp.log(jnp.asarray([0.05, 0.5, 0.3, 0.15], jnp.float32))
    seen = {int(choose(logits, jnp.float32(1.0), jnp.int32(0), jnp.float32(0.75), jax.random.key(i))) for i in range(64)}
    assert seen == {1, 2}  # 0.5 + 0.3 reach 0.75; 0.5 alone does not
    seen = {int(choose(logits, jnp.float32(1.0), jnp.int32(0), jnp.float32(0.4), jax.random.key(i))) for i in range(16)}
    assert seen == {1}
