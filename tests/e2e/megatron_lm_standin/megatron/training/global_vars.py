import torch

_ARGS = None


def get_args():
    return _ARGS


def set_args(args):
    global _ARGS
    _ARGS = args


def print_rank_0(message):
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)
