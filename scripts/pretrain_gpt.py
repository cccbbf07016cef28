#!/usr/bin/env python
"""GPT pretraining under a megatron_vshape pipeline schedule; launch with torchrun, e.g.

    torchrun --nproc-per-node 4 scripts/pretrain_gpt.py --pipeline-model-parallel-size 4 \
        --pipeline-schedule v-half --num-layers 8 --hidden-size 64 --num-attention-heads 4 \
        --seq-length 64 --micro-batch-size 1 --global-batch-size 8 --train-iters 20 \
        --mock-data --vocab-size 128

Flags are Megatron-LM's (see --help); --config FILE.yaml holds them as keys.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_vshape.integration.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
