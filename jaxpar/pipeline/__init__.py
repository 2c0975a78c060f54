"""Pipeline parallelism: schedules as tables (jaxpar.pipeline.schedule)."""

from jaxpar.pipeline.schedule import SCHEDULES, Op, Timeline, bubble_fraction, build_schedule, peak_in_flight, render

__all__ = ["SCHEDULES", "Op", "Timeline", "bubble_fraction", "build_schedule", "peak_in_flight", "render"]
