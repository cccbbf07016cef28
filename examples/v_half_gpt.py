"""Train a tiny megatron-core GPT with the V-Half schedule: the whole API in one file.

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/v_half_gpt.py

runs on CPU over gloo (NCCL when every rank has a GPU); --nproc-per-node is the pipeline size
(2 or 4 here), --schedule any registered schedule.  The four steps a Megatron user adds:

1. parallel_state for the schedule's placement: on the V, rank r holds stages r and 2p-1-r, so
   megatron-core needs virtual pipeline size 2 and an embedding group of rank 0 alone (the
   embedding and the loss both live there): `embedding_ranks_for(placement)`.
2. `build_model_chunks`: this rank's GPTModel chunks, layers numbered as in the whole model.
3. `get_forward_backward_func(name)`: megatron-core's forward-backward signature, one data
   iterator per chunk, losses returned on the last pipeline rank.
4. an ordinary optimizer step over every chunk's parameters.
"""
import argparse
import os
from functools import partial

from megatron_vshape.argtypes import quiet_megatron_notices

quiet_megatron_notices()  # megatron-core's "Apex is not installed" notices; must precede its import

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_vshape.runtime.chunks import build_model_chunks, embedding_ranks_for  # noqa: E402
from megatron_vshape.runtime.executor import get_forward_backward_func  # noqa: E402
from megatron_vshape.schedule import registry  # noqa: E402

VOCAB, SEQ, MICRO_BATCH, HIDDEN, HEADS = 64, 16, 2, 32, 4


def loss_func(loss_mask, output_tensor):
    """Megatron's contract: (summed loss, token count, {name: [sum, count]} for logging)."""
    loss = torch.sum(output_tensor.float().view(-1) * loss_mask.view(-1))
    tokens = loss_mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


def forward_step(data_iterator, model):
    """Megatron's forward_step_func: one chunk, the next microbatch.  Chunks that do not hold the
    embedding ignore the tokens (their input arrives from the previous stage)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def microbatches(count, seed=0):
    """A fixed synthetic dataset: `count` microbatches of next-token prediction."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        text = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
        yield {"tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": torch.ones(MICRO_BATCH, SEQ),
               "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", default="v-half")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # torchrun's environment
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    pp = dist.get_world_size()

    # 1. parallel state for the schedule's placement
    placement = registry.build(args.schedule, pp, args.microbatches).placement
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=placement.chunks if placement.chunks > 1 else None,
        get_embedding_ranks=embedding_ranks_for(placement),
    )
    torch.manual_seed(1234 + dist.get_rank())

    # 2. this rank's chunks of a GPT with two layers per stage
    config = TransformerConfig(
        num_layers=2 * placement.num_stages, hidden_size=HIDDEN, num_attention_heads=HEADS,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
    )
    chunks = build_model_chunks(config, placement, vocab_size=VOCAB, max_sequence_length=SEQ)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    chunks = [chunk.to(device) for chunk in chunks]
    params = list(dict.fromkeys(p for chunk in chunks for p in chunk.parameters()))
    optimizer = torch.optim.Adam(params, lr=1e-2)

    # 3. the schedule's forward-backward function, Megatron's signature
    forward_backward = get_forward_backward_func(args.schedule)
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        data = [iter([{k: v.to(device) for k, v in b.items()} for b in microbatches(args.microbatches)])
                for _ in chunks]  # one iterator per chunk, same microbatches in the same order
        losses = forward_backward(forward_step_func=forward_step, data_iterator=data, model=chunks,
                                  num_microbatches=args.microbatches, seq_length=SEQ,
                                  micro_batch_size=MICRO_BATCH, forward_only=False)
        # 4. the optimizer step (no data parallelism here, so no gradient all-reduce)
        optimizer.step()
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):  # where Megatron expects the losses
            total = torch.stack([d["lm loss"] for d in losses]).sum(0)
            print(f"{args.schedule} pp={pp} step {step} loss {float(total[0] / total[1]):.4f}", flush=True)

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
