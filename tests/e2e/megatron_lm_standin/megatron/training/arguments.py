"""parse_args / validate_args / core_transformer_config_from_args with Megatron-LM's names and flags."""
import argparse
import os

import torch


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(description="Megatron-LM stand-in", allow_abbrev=False)
    g = parser.add_argument_group("model and parallelism (Megatron-LM flag names)")
    for flag, kind, default in (
        ("--num-layers", int, None), ("--hidden-size", int, None), ("--num-attention-heads", int, None),
        ("--ffn-hidden-size", int, None), ("--seq-length", int, None), ("--max-position-embeddings", int, None),
        ("--vocab-size", int, 64), ("--micro-batch-size", int, 1), ("--global-batch-size", int, None),
        ("--tensor-model-parallel-size", int, 1), ("--pipeline-model-parallel-size", int, 1),
        ("--num-layers-per-virtual-pipeline-stage", int, None), ("--num-virtual-stages-per-pipeline-rank", int, None),
        ("--microbatch-group-size-per-virtual-pipeline-stage", int, None),
        ("--decoder-first-pipeline-num-layers", int, None), ("--decoder-last-pipeline-num-layers", int, None),
        ("--pipeline-model-parallel-layout", str, None),
        ("--train-iters", int, 1), ("--train-samples", int, None), ("--lr", float, 0.0), ("--seed", int, 1234),
        ("--distributed-backend", str, "gloo"), ("--transformer-impl", str, "local"),
        ("--cuda-graph-impl", str, "none"), ("--ckpt-format", str, "torch_dist"), ("--yaml-cfg", str, None),
    ):
        g.add_argument(flag, type=kind, default=default)
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None)
    g.add_argument("--cuda-graph-scope", nargs="+", default=[])
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    for flag in ("--overlap-moe-expert-parallel-comm", "--tp-comm-overlap", "--delay-wgrad-compute", "--bf16",
                 "--decrease-batch-size-if-needed", "--fine-grained-activation-offloading", "--enable-cuda-graph",
                 "--use-megatron-fsdp"):
        g.add_argument(flag, action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    g.add_argument("--mock-data", action="store_true")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args = parser.parse_known_args()[0] if ignore_unknown_args else parser.parse_args()
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    return args


def validate_args(args, defaults={}):
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    assert args.world_size % model_parallel == 0, "world size must be a multiple of tp * pp"
    args.data_parallel_size = args.world_size // model_parallel
    assert args.data_parallel_size == 1, "the stand-in runs one data-parallel rank"
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    # Megatron-LM derives the virtual pipeline size from these flags here (at most one of them).
    given = [args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank,
             args.pipeline_model_parallel_layout]
    assert sum(v is not None for v in given) <= 1, "pass one of the virtual pipeline flags and the layout"
    if args.pipeline_model_parallel_layout is not None:
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        stages = PipelineParallelLayerLayout.get_num_stages_from_str(args.pipeline_model_parallel_layout)
        args.virtual_pipeline_model_parallel_size = stages // args.pipeline_model_parallel_size
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        per_rank = args.num_layers // args.pipeline_model_parallel_size
        args.virtual_pipeline_model_parallel_size = per_rank // args.num_layers_per_virtual_pipeline_stage
    else:
        args.virtual_pipeline_model_parallel_size = args.num_virtual_stages_per_pipeline_rank
    if args.virtual_pipeline_model_parallel_size == 1:
        args.virtual_pipeline_model_parallel_size = None
    if args.virtual_pipeline_model_parallel_size is not None and not args.overlap_p2p_comm:
        assert args.pipeline_model_parallel_size > 2, \
            "When interleaved schedule is used and p2p communication overlap is disabled, pipeline-model-parallel " \
            "size should be greater than 2"  # Megatron-LM's own check
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.padded_vocab_size = args.vocab_size
    return args


def core_transformer_config_from_args(args):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        bf16=args.bf16, delay_wgrad_compute=args.delay_wgrad_compute,  # Megatron-LM copies both from args
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
