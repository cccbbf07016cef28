"""Schedules as data: pure Python, no torch. Generators, verifier, simulator, pictures, export."""
from .errors import ConfigError
from .ops import B, BW, F, W, Costs, Op, Placement, Schedule

__all__ = ["ConfigError", "Op", "Placement", "Costs", "Schedule", "F", "B", "W", "BW"]
