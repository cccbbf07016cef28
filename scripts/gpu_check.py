"""The GPU check: what CPU tests cannot see, on the GPUs at hand, in minutes and offline.

    .venv/bin/python scripts/gpu_check.py            # one table; exit 1 if any check failed
    python3 scripts/gpu_check.py --require-gpu       # on a GPU machine: no CUDA device is a failure

Each row is also printed as it finishes (a run killed at its time limit keeps what it found).
On a lent machine without megatron-core (Python 3.12, a CUDA torch), carry its wheel: README,
"The GPU check", has the two commands.

One GPU: the B/W split against megatron-core's fused backward for a GPT layer (local layers,
bf16 and fp16, with and without gradient-accumulation fusion, inside megatron-core's DDP with
overlapped grad reduce and Float16Module): gradients equal; the time of B + W against the fused
backward at hidden 4096; op timing by CUDA events (runtime.stats.Recorder); the fp16 loss scale in
effect through the driver's optimizer wiring.  Two or more GPUs: `megatron-vshape verify` of every
schedule at pp=2 over NCCL (and pp=4 with four GPUs), and a few training iterations of the driver
per schedule with time and memory per iteration; each run bounded by --timeout.

Transformer Engine and apex are used where importable and reported as absent otherwise.  On a
machine without CUDA the same code runs on CPU as far as it can (fp32, gloo) to prove the
plumbing, and every GPU part is reported as skipped, with why.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OK, FAIL, SKIP = "ok", "FAIL", "skipped"
Row = Tuple[str, str, str]  # (check, status, result)
# B + W against the fused backward: equal up to rounding (the same GEMMs, maybe other algorithms).
GRAD_TOLERANCE = 1e-3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds for each multi-process run")
    ap.add_argument("--timing-hidden", type=int, default=4096, help="hidden size of the B + W timing")
    ap.add_argument("--schedules", nargs="*", default=None, help="schedules of the multi-GPU part (default: all)")
    ap.add_argument("--require-gpu", action="store_true",
                    help="fail at once when no CUDA device is usable (a GPU machine's check must not pass on CPU)")
    args = ap.parse_args(argv)

    from megatron_vshape.argtypes import quiet_megatron_notices

    quiet_megatron_notices()
    import torch

    gpu = torch.cuda.is_available()
    started = time.monotonic()
    if args.require_gpu and not gpu:
        print_table([("CUDA device", FAIL, f"none usable (torch {torch.__version__}, --require-gpu)")], 0.0)
        return 1
    rows: List[Row] = [guarded("environment", lambda: environment(gpu)),
                       guarded("every schedule deadlock-free under NCCL's ordering (the verifier's model)",
                               nccl_ordering)]
    with world_of_one(gpu):
        rows += split_rows(gpu)
        rows += [guarded("time: B + W vs fused backward (bf16, hidden %d)" % args.timing_hidden,
                         lambda: split_timing(args.timing_hidden) if gpu else skip("no CUDA device"))]
        rows += [guarded("op timing by CUDA events (Recorder)", lambda: event_timing(gpu))]
        rows += [guarded("fp16 loss scale in effect (driver's optimizer wiring)",
                         lambda: fp16_loss_scale() if gpu else skip("no CUDA device: fp16 needs megatron-core's "
                                                                     "CUDA optimizer"))]
    rows += multi_gpu_rows(gpu, args)
    print_table(rows, time.monotonic() - started)
    return 1 if any(status == FAIL for _, status, _ in rows) else 0


# ---- rows --------------------------------------------------------------------------------------

def skip(why: str) -> Tuple[str, str]:
    return SKIP, why


def guarded(name: str, check: Callable[[], Tuple[str, str]]) -> Row:
    """One row; an exception is a failure with its last line, never a crash of the whole check."""
    try:
        status, result = check()
    except Exception as exc:  # noqa: BLE001 - the table reports it
        status, result = FAIL, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    return report((name, status, result))


def report(row: Row) -> Row:
    """A finished row, printed at once (to stderr: the table on stdout stays one table), so a run killed
    at its time limit keeps what it found."""
    print(f"gpu_check: {row[0]}: {row[1]}: {row[2]}", file=sys.stderr, flush=True)
    return row


def print_table(rows: List[Row], seconds: float) -> None:
    width = max(len(r[0]) for r in rows)
    print(f"{'check'.ljust(width)}  status   result")
    print(f"{'-' * width}  -------  {'-' * 40}")
    for name, status, result in rows:
        print(f"{name.ljust(width)}  {status.ljust(7)}  {result}")
    failed = sum(status == FAIL for _, status, _ in rows)
    print(f"{len(rows)} checks: {sum(s == OK for _, s, _ in rows)} ok, {failed} failed, "
          f"{sum(s == SKIP for _, s, _ in rows)} skipped ({seconds:.0f} s)")


def environment(gpu: bool) -> Tuple[str, str]:
    import torch
    from megatron.core.package_info import __version__ as mcore

    from megatron_vshape.integration.args import _te_version
    from megatron_vshape.integration.gpu_defaults import importable

    te = _te_version()
    parts = [f"torch {torch.__version__}", f"megatron-core {mcore}",
             f"Transformer Engine {'.'.join(map(str, te)) if te else 'absent'}",
             f"apex fused wgrad {'present' if importable('fused_weight_gradient_mlp_cuda') else 'absent'}"]
    if gpu:
        parts.insert(0, f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
    else:
        parts.insert(0, "no CUDA device (CPU: plumbing only)")
    parts.append(f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}")
    return OK, ", ".join(parts)


class world_of_one:
    """torch.distributed and megatron-core's groups on this process alone (NCCL on a GPU)."""

    def __init__(self, gpu: bool):
        self.gpu = gpu

    def __enter__(self):
        import torch
        import torch.distributed as dist

        from megatron_vshape.integration.train import _free_port
        from megatron_vshape.runtime.groups import init_megatron

        if self.gpu:
            torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True)
        dist.init_process_group("nccl" if self.gpu else "gloo", store=store, rank=0, world_size=1)
        init_megatron(tp=1, pp=1)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        from megatron_vshape.runtime.groups import destroy_megatron

        destroy_megatron()
        dist.destroy_process_group()
        if self.gpu:  # leave the GPU to the multi-process runs that follow
            import gc

            import torch

            gc.collect()
            torch.cuda.empty_cache()
        return False


def nccl_ordering() -> Tuple[str, str]:
    """The verifier's one-device-queue model (schedule.comm.device_stall) for every schedule at
    pp 2 and 4 (pure Python: the same answer on any machine)."""
    from megatron_vshape.schedule import registry
    from megatron_vshape.schedule.comm import channel_streams

    counts = {}
    for pp in (2, 4):
        for name in registry.names():
            options = {"group": 2 * pp} if name == "1f1b-interleaved" else {}
            counts[(name, pp)] = channel_streams(registry.build(name, pp, 2 * pp, **options))
    if any(n is None for n in counts.values()):
        return FAIL, f"stalls: {[k for k, n in counts.items() if n is None]}"
    return OK, (f"{len(counts)} plans (pp 2 and 4, 2pp microbatches), communicators per channel: "
                f"{sorted(set(counts.values()))}")


# ---- one device: the split against the fused backward ---------------------------------------------

def _gpt(gpu: bool, dtype: str, hidden: int, layers: int, seq: int, vocab: int, grad_acc_fusion: bool = False,
         overlap: bool = True):
    """A GPT of `layers` local layers, as the driver builds it: Float16Module and megatron-core's
    DDP (overlapped grad reduce) on a GPU; plain fp32 modules on CPU.  Returns (model, config)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_vshape.runtime.chunks import build_model_chunks
    from megatron_vshape.runtime.init import init_by_name
    from megatron_vshape.schedule.ops import Placement

    params = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=max(1, hidden // 128) if gpu else 4,
        ffn_hidden_size=4 * hidden, params_dtype=params, pipeline_dtype=params, bf16=dtype == "bf16",
        fp16=dtype == "fp16", hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=not gpu,
        gradient_accumulation_fusion=grad_acc_fusion, bias_dropout_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)
    if gpu:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec()
    else:
        from megatron_vshape.runtime.cpu_spec import cpu_gpt_block_spec as spec
    (model,) = build_model_chunks(config, Placement("single", 1), vocab_size=vocab, max_sequence_length=seq,
                                  transformer_layer_spec=spec)
    init_by_name([model], seed=1234, std=0.02, num_layers=layers)
    config = model.config
    if not gpu:
        from megatron_vshape.runtime.cpu_spec import use_cpu_rotary

        use_cpu_rotary(model)
        return model, config
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    model = model.cuda()
    if dtype != "fp32":
        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, use_distributed_optimizer=False), model)
    return ddp, config


def _batch(gpu: bool, seq: int, vocab: int, mbs: int = 1):
    import torch

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (mbs, seq), generator=g)
    device = "cuda" if gpu else "cpu"
    return {"tokens": tokens.to(device), "labels": tokens.roll(-1, 1).to(device),
            "position_ids": torch.arange(seq).expand(mbs, seq).contiguous().to(device)}


def _loss(model, batch):
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out.float().mean()


def _grads(model):
    out = {}
    for name, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        out[name] = None if g is None else g.detach().float().clone()
    return out


def _zero(model):
    if hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()
    model.zero_grad(set_to_none=True)


def _finish(model):
    if hasattr(model, "finish_grad_sync"):
        model.finish_grad_sync()


def backward_fused_and_split(model, batch, autocast: bool = False):
    """Gradients of one microbatch: megatron-core's backward, then B (input gradients) + W; the forwards
    under CUDA autocast (bf16) if asked, as megatron-core's forward_step runs them with enable_autocast."""
    import contextlib

    import torch

    from megatron_vshape.runtime import wgrad

    cast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    _zero(model)
    with cast():
        loss = _loss(model, batch)
    loss.backward()
    _finish(model)
    fused = _grads(model)
    wgrad.install(model)
    _zero(model)
    with wgrad.split_forward(True), cast():
        loss = _loss(model, batch)
    entries: list = []
    with wgrad.collect(entries):
        loss.backward()  # B
    if not entries:
        raise RuntimeError("B deferred no weight gradient: the split is not active")
    deferred = len(entries)
    wgrad.run(entries)  # W (empties the list)
    _finish(model)
    return fused, _grads(model), deferred


def compare_grads(fused, split) -> float:
    """Largest difference relative to the largest fused gradient; a gradient on one side only fails."""
    scale = max(float(g.abs().max()) for g in fused.values() if g is not None) or 1.0
    worst = 0.0
    for name, g in fused.items():
        s = split[name]
        if (g is None) != (s is None):
            raise AssertionError(f"{name}: gradient on one side only")
        if g is not None:
            worst = max(worst, float((g - s).abs().max()) / scale)
    return worst


def split_rows(gpu: bool) -> List[Row]:
    from megatron_vshape.integration.gpu_defaults import importable

    if not gpu:
        return [guarded("B + W = fused backward (CPU fp32, plumbing)", lambda: _split_case(False, "fp32", False)),
                ("B + W = fused backward, GPT layer in DDP + Float16Module (bf16, fp16)", SKIP, "no CUDA device")]
    rows = []
    apex = importable("fused_weight_gradient_mlp_cuda")
    for dtype in ("bf16", "fp16"):
        for fusion in (False, True):
            name = f"B + W = fused backward ({dtype}, grad-acc fusion {'on' if fusion else 'off'})"
            if fusion and not apex:
                rows.append((name, SKIP, "apex's fused_weight_gradient_mlp_cuda absent"))
                continue
            rows.append(guarded(name, lambda d=dtype, f=fusion: _split_case(True, d, f)))
    # fp32 weights under torch.autocast (config.enable_autocast): B's gradient is bf16, the input W keeps is not
    rows.append(guarded("B + W = fused backward (fp32 weights, bf16 autocast)",
                        lambda: _split_case(True, "fp32", False, autocast=True)))
    return rows


def _split_case(gpu: bool, dtype: str, fusion: bool, autocast: bool = False) -> Tuple[str, str]:
    hidden, seq, vocab = (1024, 512, 1024) if gpu else (64, 16, 128)
    model, _ = _gpt(gpu, dtype, hidden, 2, seq, vocab, grad_acc_fusion=fusion)
    fused, split, deferred = backward_fused_and_split(model, _batch(gpu, seq, vocab), autocast)
    worst = compare_grads(fused, split)
    status = OK if worst <= GRAD_TOLERANCE else FAIL
    return status, (f"{len(fused)} gradients, {deferred} weight GEMMs deferred to W; "
                    f"{'bitwise equal' if worst == 0 else f'max diff {worst:.2e} of the largest'}")


def split_timing(hidden: int, iters: int = 10) -> Tuple[str, str]:
    """Median of the fused backward against B + W, one GPT layer, seq 2048, bf16, CUDA events."""
    import torch

    from megatron_vshape.runtime import wgrad

    seq, vocab = 2048, 1024
    model, _ = _gpt(True, "bf16", hidden, 1, seq, vocab)
    batch = _batch(True, seq, vocab)

    def timed(split: bool) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _zero(model)
        with wgrad.split_forward(split):
            loss = _loss(model, batch)
        entries: list = []
        begin.record()
        if split:
            with wgrad.collect(entries):
                loss.backward()
            wgrad.run(entries)
        else:
            loss.backward()
        end.record()
        _finish(model)
        torch.cuda.synchronize()  # between whole steps: no receive is ever posted here
        return begin.elapsed_time(end)

    for _ in range(3):
        timed(False)
    fused = statistics.median(timed(False) for _ in range(iters))
    wgrad.install(model)
    for _ in range(3):
        timed(True)
    split = statistics.median(timed(True) for _ in range(iters))
    return OK, f"fused {fused:.2f} ms, B + W {split:.2f} ms: ratio {split / fused:.3f} (median of {iters})"


def event_timing(gpu: bool) -> Tuple[str, str]:
    import torch

    from megatron_vshape.runtime.stats import Recorder

    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    a = torch.randn(2048 if gpu else 128, 2048 if gpu else 128, device=device)
    rec = Recorder()
    for i in range(4):
        with rec.op("F", i, 0, device):
            for _ in range(8):
                a = torch.tanh(a @ a)
    pending = len(getattr(rec, "_pending", []))
    rec.resolve()
    durations = [e - s for *_, s, e in rec.ops]
    if len(durations) != 4 or min(durations) <= 0:
        return FAIL, f"durations {durations}"
    how = f"CUDA events, {pending} ops read after the step" if gpu else "CPU: host clock (events need a GPU)"
    return (OK if gpu or pending == 0 else FAIL), f"{how}; op times {', '.join(f'{1e3 * d:.2f}' for d in durations)} ms"


def fp16_loss_scale() -> Tuple[str, str]:
    """The driver's wiring makes backward_step scale fp16 losses by the optimizer's scale, which the
    optimizer divides out again: its grad norm equals the unscaled one (off by the scale if unwired)."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron_vshape.integration.train import use_megatron_optimizer
    from megatron_vshape.runtime.compat import backward_step  # megatron-core's, on every tested release

    seq, vocab, scale_wanted = 256, 1024, 2.0 ** 12
    model, config = _gpt(True, "fp16", 512, 2, seq, vocab)
    batch = _batch(True, seq, vocab)
    _zero(model)
    (_loss(model, batch) * scale_wanted).backward()  # by hand, as a reference (unscaled fp16 grads underflow)
    _finish(model)
    unscaled = sum(float(g.pow(2).sum()) for g in _grads(model).values() if g is not None) ** 0.5 / scale_wanted
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, fp16=True, params_dtype=config.params_dtype,
                                                       initial_loss_scale=scale_wanted, clip_grad=1e9), [model])
    use_megatron_optimizer(config, [model], optimizer, finalize_model_grads)
    scale = float(optimizer.get_loss_scale())
    _zero(model)
    backward_step(None, _loss(model, batch), None, None, config)  # what the executor calls
    _finish(model)
    updated, norm, _ = optimizer.step()
    ratio = norm / unscaled
    good = updated and abs(ratio - 1) < 1e-2 and scale == scale_wanted
    return (OK if good else FAIL), (f"loss scale {scale:g}; optimizer's grad norm / unscaled = {ratio:.4f} "
                                    f"(updated: {updated})")


# ---- several devices ---------------------------------------------------------------------------

def _run(cmd: List[str], timeout: float, env=None) -> Tuple[int, str]:
    full_env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    from megatron_vshape.testing.processes import run

    code, out, err = run(cmd, timeout, cwd=ROOT, env=full_env)  # past the bound, its ranks go down with it
    if code is None:
        return 124, f"no result within {timeout:g} s"
    return code, out + err


def verify_row(schedule: str, pp: int, backend: str, timeout: float) -> Row:
    name = f"verify {schedule} pp={pp} over {backend}"
    rc, out = _run([sys.executable, "-m", "megatron_vshape.cli", "verify", "--schedule", schedule, "--pp", str(pp),
                    "--backend", backend, "--timeout", str(timeout), "--json"], timeout + 30)
    if rc != 0:
        return name, FAIL, f"exit {rc}: {out.strip().splitlines()[-1] if out.strip() else ''}"
    result = json.loads(out.strip().splitlines()[-1])
    return name, (OK if result["ok"] else FAIL), (f"loss diff {result['max_abs_loss_diff']:.1e}, grad diff "
                                                   f"{result['max_rel_grad_diff']:.1e}")


def train_row(schedule: str, pp: int, gpu: bool, timeout: float) -> Row:
    name = f"driver {schedule} pp={pp}, 4 iterations"
    size = (["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
             "--vocab-size", "32000", "--bf16"] if gpu else
            ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--vocab-size", "64"])
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    rc, out = _run([torchrun, "--standalone", f"--nproc-per-node={pp}", "scripts/pretrain_gpt.py",
                    "--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", schedule, *size,
                    "--global-batch-size", str(4 * pp), "--train-iters", "4", "--log-interval", "4", "--mock-data",
                    "--lr-warmup-iters", "0"], timeout, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    summary = next((line for line in out.splitlines() if line.startswith("VSHAPE_SUMMARY ")), None)
    if rc != 0 or summary is None:
        return name, FAIL, f"exit {rc}: {out.strip().splitlines()[-1] if out.strip() else ''}"
    s = json.loads(summary.split(" ", 1)[1])
    mib = lambda xs: "/".join(f"{x / 2**20:.1f}" for x in xs if x is not None) or "-"  # noqa: E731
    return name, OK, (f"{1e3 * s['median_iter_time_s']:.0f} ms/iteration, loss {s['first_loss']:.3f} -> "
                      f"{s['final_loss']:.3f}, peak {'allocated' if gpu else 'RSS growth'} MiB per rank "
                      f"{mib(s['peak_allocated_bytes'])}, reserved "
                      f"{mib(s.get('peak_reserved_bytes') or [])}, activations+buffers at peak MiB "
                      f"{mib(s.get('activations_at_peak_bytes') or [])}+{mib(s.get('pipeline_buffer_bytes_at_peak') or [])}")


def multi_gpu_rows(gpu: bool, args) -> List[Row]:
    import torch

    from megatron_vshape.schedule import registry

    schedules = args.schedules or registry.names()
    n = torch.cuda.device_count() if gpu else 0
    if n < 2:
        why = (f"needs 2 GPUs, found {n}: two ranks cannot share one GPU under NCCL" if gpu else
               "no CUDA device")
        rows: List[Row] = [("verify every schedule at pp=2 over NCCL; driver iterations per schedule", SKIP, why)]
        if not gpu:  # the same commands over gloo, once, to prove their plumbing
            rows.append(report(verify_row("v-half", 2, "gloo", args.timeout)))
            rows.append(report(train_row("v-half", 2, False, args.timeout)))
        return rows
    rows = []
    for pp in (2, 4) if n >= 4 else (2,):
        rows += [report(verify_row(s, pp, "nccl", args.timeout)) for s in schedules]
    if n < 4:
        rows.append(("verify at pp=4 over NCCL", SKIP, f"needs 4 GPUs, found {n}"))
    rows += [report(train_row(s, 2, True, args.timeout)) for s in schedules]
    return rows


if __name__ == "__main__":
    sys.exit(main())
