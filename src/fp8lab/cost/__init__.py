"""`fp8lab.cost`: what a recipe costs on a GPU, from fp8lab's own counts and a calibrated roofline."""

from fp8lab.cost.counting import Event, GemmEvent, StepCounts, count_linear_step

__all__ = ["Event", "GemmEvent", "StepCounts", "count_linear_step"]
