"""Pipeline schedules as tables: every op runs exactly once, after what it needs; the
executed timeline's idle share equals the published bubble; 1F1B holds at most p
microbatches of activations on the first stage while GPipe holds all m."""

import itertools

import pytest

from jaxpar.pipeline import build_schedule, bubble_fraction, peak_in_flight, render

CASES = [(p, m) for p in (2, 4) for m in (4, 8, 16)]


def check_complete_and_ordered(t):
    seen = {}
    for s, row in enumerate(t.grid):
        for time, op in enumerate(row):
            if op is not None:
                key = (op.kind, op.microbatch, op.chunk * t.p + s)
                assert key not in seen, f"{key} runs twice"
                seen[key] = time
    last = t.p * t.v - 1
    for i, vs in itertools.product(range(t.m), range(last + 1)):
        assert seen[("F", i, vs)] > seen.get(("F", i, vs - 1), -1)
        assert seen[("B", i, vs)] > seen[("F", i, vs)]
        if vs < last:
            assert seen[("B", i, vs)] > seen[("B", i, vs + 1)]
    assert len(seen) == 2 * t.m * t.p * t.v


@pytest.mark.parametrize("p, m", CASES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_matches_the_formula(name, p, m):
    t = build_schedule(name, p, m)
    check_complete_and_ordered(t)
    assert bubble_fraction(t) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 4), (2, 6, 3)])
def test_interleaved_bubble_shrinks_with_virtual_stages(p, m, v):
    t = build_schedule("interleaved", p, m, v)
    check_complete_and_ordered(t)
    assert bubble_fraction(t) == pytest.approx((p - 1) / (v * m + p - 1))


def test_one_f_one_b_memory_is_flat_in_microbatches():
    assert [peak_in_flight(build_schedule("1f1b", 4, m)) for m in (4, 8, 16)] == [4, 4, 4]
    assert [peak_in_flight(build_schedule("gpipe", 4, m)) for m in (4, 8, 16)] == [4, 8, 16]


def test_render_draws_forwards_backwards_and_idle():
    picture = render(build_schedule("1f1b", 2, 2))  # stage 0 waits for each backward from stage 1
    assert picture.splitlines() == ["stage 0  01.a.b", "stage 1  .0a1b."]


@pytest.mark.parametrize(
    "args, message",
    [
        (("zb-v", 2, 4), "schedule 'zb-v'; use one of gpipe, 1f1b, interleaved"),
        (("1f1b", 4, 2), "1f1b needs at least as many microbatches as stages: m=2 < p=4"),
        (("interleaved", 4, 6, 2), "m=6 is not a multiple of p=4"),
        (("gpipe", 2, 4, 2), "gpipe runs one chunk per device"),
        (("gpipe", 0, 4), "must be positive"),
    ],
)
def test_bad_schedule(args, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(*args)

