"""DPO on preference pairs (jaxpar.step.preference, data.source=preference): a row a pair,
the reference's log-probabilities from the starting weights; the first loss is log 2, the
reward margin grows, a sharded layout equals one device (fp32, 1e-5), and a resumed run
reads the reference an uninterrupted one read."""

import dataclasses
import json
import math
import pathlib

import numpy as np
import pytest

from jaxpar.config import CheckpointConfig, Config, DataConfig, OptimConfig, TrainConfig, apply_overrides
from jaxpar.errors import ConfigError

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "chat"


def dpo_config(path: pathlib.Path | None = None, **train) -> Config:
    from jaxpar.models.llama import LlamaConfig

    return Config(
        model=LlamaConfig(vocab_size=264, embed=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8, mlp=64),
        train=TrainConfig(steps=6, global_batch=8, seq_len=512, compute_dtype="float32", **train),
        optim=OptimConfig(lr=3e-3, warmup_steps=0),
        data=DataConfig(source="preference", path=str(path or EXAMPLES / "preferences.jsonl"),
                        tokenizer=str(EXAMPLES / "tokenizer.json"), eos_id=258))


def test_dpo_starts_at_log_2_and_prefers_the_chosen_answers(tmp_path, reference):
    """The policy starts as the reference: every margin 0, the loss log 2 (to float32's
    rounding of two forward passes), accuracy 0. Six steps on the 24 shipped pairs raise the
    mean margin and the accuracy. fsdp 2 x tensor 4 equals one device. Resumed at step 3 from
    its checkpoint, the run recomputes the same reference and continues as the uninterrupted
    one did, losses equal."""
    from jaxpar.testing import check, compare, run_layout
    from jaxpar.train import build, run

    config = dpo_config()
    plain = dataclasses.replace(config, optim=OptimConfig())  # the layout tests' optimizer
    check(compare(run_layout(apply_overrides(plain, ["mesh.fsdp=2", "mesh.tensor=4"])), reference(plain)))

    import shutil

    saved = dataclasses.replace(config, checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every=3,
                                                                    async_save=False))
    trainer = build(saved)
    history = run(trainer, progress=False)  # uninterrupted, saving at steps 3 and 6
    assert abs(history[0]["loss"] - math.log(2)) < 1e-6 and history[0]["reward_margin"] == pytest.approx(0, abs=1e-6)
    assert history[-1]["reward_margin"] > 0.05 and history[-1]["reward_accuracy"] > 0.5
    shutil.rmtree(tmp_path / "ckpt" / "6")  # as if stopped after step 3
    resumed = run(trainer, progress=False)
    np.testing.assert_allclose([h["loss"] for h in resumed], [h["loss"] for h in history[3:]], rtol=1e-6)


def test_pairs_are_rows_of_two_segments_weighted_on_the_answers():
    from jaxpar.data.chat import lm_rows, pack_pairs, read_pairs

    pairs = read_pairs(dpo_config().data, 264)
    assert len(pairs) == 24 and all(c.mask.any() and r.mask.any() for c, r in pairs)
    rows = pack_pairs(pairs, 512)
    batch = lm_rows(rows.ids, rows.mask, rows.segments)
    chosen, rejected = pairs[0]
    # each side's answer tokens (all but the first, which no input of its segment predicts... it is
    # the prompt's last that predicts it, inside the segment) are weighted: the mask's count
    assert batch["weights"][0][batch["segment_ids"][0] == 0].sum() == chosen.mask.sum()
    assert batch["weights"][0][batch["segment_ids"][0] == 1].sum() == rejected.mask.sum()
    assert set(batch["segment_ids"][0].tolist()) <= {0, 1, 2}
    # the line a run starts with: pairs, their tokens, the answers' (weighted) ones, a row each
    from jaxpar.data.sources import make_source
    from jaxpar.train import build

    config = apply_overrides(dpo_config(), ["mesh.data=8"])
    tokens, trained = sum(len(c.ids) + len(r.ids) for c, r in pairs), int(batch["weights"].sum())
    assert rows.cut == 0 and make_source(build(config).batch, config).describe(6) == (
        f"data: preference '{EXAMPLES / 'preferences.jsonl'}' | 24 pairs, {tokens:,} tokens, {trained:,} of them "
        f"answers' | a row a pair: 24 rows of 513 tokens, {tokens / (24 * 513):.1%} filled | 6 steps x 8 rows = 2 "
        "epochs (rows at random: data.order=windows)")


@pytest.mark.parametrize("record, message", [
    ({"prompt": "q", "chosen": "a"}, r"line 1 has no 'rejected'; give a preference record"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": ""},
     r"line 1: 'rejected' is empty; give each answer its text"),
])
def test_bad_pairs_are_refused_in_one_line(tmp_path, record, message):
    from jaxpar.data.chat import read_pairs

    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ConfigError, match=message):
        read_pairs(dpo_config(path).data, 264)


def test_dpo_settings_are_checked():
    from jaxpar.checks import validate

    with pytest.raises(ConfigError, match=r"^train.dpo_beta=0.0 must be positive"):
        validate(dpo_config(dpo_beta=0.0), 8, "cpu")
    with pytest.raises(ConfigError, match=r"^data.eval_fraction=0.1: preference pairs have no held-out part yet"):
        validate(dataclasses.replace(dpo_config(), data=dataclasses.replace(dpo_config().data, eval_fraction=0.1)),
                 8, "cpu")
