"""Uneven pipeline stages' arithmetic (jaxpar.pipeline.split, jaxpar.pipeline.lockstep): the
`N*K` lists, the balanced rule against brute force, the published models' splits, and the
lockstep cost of a schedule worked by hand. Pure Python: nothing compiles."""

import itertools
import re

import pytest

from jaxpar.pipeline.lockstep import lockstep_cost
from jaxpar.pipeline.split import balanced, compact, head_layers, leading_layers, parse_layers
from jaxpar.plan import MODELS


def test_layer_lists_round_trip_and_name_the_bad_piece():
    assert parse_layers("4,4*14,1") == (4,) + (4,) * 14 + (1,)
    assert parse_layers(" 3, 2*2 ,0") == (3, 2, 2, 0)
    assert compact((4, 4, 4, 1)) == "4*3,1" and compact((7,)) == "7"
    for text in ("4*15,1", "3,4*14,2", "7,8*14,7", "1,2,3", "0,5*2,0"):
        assert compact(parse_layers(text)) == text
    for counts in [(1,), (2, 2), (0, 1, 1, 0), (5, 4, 4, 3, 3, 3)]:
        assert parse_layers(compact(counts)) == counts
    for bad, piece in [("4,x", "'x'"), ("*3", "'*3'"), ("-1,2", "'-1'"), ("4*2*2", "'4*2*2'"),
                       ("", "''"), ("1,,2", "''"), ("4*", "'4*'"), ("4*0", "'4*0'")]:
        with pytest.raises(ValueError, match=re.escape(piece)):
            parse_layers(bad)


def _brute(total: int, stages: int, leading: int, last_extra: float) -> float | None:
    """The least busiest-stage cost over every contiguous split (None: none is allowed)."""
    best = None
    for cuts in itertools.combinations_with_replacement(range(total + 1), stages - 1):  # where each stage ends
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, total))]
        if counts[0] < leading or any(c < 1 for c in counts[1:-1]):
            continue
        cost = max(*counts[:-1], counts[-1] + last_extra)
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_balanced_is_the_least_busiest_stage_of_every_split(stages):
    for total, leading, extra in itertools.product(range(1, 10), (0, 1, 3), (0.0, 0.5, 1.25, 3.0)):
        want = _brute(total, stages, leading, extra)
        if want is None:
            with pytest.raises(ValueError):
                balanced(total, stages, leading, extra)
            continue
        got = balanced(total, stages, leading, extra)
        assert len(got) == stages and sum(got) == total and got[0] >= leading and min(got[1:-1], default=1) >= 1
        assert max(*got[:-1], got[-1] + extra) == pytest.approx(want), (total, stages, leading, extra, got)


def test_the_published_models_balance_over_16_stages():
    """DeepSeek-V3's 61 layers (3 dense with the embedding, 58 MoE) as 4 at most, Llama 3
    405B's 126 as 8 at most: Megatron's (126 + 2) / 16 (issue 55)."""
    deepseek, llama = MODELS["deepseek-v3"], MODELS["llama3-405b"]
    assert (deepseek.num_layers, leading_layers(deepseek), llama.num_layers, leading_layers(llama)) == (58, 3, 126, 0)
    split = balanced(61, 16, 3, head_layers(deepseek, 4096))
    assert max(split) == 4 and sum(split) == 61 and split[0] >= 3
    split = balanced(126, 16, 0, head_layers(llama, 4096))
    assert max(split) == 8 and split == (7,) + (8,) * 14 + (7,)


def test_lockstep_cost_of_1f1b_over_two_stages_by_hand():
    """p=2, m=2, a layer each. The unit timeline (F forward, b backward, . idle):

        stage 0   F0 F1 .  b0 .  b1     costs 1 1 0 3 0 3 = 8
        stage 1   .  F0 b0 F1 b1 .      costs 0 0 3 0 3 0 = 6 (the last stage's F waits: its b recomputes)

    Each tick lasts its costlier op: 1 + 1 + 3 + 3 + 3 + 3 = 14, against the mean device's 7."""
    assert lockstep_cost("1f1b", 2, 2, 1, (1, 1)) == (14.0, 7.0)
    # half a layer of head on the last stage: its backwards cost 4.5, its work 9
    assert lockstep_cost("1f1b", 2, 2, 1, (1, 1), 0.0, 0.5) == (17.0, 8.5)
    # the embedding's half layer on the first stage: its F 1.5 and b 4.5 (ticks 1.5 1.5 3 4.5 3 4.5)
    assert lockstep_cost("1f1b", 2, 2, 1, (1, 1), 0.5) == (18.0, 9.0)


def test_a_wider_stage_stretches_every_tick():
    """DeepSeek-V3 over 16 stages, m=64 (the design note's simulation): one 5-layer stage
    costs 12% more than the balanced 4 at most, for about the same work."""
    head = head_layers(MODELS["deepseek-v3"], 4096)
    cost, ideal = lockstep_cost("1f1b", 16, 64, 1, (4,) * 15 + (1,), 0.0, head)
    wide, wide_ideal = lockstep_cost("1f1b", 16, 64, 1, (5,) + (4,) * 13 + (3, 2), 0.0, head)
    assert cost == pytest.approx(1762.69, abs=0.01) and ideal == pytest.approx(986.77, abs=0.01)
    assert wide / cost == pytest.approx(1.118, abs=1e-3) and wide_ideal - ideal == pytest.approx(12.0)
    with pytest.raises(ValueError, match="3 layer counts for 2 x 1"):
        lockstep_cost("1f1b", 2, 2, 1, (1, 1, 1))
