"""Schedule names as `--pipeline-schedule` takes them, mapped to their generators.

A generator is a pure function `(pp, microbatches, costs=Costs(), **options) -> Schedule`,
with `costs` as users give them (one rank's share of the model), returning a verified
schedule; an option it does not take raises ConfigError (ops.check_no_options).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

from .errors import ConfigError
from .ops import Costs, Schedule

Generator = Callable[..., Schedule]
_GENERATORS: Dict[str, Generator] = {}


def register(name: str) -> Callable[[Generator], Generator]:
    def wrap(fn: Generator) -> Generator:
        _GENERATORS[name] = fn
        return fn

    return wrap


def _load_all() -> None:
    # Generators register themselves on import; importing here keeps registry.py free of cycles.
    from . import baselines, vshape  # noqa: F401


def names() -> List[str]:
    _load_all()
    return list(_GENERATORS)


def generator(name: str) -> Generator:
    _load_all()
    try:
        return _GENERATORS[name]
    except KeyError:
        raise ConfigError(f"unknown schedule {name!r}; choose one of: {', '.join(_GENERATORS)}") from None


def build(name: str, pp: int, microbatches: int, costs: Optional[Costs] = None, **options) -> Schedule:
    """Generate schedule `name` for pp ranks and `microbatches` microbatches."""
    return generator(name)(pp, microbatches, costs or Costs(), **options)
