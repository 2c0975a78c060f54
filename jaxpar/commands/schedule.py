"""`jaxpar schedule NAME`: draw a pipeline schedule and measure its bubble (jaxpar.pipeline)."""

from __future__ import annotations

import sys
from typing import get_args

from jaxpar.choices import PipelineSchedule


def add_parser(sub) -> None:
    schedule = sub.add_parser("schedule", help="draw a pipeline schedule and measure its bubble")
    schedule.add_argument("name", help=", ".join(get_args(PipelineSchedule)))
    schedule.add_argument("--stages", type=int, default=4, metavar="P", help="pipeline stages (default 4)")
    schedule.add_argument("--microbatches", type=int, default=8, metavar="M", help="microbatches (default 8)")
    schedule.add_argument("--chunks", type=int, default=1, metavar="V", help="virtual stages per device (interleaved)")
    schedule.add_argument("--png", metavar="PATH", help="also write the picture as a PNG")


def run(args) -> int:
    """The timeline a schedule gives, its bubble beside the published one, and the
    activations in flight on the first stage."""
    from jaxpar.pipeline import build_schedule, bubble_fraction, peak_in_flight, render
    from jaxpar.pipeline.schedule import published_bubble

    p, m, v = args.stages, args.microbatches, args.chunks
    try:
        if args.png:
            from jaxpar.loop.metrics import prepare_file

            prepare_file(args.png, f"--png={args.png!r}", "schedule.png")
        timeline = build_schedule(args.name, p, m, v)
    except ValueError as e:
        print(f"jaxpar: error: {e}", file=sys.stderr)
        return 2
    print(render(timeline))
    print("forwards: microbatch digits; backwards: lower-case letters (a = 0); weight gradients: upper case; idle: .")
    print(f"bubble {bubble_fraction(timeline):.4f} (published {published_bubble(args.name, p, m, v):.4f}); "
          f"{peak_in_flight(timeline)} microbatch chunks of activations in flight on stage 0")
    if args.png:
        from jaxpar.pipeline.picture import save_png

        print(f"wrote {save_png(timeline, args.png, f'{args.name}: p={p}, m={m}, v={v}')}")
    return 0
