"""Megatron-core's model-parallel groups inside a rank that torch.distributed already joined.

The runtime, the tiny test model and the launchers all set them up the same way, so it lives
here, below every layer that needs it.
"""
from __future__ import annotations


def init_megatron(tp: int = 1, pp: int = 1, seed: int = 1234, **options) -> None:
    """Initialise megatron-core's parallel groups and its TP RNG tracker (CPU-safe: the CUDA
    RNG tracker only where CUDA is there).  `options` go to initialize_model_parallel."""
    import torch
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             **options)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_megatron() -> None:
    """Free every group init_megatron made (Megatron's globals hold them past
    destroy_process_group otherwise)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
