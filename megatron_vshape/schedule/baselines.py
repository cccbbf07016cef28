"""Baseline schedules: 1F1B, interleaved 1F1B, ZB-H1, ZB-H2."""
