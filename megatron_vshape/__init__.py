"""megatron_vshape: the V-shape pipeline schedules of 'Pipeline Parallelism with Controllable
Memory' (Qi et al., NeurIPS 2024) for Megatron-core."""
from .schedule.errors import ConfigError

__version__ = "0.1.0"
__all__ = ["ConfigError", "__version__", "install"]


def install() -> None:
    """Hook the schedules into Megatron-LM's training (`--pipeline-schedule NAME`); see
    megatron_vshape.integration.megatron_lm.  Imported on call: importing megatron_vshape alone
    loads neither torch nor Megatron-LM."""
    from .integration.megatron_lm import install as _install

    _install()
