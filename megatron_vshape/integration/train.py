"""GPT pretraining on megatron-core under any pipeline schedule: the loop behind
`scripts/pretrain_gpt.py` and `megatron-vshape pretrain`, launched by torchrun.

Megatron-LM's flag names; `--config FILE.yaml` (keys are flag names, dashes or underscores;
command-line flags override the file).  NCCL on GPUs, gloo on CPU, chosen automatically.

What runs where:
  * model: this rank's megatron-core GPTModel chunks from `runtime.chunks.build_model_chunks`
    (global layer numbers, the V's two chunks, tied embeddings on every placement); weights a pure
    function of --seed and each parameter's global name (`runtime.init`), so every schedule and
    pipeline size starts from the same model.
  * step: the schedule's forward-backward function (`runtime.executor`), or megatron-core's own
    without pipelining at pp=1.
  * GPU: megatron-core's DistributedDataParallel, Float16Module for --bf16/--fp16, and
    get_megatron_optimizer (Adam).  CPU: megatron-core's DDP and optimizers allocate on CUDA, so
    the chunks stay unwrapped, `runtime.grads.finalize_grads` averages gradients over the
    data-parallel group and sums the tied embedding (gloo), and `CpuAdamW` (torch AdamW with
    Megatron's no-decay groups and global-norm clipping) steps them.
  * logs: Megatron-style lines every --log-interval, and on global rank 0 the VSHAPE_METRICS and
    VSHAPE_SUMMARY lines (the contract in the team brief).

Exit status: 2 for a configuration error (found before any process group exists, or a damaged
checkpoint), 1 for a failure while running (a diverged run: `divergence`); under torchrun the error
is said once (`errors`) and torchrun itself exits 1.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import statistics
import sys
import time
from datetime import timedelta
from functools import partial
from typing import Dict, List, Optional

from ..argtypes import Parser, quiet_megatron_notices
from ..schedule.errors import ConfigError
from . import gpu_defaults, rebalance, startup
from .args import TE_MIN_FOR_SPLIT, _te_version, add_pipeline_arguments, validate_pipeline_args
from .divergence import Counters, Diverged, finite, json_safe
from .divergence import add_arguments as add_divergence_arguments
from .errors import report, say
from .layout import given_split

EXIT_CONFIG, EXIT_RUNTIME = 2, 1
PROG = "megatron-vshape pretrain"
# Dense bf16 peak TFLOP/s per GPU for MFU, by device-name substring.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


# ---- flags ---------------------------------------------------------------------------------------

class _Parser(Parser):
    """The driver's parser: every rank parses the same flags, so a usage error is said once (rank 0)."""

    def exit(self, status=0, message=None):
        if status and message:
            say(message.rstrip("\n"), shared=True)
            sys.exit(status)
        super().exit(status, message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="YAML file of flag values (keys are flag names); command-line flags override it")
    m = p.add_argument_group("model")
    m.add_argument("--num-layers", type=int, default=4)
    m.add_argument("--hidden-size", type=int, default=64)
    m.add_argument("--num-attention-heads", type=int, default=4)
    m.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden size")
    m.add_argument("--seq-length", type=int, default=64)
    m.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    m.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"), default="learned_absolute")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    m.add_argument("--hidden-dropout", type=float, default=0.1)
    m.add_argument("--attention-dropout", type=float, default=0.1)
    m.add_argument("--init-method-std", type=float, default=0.02)
    m.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default=None,
                   help="default: transformer_engine on GPUs where Transformer Engine is installed, else local")
    m.add_argument("--bf16", action="store_true")
    m.add_argument("--fp16", action="store_true")
    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    par.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", dest="microbatch_group_size_per_vp_stage",
                     type=int, default=None)
    par.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    par.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    par.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    par.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    par.add_argument("--pipeline-model-parallel-layout", default=None)
    add_pipeline_arguments(p)
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=int, default=1)
    t.add_argument("--global-batch-size", type=int, default=None, help="default micro batch size x data-parallel size")
    t.add_argument("--train-iters", type=int, default=10)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root"),
                   default="linear")  # Megatron-LM's default
    t.add_argument("--lr-warmup-iters", type=int, default=0)
    t.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    t.add_argument("--override-opt-param-scheduler", action="store_true",
                   help="on --load: this run's learning-rate and weight-decay flags, not the checkpoint's")
    t.add_argument("--use-checkpoint-opt-param-scheduler", action="store_true",
                   help="on --load: the checkpoint's learning-rate and weight-decay schedule, not this run's flags")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--seed", type=int, default=1234)
    add_divergence_arguments(t)
    lg = p.add_argument_group("logging and evaluation")
    lg.add_argument("--log-interval", type=int, default=1)
    lg.add_argument("--eval-interval", type=int, default=None, help="evaluate every N iterations and at the end")
    lg.add_argument("--eval-iters", type=int, default=2)
    lg.add_argument("--peak-tflops", type=float, default=None, help="per-GPU peak for MFU (default: by GPU name)")
    lg.add_argument("--config-name", default=None, help="name in VSHAPE_SUMMARY (default: the --config file's stem)")
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--save", default=None, metavar="DIR")
    ck.add_argument("--load", default=None, metavar="DIR")
    ck.add_argument("--save-interval", type=int, default=None)
    ck.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                    help="with --load DIR: load iteration N's checkpoint instead of the latest")
    ck.add_argument("--load-fallback", action="store_true",
                    help="with --load: when the checkpoint's files do not match their checksums, load the newest "
                         "intact checkpoint in the same directory instead of stopping")
    ck.add_argument("--save-retain", type=int, default=None, metavar="K",
                    help="keep only the newest K checkpoints in --save (never the one this run resumed from)")
    d = p.add_argument_group("data")
    d.add_argument("--mock-data", action="store_true", help="megatron-core's mock GPT dataset")
    d.add_argument("--data-path", nargs="+", default=None, help="indexed dataset prefix(es): PATH or W1 P1 W2 P2")
    d.add_argument("--split", default="969,30,1")
    d.add_argument("--data-cache-path", default=None)
    d.add_argument("--tokenizer-type", default="NullTokenizer")
    d.add_argument("--vocab-size", type=int, default=None)
    d.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    return p


def load_config(path: str, parser: argparse.ArgumentParser) -> Dict[str, object]:
    """{dest: value} from a YAML file whose keys are flag names (dashes or underscores)."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    except (UnicodeDecodeError, ValueError):  # a binary file (yaml's reader raises either)
        raise ConfigError(f"--config {path}: not a text file; give a YAML file of flag values") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    dests = {a.dest for a in parser._actions}
    out = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        dest = {"microbatch_group_size_per_virtual_pipeline_stage": "microbatch_group_size_per_vp_stage"}.get(dest, dest)
        if dest not in dests or dest in ("help", "config"):
            raise ConfigError(f"--config {path}: unknown key {key!r}; keys are this command's flag names "
                              f"(see --help)")
        out[dest] = [str(v) for v in value] if dest == "data_path" and isinstance(value, list) else value
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    if first.config:
        parser.set_defaults(**load_config(first.config, parser))
    args = parser.parse_args(argv)
    if args.config_name is None and args.config:
        args.config_name = os.path.splitext(os.path.basename(args.config))[0]
    return args


def validate(args, world_size: Optional[int] = None, cuda: Optional[bool] = None, check_paths: bool = True):
    """Driver checks on top of validate_pipeline_args; returns the pipeline plan (None at pp=1).
    Sets the derived sizes on args.  Touches no process group.  `world_size`: default torchrun's
    WORLD_SIZE.  `cuda`: whether the run has GPUs (default: this machine's); `check_paths`: whether
    the files to read and the folders to write are checked here (scripts/slurm/submit_grid.py
    validates on the submitting host, for nodes whose storage it may not see)."""
    import torch

    cuda = torch.cuda.is_available() if cuda is None else cuda
    args.world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    startup.check_numbers(args)  # each flag alone first: a cross-flag message never blames the wrong one
    if args.pipeline_model_parallel_size > 1 and args.pipeline_schedule is None and not args.pipeline_schedule_file:
        args.pipeline_schedule = "1f1b"
    args.pipeline_machine = "gpu" if cuda else "cpu"  # what --pipeline-balance auto prices
    plan = validate_pipeline_args(args)  # layers per stage too (integration/layout.py)
    if plan is None and given_split(args):
        raise ConfigError(f"{', '.join(given_split(args))}: splits layers over pipeline stages; it needs "
                          f"--pipeline-model-parallel-size >= 2 (got {args.pipeline_model_parallel_size}): unset it")
    args.data_parallel_size = plan.data_parallel_size if plan else _dp(args)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % (args.micro_batch_size * args.data_parallel_size):
        raise ConfigError(f"--global-batch-size={args.global_batch_size} is not divisible by --micro-batch-size="
                          f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"--hidden-size={args.hidden_size} is not divisible by --num-attention-heads="
                          f"{args.num_attention_heads}")
    if args.num_attention_heads % args.tensor_model_parallel_size:
        raise ConfigError(f"--num-attention-heads={args.num_attention_heads} is not divisible by "
                          f"--tensor-model-parallel-size={args.tensor_model_parallel_size}")
    if plan is None and args.num_layers % args.pipeline_model_parallel_size:
        raise ConfigError(f"--num-layers={args.num_layers} is not divisible by pp={args.pipeline_model_parallel_size}")
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive; pass one")
    if (args.fp16 or args.bf16) and not cuda:
        raise ConfigError(f"--{'fp16' if args.fp16 else 'bf16'} on CPU: megatron-core's mixed-precision optimizer "
                          "and Float16Module need CUDA; train in fp32 on CPU (drop the flag)")
    if args.transformer_impl == "transformer_engine" and not cuda:
        raise ConfigError("--transformer-impl transformer_engine needs GPUs; use --transformer-impl local on CPU")
    args.transformer_impl = gpu_defaults.transformer_impl(args.transformer_impl, cuda, _te_version(),
                                                          bool(plan and plan.schedule.split_backward), TE_MIN_FOR_SPLIT)
    if bool(args.mock_data) == bool(args.data_path):
        raise ConfigError("pass exactly one of --mock-data and --data-path PREFIX")
    if args.vocab_size is None:
        raise ConfigError("--vocab-size N is needed (NullTokenizer: token ids 0..N-1)")
    if args.save_interval is not None and not args.save:
        raise ConfigError(f"--save-interval={args.save_interval} needs --save DIR")
    if (args.save or args.load) and _checkpoint_module() is None:
        raise ConfigError("--save/--load: checkpointing (megatron_vshape.integration.checkpoint) is not available "
                          "in this version")
    startup.check_combinations(args)
    if plan is None and args.pipeline_replan_after is not None:
        raise ConfigError(f"--pipeline-replan-after={args.pipeline_replan_after} re-plans a pipeline schedule; it needs "
                          f"--pipeline-model-parallel-size >= 2 (got {args.pipeline_model_parallel_size}): unset it")
    rebalance.check(args)
    if check_paths:
        startup.check_paths(args)  # last: the cheap mistakes first, then the file system
    return plan


def _dp(args) -> int:
    mp = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.world_size % mp:
        raise ConfigError(f"world size {args.world_size} is not divisible by tp x pp = {mp}")
    return args.world_size // mp


def _checkpoint_module():
    try:
        from . import checkpoint
    except ImportError:
        return None
    return checkpoint if hasattr(checkpoint, "save_checkpoint") else None


# ---- model, optimizer ----------------------------------------------------------------------------

def padded_vocab_size(args) -> int:
    multiple = max(1, args.make_vocab_size_divisible_by) * args.tensor_model_parallel_size
    return -(-(args.vocab_size + 1) // multiple) * multiple  # NullTokenizer adds the end-of-document id


def transformer_config(args, device):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    gpu = device.type == "cuda"
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16, fp16=args.fp16,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, use_cpu_initialization=not gpu,
        **gpu_defaults.config_options(args, gpu),  # fusions and output deallocation on GPUs
        # Not delay_wgrad_compute here: megatron-core 0.16 refuses it without MoE expert-parallel overlap;
        # build_model_chunks(split_backward=True) sets it on the built config (runtime.wgrad.defer_te_wgrad).
    )


def _layer_spec(args, device):
    if device.type == "cpu":
        from ..runtime.cpu_spec import cpu_gpt_block_spec

        return cpu_gpt_block_spec
    from megatron.core.models.gpt import gpt_layer_specs

    if args.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec()


def build_model(args, placement, device, split_backward: bool = False, stage_layers=None):
    from ..runtime.chunks import build_model_chunks
    from ..runtime.init import init_by_name

    config = transformer_config(args, device)
    chunks = build_model_chunks(
        config, placement, vocab_size=padded_vocab_size(args),
        max_sequence_length=args.max_position_embeddings or args.seq_length,
        transformer_layer_spec=_layer_spec(args, device),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, stage_layers=stage_layers,
        split_backward=split_backward)  # Transformer Engine layers defer their weight gradients to W
    init_by_name(chunks, args.seed, args.init_method_std, args.num_layers)
    if device.type == "cpu":
        from ..runtime.cpu_spec import use_cpu_rotary

        for chunk in chunks:
            use_cpu_rotary(chunk)
    # The chunks share a copy of `config` made for the placement: Megatron's hooks go on that one.
    return [chunk.to(device) for chunk in chunks], chunks[0].config


class CpuAdamW:
    """torch AdamW with Megatron's parameter groups (no weight decay on biases and norms, lr and
    weight decay set by OptimizerParamScheduler) and its global-norm clipping; `step()` returns
    (updated, grad_norm, None) like megatron-core's optimizers."""

    def __init__(self, chunks, args):
        import torch

        from ..runtime.grads import unique_parameters

        self.params = unique_parameters(chunks)
        decay = [p for p in self.params if p.ndim > 1]
        no_decay = [p for p in self.params if p.ndim <= 1]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
            lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, weight_decay=args.weight_decay)
        self.clip_grad = args.clip_grad

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self):
        from ..runtime.grads import clip_grad_norm

        norm = clip_grad_norm(self.params, self.clip_grad)
        if not math.isfinite(norm):
            return False, norm, None
        self.optimizer.step()
        return True, norm, None

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)


def use_megatron_optimizer(config, chunks, optimizer, finalize_model_grads) -> None:
    """The hooks Megatron-LM's training loop sets for megatron-core's optimizer and DDP chunks.
    grad_scale_func: backward_step multiplies each loss by the optimizer's loss scale (fp16's
    dynamic scale, 1 otherwise), which the optimizer divides out of the gradients again."""
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    config.grad_scale_func = optimizer.scale_loss


def build_optimizer(args, chunks, config, device):
    """(chunks as trained, optimizer, scheduler)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if device.type == "cuda":
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        if args.bf16 or args.fp16:
            chunks = [Float16Module(config, c) for c in chunks]
        # delay_wgrad_compute: DDP takes deferring TE layers' gradients from their hooks at W (runtime.wgrad).
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False,
                                                   delay_wgrad_compute=config.delay_wgrad_compute)
        chunks = [DistributedDataParallel(config, ddp_config, c) for c in chunks]
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16, params_dtype=config.params_dtype,
            use_distributed_optimizer=False), chunks)
        use_megatron_optimizer(config, chunks, optimizer, finalize_model_grads)
    else:
        from ..runtime.grads import finalize_grads

        optimizer = CpuAdamW(chunks, args)
        config.finalize_model_grads_func = finalize_grads
    # Megatron counts scheduler steps in samples (one step of global-batch-size per iteration).
    decay = (args.lr_decay_iters or args.train_iters) * args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=decay, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=decay, wd_incr_style="constant",
        # As Megatron-LM: on --load a schedule flag that differs from the checkpoint's is an error, unless
        # one of these says which wins (checkpoint.load_checkpoint says so in one line).
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler)
    return chunks, optimizer, scheduler


# ---- one step ------------------------------------------------------------------------------------

def forward_step(data_iterator, model):
    from ..runtime.loss import loss_func

    batch = next(data_iterator)
    device = next(model.parameters()).device
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    # Float16Module upcasts the output of "the last stage" by parallel_state, which on the V is
    # rank p-1's stage p (a hidden state that must keep the pipeline dtype): keep outputs as computed.
    kwargs = {"fp32_output": False} if _half_precision(model) else {}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], **kwargs)
    return output, partial(loss_func, batch["loss_mask"])


def _half_precision(model) -> bool:
    """Whether megatron-core's Float16Module is among the chunk's wrappers (DDP -> Float16Module -> GPTModel)."""
    while model is not None:
        if type(model).__name__ == "Float16Module":
            return True
        model = getattr(model, "module", None)
    return False


def reduce_loss(loss_dicts, device):
    """(loss sum, token count) over this step's microbatches and the data-parallel replicas, known on
    every rank (the loss dicts arrive on the last pipeline rank only)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    total = torch.zeros(2, dtype=torch.float64, device=device)
    for d in loss_dicts:
        total += d["lm loss"].to(device=device, dtype=torch.float64)
    dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    return float(total[0]), float(total[1])


# ---- measurements -------------------------------------------------------------------------------

def step_figures(ops, t0: float, chunks: int) -> dict:
    """This rank's busy time, end time since t0 and per-op-kind durations (per rank's share)."""
    busy = sum(e - s for _, _, _, s, e in ops)
    end = max((e for *_, e in ops), default=t0) - t0
    by_kind: Dict[str, List[float]] = {}
    for kind, _, _, s, e in ops:
        by_kind.setdefault(kind, []).append((e - s) * chunks)
    return {"busy": busy, "end": end, "kinds": {k: statistics.mean(v) for k, v in by_kind.items()}}


def measured_costs(per_rank_kinds: List[Dict[str, float]]) -> dict:
    """F, B, W (seconds, per rank's share of the model) averaged over pipeline ranks; a fused BW
    (schedules without the split) is reported as B and W halves; C is not measured (0)."""
    def mean(kind):
        vals = [k[kind] for k in per_rank_kinds if kind in k]
        return statistics.mean(vals) if vals else None

    f, b, w, bw = mean("F"), mean("B"), mean("W"), mean("BW")
    if b is None and bw is not None:
        b = w = bw / 2
    return {"F": f, "B": b, "W": w, "C": 0.0}


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def model_flops(args, tokens: int) -> float:
    """Training FLOPs for `tokens` tokens (forward + backward; Narayanan et al. 2021's count with
    the given FFN size): 6 * tokens * params-like term plus attention's sequence term."""
    h, layers, s = args.hidden_size, args.num_layers, args.seq_length
    ffn = args.ffn_hidden_size or 4 * h
    per_token = layers * (8 * h * h + 4 * h * ffn + 4 * s * h) + 2 * h * padded_vocab_size(args)
    return 3 * per_token * tokens


# ---- the run -------------------------------------------------------------------------------------

def _layers_text(plan, placement, num_layers) -> str:
    from ..schedule.layout import describe

    if plan is None or plan.stage_layers is None:
        return f"{num_layers // placement.num_stages} per stage"
    return "per stage " + describe(plan.stage_layers, placement)


def _print0(*a):
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(*a, flush=True)


def init_distributed():
    """torchrun's environment -> the default process group (NCCL on GPUs, gloo on CPU)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "MASTER_ADDR" not in os.environ:  # a plain `python scripts/pretrain_gpt.py`: one process
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                           "WORLD_SIZE": "1"})
    dist.init_process_group(backend, timeout=timedelta(minutes=10))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(args, placement):
    import torch
    from megatron.core import parallel_state, tensor_parallel

    from ..runtime.chunks import embedding_ranks_for

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=placement.chunks if placement.chunks > 1 else None,
        get_embedding_ranks=embedding_ranks_for(placement))
    # Dropout: a stream of its own per pipeline rank, on CPU and on GPUs (whose default generator
    # model_parallel_cuda_manual_seed sets), as Megatron-LM seeds them; weights do not depend on it
    # (runtime.init).
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def forward_backward_func(args, plan, recorder, device):
    if plan is None:
        if device.type == "cpu":
            return forward_backward_no_pipelining_cpu
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()
    from ..runtime.executor import get_forward_backward_func

    if plan.as_built:  # auto's choice (built under the memory budget) or a file's: run it as built
        return get_forward_backward_func(plan.schedule, stats=recorder, p2p_timeout=args.pipeline_p2p_timeout)
    # By name, so that the executor can re-plan it from measured op times (--pipeline-replan-after).
    return get_forward_backward_func(plan.name, plan.costs, stats=recorder, p2p_timeout=args.pipeline_p2p_timeout,
                                     schedule_options=plan.options)


def forward_backward_no_pipelining_cpu(*, forward_step_func, data_iterator, model, num_microbatches, seq_length,
                                       micro_batch_size, forward_only=False, **_):
    """megatron-core's forward_backward_no_pipelining (which puts its token count on CUDA), on CPU:
    megatron's own forward_step and backward_step per microbatch, then finalize_model_grads_func."""
    import torch
    from megatron.core.utils import get_model_config, get_model_type

    from ..runtime.compat import megatron_steps

    megatron_forward_step, backward_step, _ = megatron_steps()

    (model,) = model if isinstance(model, list) else [model]
    data_iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    config, store = get_model_config(model), []
    total_tokens = torch.zeros([], dtype=torch.int)
    for i in range(num_microbatches):
        output, tokens = megatron_forward_step(forward_step_func, data_iterator, model, num_microbatches, None, store,
                                               config, cp_group_size=1, is_first_microbatch=i == 0,
                                               current_microbatch=i, is_last_stage=True)
        total_tokens += tokens
        if not forward_only:
            backward_step(None, output, None, get_model_type(model), config)
    if not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([model], total_tokens if config.calculate_per_token_loss else None)
    return store


class _Recorders:
    """A fresh stats recorder per step, behind one object the executor keeps."""

    def __init__(self):
        from ..runtime.stats import Recorder

        self._cls, self.current = Recorder, Recorder()

    def new(self):
        self.current = self._cls()
        return self.current

    def __getattr__(self, name):
        return getattr(self.current, name)


def run(args, plan) -> dict:
    """Train (and evaluate) in an initialised process group; returns the summary (on every rank)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ..schedule.ops import Placement

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    placement = plan.schedule.placement if plan else Placement("single", 1)
    args.plan = plan
    init_parallel(args, placement)
    dp_rank = ps.get_data_parallel_rank()
    pp, tp, dp, m = args.pipeline_model_parallel_size, args.tensor_model_parallel_size, args.data_parallel_size, \
        args.num_microbatches
    name = plan.name if plan else "none"
    _print0(f"megatron-vshape pretrain: schedule {name} (placement {placement.kind}, {placement.chunks} chunk(s) per "
            f"rank) pp={pp} tp={tp} dp={dp} world={dist.get_world_size()} backend={dist.get_backend()} | "
            f"{args.num_layers} layers ({_layers_text(plan, placement, args.num_layers)}), hidden {args.hidden_size}, "
            f"seq {args.seq_length}, vocab {padded_vocab_size(args)} (padded), tied embeddings: "
            f"{'no' if args.untie_embeddings_and_output_weights else 'yes'} | micro batch {args.micro_batch_size}, "
            f"global batch {args.global_batch_size}, {m} microbatches")
    if plan and plan.reason:
        _print0(f"  --pipeline-schedule auto chose {plan.name}: {plan.reason}")
    elif plan and "memory_budget" in plan.options:
        from .args import activation_peaks

        _print0(f"  {plan.name} planned under --pipeline-memory-budget {args.pipeline_memory_budget:g}: peak "
                f"{max(activation_peaks(plan.schedule, plan.stage_layers)):.3g} of 1F1B's activation memory per rank")
    if plan and plan.balance:
        _print0("  " + plan.balance.replace("\n", "\n  "))
    if plan and plan.source:
        _print0(f"  schedule read from --pipeline-schedule-file {plan.source} (verified)")
    chunks, optimizer, scheduler = _model_and_optimizer(args, plan, placement, device)
    recorders = _Recorders()
    fb = forward_backward_func(args, plan, recorders, device)
    evals = (args.train_iters // args.eval_interval + 1) * args.eval_iters * args.global_batch_size \
        if args.eval_interval else 0
    start_iter, consumed = 0, 0  # iterations done, training samples read (Megatron-LM's consumed_train_samples)
    ckpt = _checkpoint_module()
    if args.load and ckpt is not None:
        start_iter, extra = ckpt.load_checkpoint(args.load, chunks, optimizer, scheduler, step=args.ckpt_step,
                                                 fallback=args.load_fallback)
        # A run resumed with another --global-batch-size reads on from the samples the saved one read.
        saved = extra if isinstance(extra, dict) else {}
        consumed = int(saved.get("consumed_samples", start_iter * args.global_batch_size))
        _print0(f"  loaded checkpoint {args.load} at iteration {start_iter} ({consumed} samples consumed)")
        past = rebalance.resumed_past(args, plan, start_iter, saved.get("stage_layers"))
        if past:
            _print0(past)
    resumed = (ckpt.iteration_dir(args.save, start_iter),) if args.load and args.save else ()
    data = _build_data(args, consumed + (args.train_iters - start_iter) * args.global_batch_size, evals)

    rss0 = max_rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    history, metrics = [], []
    peaks = {"act": 0, "total": 0, "act_at_peak": 0, "buffers": 0}  # bytes, this rank, over the steps
    window = {"time": 0.0, "iters": 0, "loss": 0.0, "losses": 0}
    # Validation batches continue where the saved run left them, as Megatron-LM's consumed_valid_samples do.
    eval_round = start_iter // args.eval_interval if args.eval_interval else 0
    replanned, deferred = None, False
    # A checkpoint due at the re-balance's iteration is saved there, once its layout is known, so it records
    # the layout training goes on with (what a run resumed from it names: rebalance.resumed_past).
    rebalance_at = getattr(args, "pipeline_replan_after", None) if plan and plan.balance else None
    counters = Counters(args.check_for_nan_in_loss_and_grad, args.fp16)
    for it in range(start_iter, args.train_iters):
        replan_now = plan and it == getattr(args, "pipeline_replan_after", None) and it > start_iter
        if replan_now and not plan.balance:
            replanned = _replan(fb, it)
        elif replan_now:
            # --pipeline-balance auto: the layout too, changed at a checkpoint (rebalance.py says why).
            new, replanned, report = rebalance.rebalance(args, plan, recorders, device, it)
            _print0(report)
            if replanned["changed"] or deferred:
                ckpt.save_checkpoint(args.save, it, chunks, optimizer, scheduler,
                                     extra=_extra(plan=new, consumed=consumed), retain=args.save_retain, keep=resumed)
                _print0(f"  saved checkpoint {args.save} at iteration {it}")
            if replanned["changed"]:
                del chunks, optimizer, scheduler  # one model in memory at a time
                _release_memory(device)
                chunks, optimizer, scheduler = _model_and_optimizer(args, new, placement, device)
                ckpt.load_checkpoint(args.save, chunks, optimizer, scheduler, step=it)
                _print0(rebalance.restart_hint(args, new, it))
            plan = args.plan = new
            fb = forward_backward_func(args, plan, recorders, device)
        batches = _microbatches(args, data.train, consumed, dp_rank, device)
        consumed += args.global_batch_size
        optimizer.zero_grad()
        for c in chunks:
            if hasattr(c, "zero_grad_buffer"):  # megatron-core DDP (GPU)
                c.zero_grad_buffer()
        recorder = recorders.new()
        dist.barrier()
        t0 = time.perf_counter()
        loss_dicts = fb(forward_step_func=forward_step, data_iterator=_iters(batches, len(chunks)), model=chunks,
                        num_microbatches=m, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                        forward_only=False)
        loss_sum, tokens = reduce_loss(loss_dicts, device)
        loss = loss_sum / max(tokens, 1.0)
        lr = scheduler.optimizer.param_groups[0]["lr"]
        stop = counters.check_loss(it + 1, loss, lr)  # before the update: the weights stay finite
        # Unchecked (--no-check-for-nan-in-loss-and-grad), a non-finite loss skips the update too: megatron-core's
        # fp32 and bf16 optimizers step whatever the gradients hold (only fp16's loss scaler skips by itself).
        skip = stop or (not finite(loss) and not args.fp16)
        updated, grad_norm, _ = (False, None, None) if skip else optimizer.step()
        stop = stop or counters.record(it + 1, loss, grad_norm, updated, lr)
        if stop:
            _summary(args, plan, history, peaks, rss0, device, counters, "diverged")
            raise Diverged(stop)
        if updated:
            scheduler.step(increment=args.global_batch_size)
        dist.barrier()
        iter_time = time.perf_counter() - t0
        figures = step_figures(recorder.ops, t0, placement.chunks)
        peaks["act"] = max(peaks["act"], recorder.peak_bytes)
        if recorder.peak_total_bytes > peaks["total"]:
            peaks.update(total=recorder.peak_total_bytes, act_at_peak=recorder.activations_at_peak,
                         buffers=recorder.buffers_at_peak)
        history.append({"iteration": it + 1, "loss": loss, "time": iter_time, "figures": figures,
                        "grad_norm": grad_norm})
        window["time"] += iter_time
        window["iters"] += 1
        if finite(loss):  # the logged loss is the interval's mean, as Megatron-LM's (non-finite ones left out)
            window["loss"] += loss
            window["losses"] += 1
        if (it + 1) % args.log_interval == 0 or it + 1 == args.train_iters:
            mean = window["loss"] / window["losses"] if window["losses"] else loss
            metrics.append(_log(args, it + 1, consumed, mean, grad_norm, window, figures, peaks, rss0, device,
                                scheduler, counters))
            window = {"time": 0.0, "iters": 0, "loss": 0.0, "losses": 0}
        if args.eval_interval and ((it + 1) % args.eval_interval == 0 or it + 1 == args.train_iters):
            evaluate(args, fb, chunks, data, it + 1, eval_round, dp_rank, device)
            eval_round += 1
        if ckpt is not None and args.save and (
                (args.save_interval and (it + 1) % args.save_interval == 0) or it + 1 == args.train_iters):
            deferred = it + 1 == rebalance_at and it + 1 < args.train_iters
            if not deferred:
                ckpt.save_checkpoint(args.save, it + 1, chunks, optimizer, scheduler,
                                     extra=_extra(plan=plan, consumed=consumed), retain=args.save_retain, keep=resumed)
                _print0(f"  saved checkpoint {args.save} at iteration {it + 1}")
    summary = _summary(args, plan, history, peaks, rss0, device, counters)
    summary["replanned"] = replanned  # in-process only (not in the VSHAPE_SUMMARY line)
    return summary


def _extra(plan, consumed: int) -> dict:
    """What a checkpoint records beside the state: the samples consumed (where a resumed run reads on), and the
    layout training goes on with from it (at a re-balance, the new one), which a resumed run names
    (rebalance.resumed_past)."""
    return {"consumed_samples": consumed,
            "stage_layers": list(plan.stage_layers) if plan and plan.stage_layers else None}


def _model_and_optimizer(args, plan, placement, device):
    """This rank's chunks for the plan's layout, wrapped and with their optimizer and scheduler."""
    chunks, config = build_model(args, placement, device, split_backward=bool(plan and plan.schedule.split_backward),
                                 stage_layers=plan.stage_layers if plan else None)
    return build_optimizer(args, chunks, config, device)


def _release_memory(device) -> None:
    """Free the chunks just dropped before their successors are built (one model's memory at a time)."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _replan(fb, iteration: int) -> dict:
    """--pipeline-replan-after N: every rank re-plans from the op times of the last iteration
    (one collective; the same schedule everywhere); the order changes, the numbers do not."""
    try:
        new = fb.replan()
    except ConfigError as e:  # alike on every rank (after the collective); the executor keeps its schedule
        _print0(f"  re-planning at iteration {iteration} from the measured op times kept the schedule: {e}")
        return {"iteration": iteration, "schedule": getattr(fb.schedule, "name", fb.schedule), "order_changed": False,
                "kept": str(e)}
    changed = new.meta["order_changed"]
    _print0(f"  re-planned {new.name} at iteration {iteration} from the measured op times: order "
            f"{'changed' if changed else 'unchanged (the plan for these costs is the same)'}")
    return {"iteration": iteration, "schedule": new.name, "order_changed": changed,
            "stage_costs": [c.to_dict() for c in new.stage_costs or ()]}


def _build_data(args, train_samples, eval_samples):
    from .data import build_datasets

    return build_datasets(args, train_samples, eval_samples)


def _microbatches(args, dataset, first_sample, dp_rank, device):
    """The step's microbatches from sample `first_sample` on, already on `device`: a copy from pageable
    host memory inside the step may wait for the stream, and so for posted receives (docs/architecture.md,
    GPU rules)."""
    from .data import microbatches

    return [{k: v.to(device) for k, v in b.items()} for b in microbatches(
        dataset, first_sample, dp_rank, args.micro_batch_size, args.num_microbatches)]


def _iters(batches, chunks):
    from .data import iterators

    its = iterators(batches, chunks)
    return its if chunks > 1 else its[0]


def evaluate(args, fb, chunks, data, iteration, eval_round, dp_rank, device):
    """--eval-iters forward-only steps on the validation split, through the same executor."""
    import torch

    if data.valid is None:
        _print0(f"  (no validation split in --split {args.split}; skipping evaluation)")
        return None
    for c in chunks:
        c.eval()
    total, tokens = 0.0, 0.0
    with torch.no_grad():
        for k in range(args.eval_iters):
            batches = _microbatches(args, data.valid, (eval_round * args.eval_iters + k) * args.global_batch_size,
                                    dp_rank, device)
            out = fb(forward_step_func=forward_step, data_iterator=_iters(batches, len(chunks)), model=chunks,
                     num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                     micro_batch_size=args.micro_batch_size, forward_only=True)
            s, n = reduce_loss(out, device)
            total, tokens = total + s, tokens + n
    for c in chunks:
        c.train()
    loss = total / max(tokens, 1.0)
    _print0(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: "
            f"{math.exp(min(loss, 20)):.6E}")
    return loss


def _gather_pp(value):
    """`value` of every pipeline rank (first data-parallel replica's view), on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(out, value, group=ps.get_pipeline_model_parallel_group())
    return out


def _memory(peaks, rss0, device):
    """Per pipeline rank: peak activations (saved for backward), the peak of activations plus
    pipeline buffers (receive buffers, unconsumed messages, sends in flight, stage outputs kept
    whole) with its two parts, and the allocator's peaks (GPU) or the RSS growth (CPU)."""
    import torch

    gpu = device.type == "cuda"
    return _gather_pp({**peaks, "alloc": torch.cuda.max_memory_allocated() if gpu else max(0, max_rss_bytes() - rss0),
                       "reserved": torch.cuda.max_memory_reserved() if gpu else None})


def _memory_record(mem) -> dict:
    return {"peak_reserved_bytes": [x["reserved"] for x in mem],
            "activations_at_peak_bytes": [x["act_at_peak"] for x in mem],
            "pipeline_buffer_bytes_at_peak": [x["buffers"] for x in mem]}


def _log(args, iteration, consumed, loss, grad_norm, window, figures, peaks, rss0, device, scheduler, counters):
    per_rank = _gather_pp(figures)
    mem = _memory(peaks, rss0, device)
    makespan = max(f["end"] for f in per_rank)
    bubble = 1 - max(f["busy"] for f in per_rank) / makespan if makespan > 0 and any(f["busy"] for f in per_rank) \
        else None
    iter_time = window["time"] / max(window["iters"], 1)
    tokens_per_s = args.global_batch_size * args.seq_length / iter_time
    tflops = mfu = None
    if device.type == "cuda":
        import torch

        tflops = model_flops(args, args.global_batch_size * args.seq_length) / iter_time / \
            int(os.environ.get("WORLD_SIZE", "1")) / 1e12
        peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name()), None)
        mfu = tflops / peak if peak else None
    lr = scheduler.optimizer.param_groups[0]["lr"]
    act = [x["act"] for x in mem]
    alloc = [x["alloc"] for x in mem]
    mib = lambda xs: "/".join(f"{x / 2**20:.2f}" for x in xs)  # noqa: E731
    line = (f" iteration {iteration:8d}/{args.train_iters:8d} | consumed samples: {consumed:10d}"
            f" | elapsed time per iteration (ms): {1000 * iter_time:.1f} | learning rate: {lr:.6E}"
            f" | global batch size: {args.global_batch_size:5d} | lm loss: {loss:.6E}"
            f" | grad norm: {'-' if grad_norm is None else f'{grad_norm:.3f}'} | tokens/s: {tokens_per_s:.0f}")
    if tflops is not None:
        line += f" | TFLOP/s/GPU: {tflops:.1f}" + (f" | MFU: {100 * mfu:.1f}%" if mfu is not None else "")
    skipped, nan = counters.take_window()
    line += f" | number of skipped iterations: {skipped:3d} | number of nan iterations: {nan:3d}"
    line += (f" | bubble: {100 * bubble:.1f}%" if bubble is not None else "") + \
        f" | peak activations MiB per pp rank: {mib(act)} | peak {'allocated' if device.type == 'cuda' else 'RSS growth'}" \
        f" MiB: {mib(alloc)}" + (f" | peak reserved MiB: {mib(x['reserved'] for x in mem)}" if device.type == "cuda" else "") + \
        f" | at the peak, activations + pipeline buffers MiB: " + \
        "/".join(f"{x['act_at_peak'] / 2**20:.2f}+{x['buffers'] / 2**20:.2f}" for x in mem)
    _print0(line)
    record = {"iteration": iteration, "train_iters": args.train_iters, "loss": loss, "lr": lr, "grad_norm": grad_norm,
              "iter_time_s": iter_time, "tokens_per_s": tokens_per_s, "tflops_per_gpu": tflops, "mfu": mfu,
              "bubble_rate": bubble, "peak_activation_bytes": act, "peak_allocated_bytes": alloc,
              "skipped_iterations": skipped, "nan_iterations": nan, **_memory_record(mem)}
    _print0("VSHAPE_METRICS " + json.dumps(json_safe(record), allow_nan=False))
    return record


def _summary(args, plan, history, peaks, rss0, device, counters, status=None):
    import torch.distributed as dist

    # Op times from the second iteration on (the first warms up), per rank's share of the model.
    steady = history[1:] or history
    kinds = {}
    for h in steady:
        for kind, value in h["figures"]["kinds"].items():
            kinds.setdefault(kind, []).append(value)
    mine = {k: statistics.median(v) for k, v in kinds.items()}
    per_rank = _gather_pp({"kinds": mine, "bubbles": [(h["figures"]["busy"], h["figures"]["end"]) for h in steady]})
    mem = _memory(peaks, rss0, device)
    bubbles = []
    for i in range(len(steady)):
        busy = max(r["bubbles"][i][0] for r in per_rank)
        end = max(r["bubbles"][i][1] for r in per_rank)
        if end > 0 and busy > 0:
            bubbles.append(1 - busy / end)
    median_time = statistics.median(h["time"] for h in steady) if steady else None
    tokens_per_s = args.global_batch_size * args.seq_length / median_time if median_time else None
    tflops = None
    if device.type == "cuda" and median_time:
        tflops = model_flops(args, args.global_batch_size * args.seq_length) / median_time / dist.get_world_size() / 1e12
    summary = {
        "status": status or counters.status(), "schedule": plan.name if plan else "none",
        "schedule_options": plan.options if plan else None,  # what it was built with (v-auto's memory budget)
        "pp": args.pipeline_model_parallel_size,
        "tp": args.tensor_model_parallel_size, "dp": args.data_parallel_size, "world_size": dist.get_world_size(),
        "num_layers": args.num_layers, "hidden_size": args.hidden_size, "seq_length": args.seq_length,
        "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
        "num_microbatches": args.num_microbatches, "train_iters": args.train_iters,
        "first_loss": history[0]["loss"] if history else None, "final_loss": history[-1]["loss"] if history else None,
        "median_iter_time_s": median_time, "tokens_per_s": tokens_per_s, "tflops_per_gpu": tflops,
        "peak_activation_bytes": [x["act"] for x in mem], "peak_allocated_bytes": [x["alloc"] for x in mem],
        **_memory_record(mem),
        "measured_costs": measured_costs([r["kinds"] for r in per_rank]) if plan else None,
        "measured_bubble_rate": statistics.median(bubbles) if bubbles else None,
        "config_name": args.config_name,
        "skipped_iterations": counters.skipped, "nan_iterations": counters.nan,
    }
    _print0("VSHAPE_SUMMARY " + json.dumps(json_safe(summary), allow_nan=False))
    summary["losses"] = [h["loss"] for h in history]
    summary["grad_norms"] = [h["grad_norm"] for h in history]
    return summary


def main(argv=None) -> int:
    quiet_megatron_notices()
    # Dataset building logs a line per split ("Unable to save Mock indexes ..."): noise for users.
    logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)
    try:
        args = parse_args(argv)
        plan = validate(args)
        from ..runtime.compat import check_release

        check_release()  # an untested megatron-core release stops here, before any process group
    except ConfigError as e:  # every rank validates alike: said once (rank 0)
        report(PROG, str(e), shared=True)
        return EXIT_CONFIG
    import torch.distributed as dist

    try:
        init_distributed()
        run(args, plan)
    except (ConfigError, Diverged) as e:  # raised on every rank alike (checkpoint checks agree first)
        report(PROG, str(e), shared=True)
        return EXIT_CONFIG if isinstance(e, ConfigError) else EXIT_RUNTIME
    except Exception as e:
        from ..runtime.p2p import P2PTimeout

        if isinstance(e, P2PTimeout):  # its message names the rank, op and peer
            report(PROG, str(e), shared=False)
        else:  # a bug's or a system's failure: its trace helps, then the one line
            import traceback

            traceback.print_exc()
            report(PROG, f"{type(e).__name__}: {e}", shared=False)
        return EXIT_RUNTIME
    finally:
        if dist.is_initialized():
            # Free every group while the interpreter is alive: a gloo group that Megatron's
            # globals still hold is freed at interpreter shutdown instead, where it can abort
            # the process after a finished run ("terminate called without an active exception").
            import gc

            from ..runtime.groups import destroy_megatron

            destroy_megatron()
            dist.destroy_process_group()
            gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
