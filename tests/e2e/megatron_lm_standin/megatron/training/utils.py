"""The two data-placement helpers of Megatron-LM's megatron/training/utils.py."""
import torch
from megatron.core import parallel_state as mpu

from megatron.training.global_vars import get_args

FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


def is_first_or_last_pipeline_stage(vp_stage):
    """Whether this chunk holds the model's first or last stage (by pipeline rank and virtual stage)."""
    ignore_virtual = vp_stage is None
    return (mpu.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
            or mpu.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage))


def get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank: bool = False):
    """TP rank 0 reads the microbatch and broadcasts what this pipeline rank needs: everything with
    pp=1 (or MTP layers here), tokens and positions on the first stage, labels and mask on the last."""
    args = get_args()
    if mpu.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        batch = {k: data[k] for k in FIELDS}
    else:
        shape = (args.micro_batch_size, args.seq_length)
        batch = {k: torch.empty(shape, dtype=torch.float32 if k == "loss_mask" else torch.int64) for k in FIELDS}
    if args.pipeline_model_parallel_size == 1 or mtp_on_this_rank:
        wanted = FIELDS
    elif mpu.is_pipeline_first_stage():
        wanted = ("tokens", "position_ids")
    elif mpu.is_pipeline_last_stage():
        wanted = ("labels", "loss_mask")
    else:
        wanted = ()
    src, group = mpu.get_tensor_model_parallel_src_rank(), mpu.get_tensor_model_parallel_group()
    for k in FIELDS:
        if k in wanted:
            torch.distributed.broadcast(batch[k], src, group=group)
        elif mpu.get_tensor_model_parallel_rank() != 0:
            batch[k] = None
    return batch
