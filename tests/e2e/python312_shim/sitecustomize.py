"""TEST HARNESS ONLY: on Python 3.11, a no-op typing.override (Python 3.12's marker for type checkers; it
changes no behaviour), so that a subprocess can import Megatron-LM core_v0.18+ (megatron.training.models
uses it).  Put on PYTHONPATH by tests/e2e/test_megatron_lm_real.py for its launcher runs; the product
never patches the standard library (install() refuses those releases on 3.11 with one line)."""
import typing

if not hasattr(typing, "override"):
    typing.override = lambda method: method
