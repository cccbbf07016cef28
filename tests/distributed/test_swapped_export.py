"""A hand-edited export whose first stage runs microbatch 1's forward before microbatch 0's: it is
still a valid order (the verifier accepts it, `check` notes it), and the runtime gives each
microbatch its own data whatever the order, so the tiny GPT's per-microbatch losses and gradients
equal the non-pipelined model's on the same data.  (Before the runtime bound data to microbatch
indices, microbatches 0 and 1 embedded each other's tokens against their own labels.)"""
import json

import pytest

from megatron_vshape.integration.launch import launch
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.export import load_json, to_dict
from megatron_vshape.schedule.verify import forwards_out_of_order
from megatron_vshape.testing.tiny_gpt import TinyGPT, compare

M = 4


def _swap_first_stage_forwards(data):
    ops = data["ranks"][0]
    first, second = [i for i, op in enumerate(ops) if op["op"] == "F" and op["stage"] == 0][:2]
    ops[first], ops[second] = ops[second], ops[first]
    return data


def _reference(rank, world_size, tiny):
    from megatron_vshape.testing.tiny_gpt import reference_run

    return reference_run(tiny, M, steps=1, lr=0.0)


def _pipelined(rank, world_size, tiny, path):
    from megatron.core import parallel_state as ps

    from megatron_vshape.runtime.executor import get_forward_backward_func
    from megatron_vshape.testing.tiny_gpt import (build_chunks, data_iterators, forward_step, init_parallel,
                                                  microbatch_loss, named_grads, portable)

    schedule = load_json(path)
    init_parallel(1, world_size, schedule.placement, seed=tiny.seed)
    chunks = build_chunks(tiny, schedule.placement)
    out = get_forward_backward_func(schedule, p2p_timeout=60)(
        forward_step_func=forward_step, data_iterator=data_iterators(tiny, 0, M, len(chunks)), model=chunks,
        num_microbatches=M, seq_length=tiny.seq_length, micro_batch_size=tiny.micro_batch_size)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    return portable({"pp_rank": pp_rank, "tp_rank": 0, "grads": [named_grads(chunks)],
                     "losses": [[microbatch_loss(d) for d in out]] if pp_rank == world_size - 1 else None})


@pytest.mark.timeout(200)
def test_a_swapped_export_trains_each_microbatch_on_its_own_data(tmp_path):
    tiny = TinyGPT(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                   micro_batch_size=2, tied_embeddings=False, seed=1234)
    path = tmp_path / "v-half-swapped.json"
    path.write_text(json.dumps(_swap_first_stage_forwards(to_dict(registry.build("v-half", 2, M)))))
    assert forwards_out_of_order(load_json(str(path))) == ["rank 0: F0@0 runs after F1@0"]
    (reference,) = launch(_reference, 1, (tiny,), timeout=90)
    results = launch(_pipelined, 2, (tiny, str(path)), timeout=90)
    diffs = compare(reference, results)
    print(diffs)
    assert diffs["max_abs_loss_diff"] == 0.0 and diffs["max_rel_grad_diff"] <= 1e-6, diffs
