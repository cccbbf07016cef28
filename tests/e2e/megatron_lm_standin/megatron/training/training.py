"""pretrain / get_model / train_step, reduced to what decides the pipeline (see ../../README.md)."""
import torch
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage, is_vp_first_stage, is_vp_last_stage
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config
from megatron.core import parallel_state as mpu

from megatron.training.global_vars import get_args, print_rank_0
from megatron.training.initialize import initialize_megatron


def get_model(model_provider_func, model_type=ModelType.encoder_or_decoder, wrap_with_ddp=True, config=None,
              pg_collection=None):
    """Megatron-LM's decision: chunk i of pipeline rank r pre-processes when r and i are first, and
    post-processes when both are last; then weights are loaded (here: deterministic by name)."""
    from megatron_vshape.testing.tiny_gpt import load_weights

    args = get_args()
    pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    vp_size = args.virtual_pipeline_model_parallel_size
    if args.pipeline_model_parallel_size > 1 and vp_size is not None:
        model = []
        for i in range(vp_size):
            chunk = model_provider_func(
                pre_process=is_pp_first_stage(pg_collection.pp) and is_vp_first_stage(vp_stage=i, vp_size=vp_size),
                post_process=is_pp_last_stage(pg_collection.pp) and is_vp_last_stage(vp_stage=i, vp_size=vp_size),
                vp_stage=i, config=config, pg_collection=pg_collection)
            chunk.model_type, chunk.vp_stage = model_type, i
            model.append(chunk)
    else:
        model = [model_provider_func(pre_process=is_pp_first_stage(pg_collection.pp),
                                     post_process=is_pp_last_stage(pg_collection.pp), config=config,
                                     pg_collection=pg_collection)]
        model[0].model_type = model_type
    load_weights(model, args.seed)
    if args.bf16:  # as Megatron-LM: wrap every chunk after building it
        model = [Float16Module(get_model_config(chunk), chunk) for chunk in model]
    return model


def train_step(forward_step_func, data_iterator, model, optimizer, config, forward_backward_func):
    args = get_args()
    optimizer.zero_grad(set_to_none=True)
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=args.global_batch_size // (args.micro_batch_size * args.data_parallel_size),
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, decoder_seq_length=None,
        forward_only=False, adjust_tensor_shapes_fn=None, force_all_reduce=False)
    optimizer.step()
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        total = torch.vstack([x["lm loss"].view(-1) for x in losses_reduced]).sum(dim=0)
        return {"lm loss": float(total[0] / total[1])}
    return {}


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}, get_embedding_ranks=None,
             get_position_embedding_ranks=None, non_loss_data_func=None, store=None, inprocess_call_wrapper=None):
    initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults,
                        get_embedding_ranks=get_embedding_ranks,
                        get_position_embedding_ranks=get_position_embedding_ranks, store=store)
    args = get_args()
    model = get_model(model_provider, model_type)
    config = get_model_config(model[0])
    unique = list(dict.fromkeys(p for chunk in model for p in chunk.parameters()))
    optimizer = torch.optim.SGD(unique, lr=args.lr)
    num_samples = [args.train_iters * args.global_batch_size, 0, 0]
    if args.virtual_pipeline_model_parallel_size is not None:
        datasets = [train_valid_test_dataset_provider(num_samples, vp_stage=i)[0] for i in range(len(model))]
        train_data_iterator = [iter(ds) if ds is not None else None for ds in datasets]
    else:
        ds = train_valid_test_dataset_provider(num_samples)[0]
        train_data_iterator = iter(ds) if ds is not None else None
    forward_backward_func = get_forward_backward_func()
    print_rank_0(f"forward-backward function: {getattr(forward_backward_func, '__name__', forward_backward_func)}")
    for iteration in range(1, args.train_iters + 1):
        loss = train_step(forward_step_func, train_data_iterator, model, optimizer, config, forward_backward_func)
        if loss and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:  # print_rank_last
            print(f" iteration {iteration:8d}/{args.train_iters:8d} | lm loss: {loss['lm loss']!r} |", flush=True)
    torch.distributed.barrier()
    mpu.destroy_model_parallel()
    torch.distributed.destroy_process_group()
