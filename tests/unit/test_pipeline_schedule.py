"""Pipeline schedules as tables: every op runs exactly once, after what it needs; the
executed timeline's idle share equals the published bubble; 1F1B holds at most p
microbatches of activations on the first stage while GPipe holds all m."""

import itertools

import pytest

from jaxpar.pipeline import build_schedule, bubble_fraction, peak_in_flight, render

CASES = [(p, m) for p in (2, 4) for m in (4, 8, 16)]


def check_complete_and_ordered(t):
    split = any(op is not None and op.kind == "W" for row in t.grid for op in row)
    seen = {}
    for s, row in enumerate(t.grid):
        for time, op in enumerate(row):
            if op is not None and (time == 0 or row[time - 1] is not op):  # an op's first step
                for part in op.parts():  # an FB: its forward and its backward
                    key = (part.kind, part.microbatch, op.chunk * t.p + s)
                    assert key not in seen, f"{key} runs twice"
                    seen[key] = time
    last = t.p * t.v - 1
    for i, vs in itertools.product(range(t.m), range(last + 1)):
        assert seen[("F", i, vs)] > seen.get(("F", i, vs - 1), -1)
        assert seen[("B", i, vs)] >= seen[("F", i, vs)] + (vs < last)  # the last stage's forward waits in its op
        if vs < last:
            assert seen[("B", i, vs)] > seen[("B", i, vs + 1)]
        if split:
            assert seen[("W", i, vs)] > seen[("B", i, vs)]
    assert len(seen) == (3 if split else 2) * t.m * t.p * t.v


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
    assert peak_in_flight(t) == (p - 1) * 2 + (v - 1) * p + 1  # Megatron's warm-up forwards, plus one


@pytest.mark.parametrize("p, m", CASES + [(8, 16)])
def test_zero_bubble_h1_is_below_one_f_one_b_at_the_same_memory(p, m):
    """With the weight gradient split off (F, B, W one step each), ZB-H1's bubble is
    (p-1)/(3m+p-1), a third of 1F1B's idle time, with 1F1B's p microbatches in flight."""
    t = build_schedule("zb-h1", p, m)
    check_complete_and_ordered(t)
    assert bubble_fraction(t) == pytest.approx((p - 1) / (3 * m + p - 1))
    assert bubble_fraction(t) < bubble_fraction(build_schedule("1f1b", p, m))
    assert peak_in_flight(t) == peak_in_flight(build_schedule("1f1b", p, m)) == p


@pytest.mark.parametrize("p, m", CASES + [(8, 16), (16, 120)])
def test_overlapped_one_f_one_b_runs_a_forward_beside_a_backward_without_lockstep_loss(p, m):
    """In the executor's unit ticks, stage s runs forward i at tick i + s and backward j at
    j + 2(p - 1) - s, together where both fall on one tick. Charged as the lockstep executor
    runs it (a tick as long as its costliest op), its bubble is the published 1F1B one,
    (p-1)/(m+p-1), but for the last stage's forward, which its backward recomputes (a share
    1/4p idle in steady state), where plain 1F1B loses a third of its steady state to
    neighbours out of phase; the price: 2p - 1 microbatches in flight on stage 0."""
    from jaxpar.pipeline.lockstep import lockstep_cost

    t = build_schedule("1f1b-overlap", p, m, unit=True)
    check_complete_and_ordered(t)
    forwards = {(op.microbatch, s): time for s, row in enumerate(t.grid) for time, op in enumerate(row)
                if op is not None and op.kind in ("F", "FB")}
    assert all(time == i + s for (i, s), time in forwards.items())
    assert t.steps == m + 2 * (p - 1)

    def bubble(name):
        cost, ideal = lockstep_cost(name, p, m, 1, (4,) * p)
        return 1 - ideal / cost

    published = (p - 1) / (m + p - 1)
    assert published - 0.01 < bubble("1f1b-overlap") <= published + 1 / (4 * p)
    assert bubble("1f1b-overlap") < bubble("1f1b") - 0.1
    assert peak_in_flight(t) == min(2 * p - 1, m)


def test_one_f_one_b_memory_is_flat_in_microbatches():
    assert [peak_in_flight(build_schedule("1f1b", 4, m)) for m in (4, 8, 16)] == [4, 4, 4]
    assert [peak_in_flight(build_schedule("gpipe", 4, m)) for m in (4, 8, 16)] == [4, 8, 16]


def test_render_draws_forwards_backwards_and_idle():
    picture = render(build_schedule("1f1b", 2, 2))  # a backward takes two steps
    assert picture.splitlines() == ["stage 0  01..aa.bb", "stage 1  .0aa1bb.."]
    assert render(build_schedule("zb-h1", 2, 2)).splitlines() == ["stage 0  01.aAbB", "stage 1  .0a1bAB"]
    # a forward beside a backward shows the backward
    assert render(build_schedule("1f1b-overlap", 2, 3, unit=True)).splitlines() == ["stage 0  01abc", "stage 1  .abc."]


@pytest.mark.parametrize(
    "args, message",
    [
        (("zb-v", 2, 4), "schedule 'zb-v'; use one of gpipe, 1f1b, interleaved, zb-h1"),
        (("1f1b", 4, 2), "1f1b needs at least as many microbatches as stages: m=2 < p=4"),
        (("interleaved", 4, 6, 2), "m=6 is not a multiple of p=4"),
        (("gpipe", 2, 4, 2), "gpipe runs one chunk per device"),
        (("gpipe", 0, 4), "must be positive"),
    ],
)
def test_bad_schedule(args, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(*args)



def test_an_order_that_waits_on_itself_is_reported():
    from jaxpar.pipeline.schedule import Op, simulate

    backward_first = [[Op("B", 0, 0), Op("F", 0, 0)], [Op("F", 0, 0), Op("B", 0, 0)]]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(backward_first, 2, 1, 1)


def test_schedule_command_prints_the_timeline_and_writes_a_png(tmp_path, capsys):
    from jaxpar.commands import main

    png = tmp_path / "zb.png"
    assert main(["schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "stage 3  ...0a1b2c3dA4eB5fC6gD7hEFGH" in out
    assert "bubble 0.1111 (published 0.1111)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["schedule", "1f1b", "--stages", "4", "--microbatches", "2"]) == 2
    assert "1f1b needs at least as many microbatches as stages" in capsys.readouterr().err
