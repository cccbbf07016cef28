"""initialize_megatron: parse, validate, then torch.distributed and megatron-core's parallel groups."""
import torch
from megatron.core import parallel_state

from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import set_args


def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False, allow_no_cuda=False,
                        skip_mpu_initialization=False, get_embedding_ranks=None, get_position_embedding_ranks=None,
                        parsed_args=None, store=None):
    args = parse_args(extra_args_provider, ignore_unknown_args) if parsed_args is None else parsed_args
    validate_args(args, args_defaults)
    set_args(args)
    torch.distributed.init_process_group(backend=args.distributed_backend, rank=args.rank,
                                         world_size=args.world_size)
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size, get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks)
    torch.manual_seed(args.seed)
