"""Pipeline parallelism: schedules as tables (schedule), compiled into tick tables
(program) that one SPMD executor follows (executor), on stages cut from a model (stages)."""

from jaxpar.pipeline.schedule import SCHEDULES, Op, Timeline, bubble_fraction, build_schedule, peak_in_flight, render

__all__ = ["SCHEDULES", "Op", "Timeline", "bubble_fraction", "build_schedule", "peak_in_flight", "render"]
