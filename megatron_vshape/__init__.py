"""megatron_vshape: the V-shape pipeline schedules of 'Pipeline Parallelism with Controllable
Memory' (Qi et al., NeurIPS 2024) for Megatron-core."""
from .schedule.errors import ConfigError

__version__ = "0.1.0"
__all__ = ["ConfigError", "__version__"]
