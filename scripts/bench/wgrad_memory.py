"""Peak bytes of one W op (the B/W split's deferred weight GEMMs of one stage and microbatch), on CPU.

    PYTHONPATH=. python scripts/bench/wgrad_memory.py [--layers 8] [--hidden 1024]

Counts tensor bytes exactly (megatron_vshape.testing.memory.PeakBytes), so the figures are the same on
every run; on GPUs torch.cuda.max_memory_allocated shows the same difference.  Prints one row per path:
plain `.grad`, and gradient-accumulation fusion into `main_grad` (megatron-core DDP's marker and hook).
"""
from __future__ import annotations

import argparse
import tempfile


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args(argv)

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_vshape.testing.memory import w_op_peak

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        try:
            print(f"W op of {args.layers} linears [{args.hidden} x {args.hidden}] fp32, one microbatch")
            print(f"{'path':<10} {'peak bytes':>12} {'in weights':>10}")
            for fused in (False, True):
                peak, weight = w_op_peak(args.layers, args.hidden, fused)
                print(f"{'main_grad' if fused else 'plain':<10} {peak:>12} {peak / weight:>10.2f}")
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
