"""Mixtures (data.source=mix: jaxpar.data.mixing, jaxpar.data.mixture): each source's exact
share over the run under a schedule of weights, its rows read in its own order, each
process's own rows, packed and unpacked sources side by side, held-out batches, the start
line, bad input refused before compile, and a killed run resumed repeating the losses."""

import dataclasses

import numpy as np
import pytest

from jaxpar.config import apply_overrides
from jaxpar.data.mixing import assign, offsets, parse_mix, parse_schedule
from jaxpar.data.sources import make_source
from jaxpar.errors import ConfigError
from jaxpar.train import build, run


def test_each_source_gives_its_share_to_a_row_and_its_rows_in_order():
    """Over 600 steps of 7 rows with a step change and an anneal, each source's count is its
    summed weight within two rows, at every step, and its rows are 0, 1, 2, ... in order."""
    schedule = parse_schedule("200=0.2,0.3,0.5; anneal 150=0.1,0.1,0.8", (0.7, 0.2, 0.1), 600)
    u, batch = offsets(3, 3), 7
    counts, following = np.zeros(3, int), [0, 0, 0]
    for step in range(600):
        source, index = assign(schedule, batch, step, u)
        for s, j in zip(source, index):
            assert j == following[s]  # no row skipped or repeated
            following[s] += 1
        counts += np.bincount(source, minlength=3)
        assert np.all(np.abs(counts - schedule.cumulative(step + 1) * batch) < 2)
    assert np.allclose(schedule.at(599), (0.1, 0.1, 0.8)) and np.allclose(schedule.at(449), (0.2, 0.3, 0.5))
    assert counts.sum() == 600 * batch
    for t in (1, 200, 450, 451, 600):  # the closed form is the weights summed step by step
        assert np.allclose(schedule.cumulative(t), sum((schedule.at(k) for k in range(t)), np.zeros(3)))


@pytest.fixture
def mixed(tmp_path, tiny_llama):
    """A token file without document ends beside a text corpus whose documents end in 1,
    and synthetic tokens: 0.5 / 0.3 / 0.2."""
    from tests.unit.test_text_data import WORDS  # noqa: F401  (the corpus fixture's words)

    ids = np.random.default_rng(0).integers(2, 128, 5000).astype(np.uint16)
    np.save(tmp_path / "code.npy", ids)
    text = tmp_path / "web.txt"
    text.write_text("\n\n".join(" ".join(np.random.default_rng(i).choice(["a", "b", "c"], 20)) for i in range(50)))
    return tmp_path, ids


def _config(tiny_llama, tmp_path, *more):
    tokenizer = "tests/golden/llama_tied/tokenizer.json"
    return apply_overrides(tiny_llama, ["data.source=mix", f"data.tokenizer={tokenizer}", "data.eos_id=2",
                                        f"data.mix=0.5 tokens:{tmp_path}/code.npy, 0.3 text:{tmp_path}/web.txt, "
                                        "0.2 synthetic", "train.steps=20", *more])


def test_a_source_s_rows_are_its_own_batches_rows(mixed, tiny_llama):
    tmp_path, _ = mixed
    config = _config(tiny_llama, tmp_path)
    trainer = build(config)
    mixture = make_source(trainer.batch, config)
    B = trainer.batch.global_batch
    for step in (0, 7):
        batch = mixture.local(step, slice(0, B))
        source, index = assign(mixture.schedule, B, step, mixture.u)
        for s in range(3):
            alone = [mixture.sources[s].local(int(j // B), slice(int(j % B), int(j % B) + 1)) for j in index[source == s]]
            for k in ("inputs", "targets", "weights"):
                np.testing.assert_array_equal(batch[k][source == s], np.concatenate([a[k] for a in alone]))
    # packed documents' fields for every source (the text packs them), and each row's source
    assert set(batch) == {"inputs", "targets", "weights", "positions", "segment_ids", "source"}
    np.testing.assert_array_equal(batch["source"], source)
    halves = [mixture.local(7, slice(0, B // 2)), mixture.local(7, slice(B // 2, B))]  # two processes' rows
    for k in batch:
        np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), batch[k])


def test_the_start_line_and_the_held_out_batches(mixed, tiny_llama):
    from jaxpar.data.heldout import held_out_batches

    tmp_path, _ = mixed
    config = _config(tiny_llama, tmp_path, "data.eval_fraction=0.1", "data.mix_schedule=anneal 10=0.2,0.2,0.6")
    trainer = build(config)
    mixture = make_source(trainer.batch, config)
    line = mixture.describe(20)
    assert line.startswith("data: a mixture of 3 sources, 1 change(s) of weights | code (tokens")
    assert "0.5 -> 0.2" in line and "web (text" in line and "synthetic (synthetic) 0.2 -> 0.6" in line
    held = held_out_batches(trainer.batch, config, source=mixture)
    first = held(0)
    assert np.array_equal(np.asarray(first["inputs"]), np.asarray(held(0)["inputs"]))  # the same every evaluation
    held_tokens = {int(t) for t in np.asarray(mixture.sources[0].held_out)}
    training = np.asarray(mixture(0)["inputs"])
    assert not np.array_equal(np.asarray(first["inputs"]), training)
    assert held_tokens  # the token file's last 10% is held out


def test_bad_mixtures_are_refused_before_compile(mixed, tiny_llama):
    tmp_path, _ = mixed
    with pytest.raises(ConfigError, match=r"weights 0.6, 0.3 must be >= 0 and sum to 1 .* e.g. 0.667, 0.333"):
        parse_mix("0.6 synthetic, 0.3 tokens:a.npy")
    with pytest.raises(ConfigError, match="source 'web'; use one of tokens, text, chat, synthetic"):
        parse_mix("0.5 web:a.txt, 0.5 synthetic")
    with pytest.raises(ConfigError, match="steps go up, each inside the run"):
        parse_schedule("30=0.5,0.5", (0.5, 0.5), 20)
    config = apply_overrides(tiny_llama, ["data.source=mix", f"data.mix=0.5 tokens:{tmp_path}/missing.npy, 0.5 synthetic"])
    with pytest.raises(ConfigError, match="missing.npy"):
        make_source(build(config).batch, config)
    big = np.full(100, 5000, np.uint16)
    np.save(tmp_path / "big.npy", big)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, mix=f"0.5 tokens:{tmp_path}/big.npy, "
                                                                                   "0.5 synthetic"))
    with pytest.raises(ConfigError, match="token id 5000 .* model.vocab_size=128"):
        make_source(build(config).batch, config)


def test_a_killed_mixture_run_resumes_repeating_the_losses(mixed, tiny_llama, tmp_path):
    data_dir, _ = mixed
    config = _config(tiny_llama, data_dir, "mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1", "train.steps=6")
    whole = run(build(config), progress=False)
    saving = apply_overrides(config, [f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.every=1"])
    trainer = build(saving)
    first = run(trainer, steps=3, progress=False)
    rest = run(trainer, progress=False)
    assert [r["loss"] for r in first + rest] == [r["loss"] for r in whole]


def test_each_source_s_loss_is_its_own_rows_loss_under_a_layout(mixed, tiny_llama):
    """data 2 x fsdp 2 x tensor 2 with 2 microbatches: the step's loss_<name> is the loss of
    that source's rows alone (the held-out path's loss on the batch with the other rows'
    weights zeroed, at the same weights, 1e-5), tokens_<name> its trained tokens, and the
    whole loss their token-weighted mean."""
    import jax
    import jax.numpy as jnp

    from jaxpar.testing import initial_state

    tmp_path, _ = mixed
    config = _config(tiny_llama, tmp_path, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.microbatches=2")
    trainer = build(config)
    batch = make_source(trainer.batch, config)(3)
    state = initial_state(trainer)
    weights = jax.tree.map(lambda x: x.copy(), trainer.weights(state))  # the step donates the state
    _, metrics = trainer.step(state, batch)
    names = [e.name for e in parse_mix(config.data.mix)]
    assert names == ["code", "web", "synthetic"]
    source = np.asarray(batch["source"])
    total = 0.0
    for i, name in enumerate(names):
        mask = jnp.asarray((source == i)[:, None], jnp.float32)
        alone = {**batch, "weights": jax.device_put(batch["weights"] * mask, trainer.batch.shardings["weights"])}
        loss_sum, weight = trainer.evaluate(weights, alone)
        assert float(metrics[f"tokens_{name}"]) == pytest.approx(float(weight))
        assert float(metrics[f"loss_{name}"]) == pytest.approx(float(loss_sum / weight), rel=1e-5)
        total += float(loss_sum)
    assert float(metrics["loss"]) == pytest.approx(total / float(jnp.sum(batch["weights"])), rel=1e-5)


@pytest.mark.parametrize("order", ["windows", "epochs"])
def test_a_folder_of_shards_reads_as_their_concatenation(tmp_path, tiny_llama, order):
    """data.path a folder (or a glob) of .npy shards, opened lazily (jaxpar.data.shards):
    the same batches and held-out batches as one file of all their tokens, bitwise; the
    start line counts the files; only the shards a row reads are mapped."""
    from jaxpar.data.heldout import held_out_batches

    parts = [np.random.default_rng(i).integers(0, 128, 300 + 41 * i).astype(np.uint16) for i in range(12)]
    (tmp_path / "shards").mkdir()
    for i, part in enumerate(parts):
        np.save(tmp_path / "shards" / f"{i:04d}.npy", part)
    np.save(tmp_path / "whole.npy", np.concatenate(parts))
    runs = {}
    for name, path in (("shards", tmp_path / "shards"), ("glob", tmp_path / "shards" / "*.npy"),
                       ("whole", tmp_path / "whole.npy")):
        config = apply_overrides(tiny_llama, ["data.source=tokens", f"data.path={path}", f"data.order={order}",
                                              "data.eval_fraction=0.1"])
        trainer = build(config)
        source = make_source(trainer.batch, config)
        held = held_out_batches(trainer.batch, config, source=source)
        runs[name] = [np.asarray(source(s)["inputs"]) for s in (0, 5, 9)] + [np.asarray(held(0)["inputs"])]
        if name == "shards":
            assert "(12 files)" in source.describe(10) and len(source.tokens.cache) <= 12
    for name in ("shards", "glob"):
        for a, b in zip(runs[name], runs["whole"]):
            np.testing.assert_array_equal(a, b)
