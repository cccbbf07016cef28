"""Model chunks per placement: global layer numbers, checkpoint keys, tied embeddings, and a
hand-driven pipelined step (no schedule executor) whose losses and gradients equal the
non-pipelined reference.  One launch per world size runs its cases and the references (spawning
dominates the cost on small machines)."""
import pytest

from megatron_vshape.integration.launch import launch
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import Placement
from megatron_vshape.testing.tiny_gpt import TinyGPT, compare, reference_run

MICROBATCHES = 2


def _reference(tiny):
    """The model without pipelining, on a pp=1 layout already initialised: losses, gradients, names."""
    from megatron_vshape.runtime.chunks import global_named_parameters
    from megatron_vshape.testing.tiny_gpt import build_chunks

    out = reference_run(tiny, MICROBATCHES, initialise=False)
    (model,) = build_chunks(tiny, Placement("single", 1))
    out["names"] = sorted(n for n, _ in global_named_parameters(model))
    out["ckpt"] = sorted(_checkpoint_keys(model))
    out["layers"] = [layer.layer_number for layer in model.decoder.layers]
    return out


def _checkpoint_keys(chunk):
    """(key, global offset along the layer axis) of every sharded tensor: what a checkpoint stores."""
    keys = []
    for value in chunk.sharded_state_dict().values():
        if hasattr(value, "key"):
            keys.append((value.key, tuple(value.global_offset[:1]) if "layers" in value.key else ()))
    return keys


def _manual_step(chunks, placement, tiny):
    """Run MICROBATCHES forwards then backwards, stage by stage in model order, sending
    activations and gradients with plain send/recv; a hop to the same rank stays local."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_vshape.testing.tiny_gpt import batch, loss_func, microbatch_loss

    pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    me = parallel_state.get_pipeline_model_parallel_rank()
    stages = placement.num_stages
    shape = (tiny.seq_length, tiny.micro_batch_size, tiny.hidden_size)
    losses = []
    for mb in range(MICROBATCHES):
        b = batch(tiny, 0, mb)
        inputs, outputs, carry = {}, {}, None
        for s in range(stages):
            owner = placement.rank_of(s)
            prev = placement.rank_of(s - 1) if s else None
            if owner == me:
                chunk = chunks[placement.chunk_of(s)]
                if s:
                    if prev != me:
                        carry = torch.empty(shape)
                        dist.recv(carry, src=pp_ranks[prev])
                    carry = carry.detach().requires_grad_()
                    inputs[s] = carry
                chunk.set_input_tensor(carry if s else None)
                out = chunk(b["tokens"], b["position_ids"], None, labels=b["labels"])
                if s == stages - 1:
                    loss, tokens, report = loss_func(b["loss_mask"], out)
                    out = loss / tokens / MICROBATCHES
                    losses.append(microbatch_loss(report))
                outputs[s] = out
                carry = out
            elif prev == me:
                dist.send(carry.detach().contiguous(), dst=pp_ranks[owner])
        grad = None
        for s in reversed(range(stages)):
            owner = placement.rank_of(s)
            nxt = placement.rank_of(s + 1) if s < stages - 1 else None
            if owner == me:
                if s < stages - 1 and nxt != me:
                    grad = torch.empty(shape)
                    dist.recv(grad, src=pp_ranks[nxt])
                torch.autograd.backward(outputs[s], grad_tensors=grad if s < stages - 1 else None)
                grad = inputs[s].grad if s else None
            elif nxt == me:
                dist.send(grad.contiguous(), dst=pp_ranks[owner])
    return losses


def _pipelined(rank, world_size, tiny, kind, pp, chunks, tp):
    from megatron.core import parallel_state

    from megatron_vshape.runtime.chunks import global_named_parameters
    from megatron_vshape.testing.tiny_gpt import build_chunks, init_parallel, named_grads, portable

    placement = Placement(kind, pp, chunks)
    init_parallel(tp, pp, placement)
    model = build_chunks(tiny, placement, tp=tp)
    info = {
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "chunks": [
            {"pre": c.pre_process, "post": c.post_process,
             "layers": [layer.layer_number for layer in c.decoder.layers],
             "names": [n for n, _ in global_named_parameters(c)], "ckpt": _checkpoint_keys(c)}
            for c in model
        ],
        "embd_group_size": parallel_state.get_embedding_group().size()
        if parallel_state.is_rank_in_embedding_group() else 0,
    }
    if kind == "v" and tiny.tied_embeddings and info["pp_rank"] == 0:
        emb = model[0].embedding.word_embeddings.weight
        info["tied_same_param"] = model[1].shared_embedding_or_output_weight() is emb
        info["head_owns_weight"] = any(p is emb for p in model[1].parameters())
    losses = _manual_step(model, placement, tiny)
    if kind == "v":
        # Megatron's finalize_model_grads embedding syncs must neither hang nor double count on the
        # V: the gradients below are compared with the reference after them.
        from megatron.core.distributed.finalize_model_grads import (
            _allreduce_position_embedding_grads, _allreduce_word_embedding_grads)

        _allreduce_word_embedding_grads(model, model[0].config)
        _allreduce_position_embedding_grads(model, model[0].config, parallel_state.get_position_embedding_group(check_initialized=False),
                                            parallel_state.get_pipeline_model_parallel_group())
    info["losses"] = [losses] if losses else None
    info["grads"] = [named_grads(model)]
    if kind == "v" and tiny.tied_embeddings:
        info["default_embedding_group_error"] = _default_embedding_group_error(tiny, placement, tp)
    return portable(info)


def _default_embedding_group_error(tiny, placement, tp):
    """Tied V chunks under megatron's default embedding group (first and last rank) must be refused."""
    from megatron.core import parallel_state

    from megatron_vshape.runtime.groups import init_megatron
    from megatron_vshape.testing.tiny_gpt import build_chunks

    parallel_state.destroy_model_parallel()
    init_megatron(tp=tp, pp=placement.pp, virtual_pipeline_model_parallel_size=2)
    try:
        build_chunks(tiny, placement, tp=tp)
    except ConfigError as e:
        return str(e)
    return None


def _tiny(tied, positions):
    return TinyGPT(num_layers=8, tied_embeddings=tied, position_embedding_type=positions)


def _job(rank, world_size, cases, refs_too):
    """Every case of this world size pipelined; then, with `refs_too`, the references of all cases,
    split over the data-parallel replicas of a pp=1 layout (spawning dominates the cost)."""
    from megatron_vshape.testing.tiny_gpt import init_parallel

    results = {case: _pipelined(rank, world_size, _tiny(*case[4:]), *case[:4]) for case in cases
               if case[1] * case[3] == world_size}
    refs = {}
    if refs_too:
        init_parallel(1, 1, Placement("single", 1))
        tinies = list(dict.fromkeys(_tiny(*case[4:]) for case in cases))
        refs = {tiny: _reference(tiny) for tiny in tinies[rank::world_size]}
    return {"results": results, "refs": refs}


# (placement kind, pp, chunks, tp, tied, position embedding)
CASES = [("v", 2, 2, 1, True, "learned_absolute"), ("v", 4, 2, 1, False, "rope"),
         ("loop", 2, 2, 1, False, "learned_absolute"), ("v", 2, 2, 2, True, "learned_absolute")]


@pytest.fixture(scope="module")
def runs():
    """{case: (the reference, each rank's result)}: one launch per world size (2 and 4 ranks)."""
    refs, results = {}, {}
    sizes = sorted({pp * tp for _, pp, _, tp, _, _ in CASES})
    for world_size in sizes:
        jobs = launch(_job, world_size, (CASES, world_size == sizes[-1]), timeout=300)
        for job in jobs:
            refs.update(job["refs"])
        results.update({case: [job["results"][case] for job in jobs] for case in jobs[0]["results"]})
    return {case: (refs[_tiny(*case[4:])], results[case]) for case in CASES}


def _expected_layers(placement, rank, per_stage):
    return [[s * per_stage + i + 1 for i in range(per_stage)] for s in placement.stages_of(rank)]


@pytest.mark.timeout(600)  # the launches, if this case runs first
@pytest.mark.parametrize("case", CASES, ids=["v-pp2-tied", "v-pp4-rope", "loop-pp2", "v-pp2-tp2-tied"])
def test_chunks_match_unpipelined_model(runs, case):
    kind, pp, chunks, tp, tied, positions = case
    tiny = _tiny(tied, positions)
    ref, results = runs[case]
    placement = Placement(kind, pp, chunks)
    per_stage = tiny.num_layers // placement.num_stages
    names, ckpt = set(), set()
    for res in results:
        r = res["pp_rank"]
        assert [c["layers"] for c in res["chunks"]] == _expected_layers(placement, r, per_stage)
        for c, stage in zip(res["chunks"], placement.stages_of(r)):
            assert (c["pre"], c["post"]) == (stage == 0, stage == placement.num_stages - 1)
            names.update(c["names"])
            ckpt.update((k, tuple(o)) for k, o in c["ckpt"])
        if kind == "v":
            # Embedding and head both on rank 0: no cross-rank embedding group.
            assert res["embd_group_size"] in (0, 1)
            if tied and r == 0:
                assert res["tied_same_param"] and not res["head_owns_weight"]
            if tied:
                assert "embedding group of the first pipeline rank only" in res["default_embedding_group_error"]
    assert names == set(ref["names"])
    assert ckpt == {(k, tuple(o)) for k, o in ref["ckpt"]}
    diff = compare(ref, results)
    print(kind, pp, tp, tied, diff)
    assert diff["max_abs_loss_diff"] <= 1e-6
    assert diff["max_rel_grad_diff"] <= 1e-6


def _config(**kw):
    from megatron_vshape.testing.tiny_gpt import TinyGPT

    base = dict(num_layers=30, pp=4)
    base.update(kw)
    tiny = TinyGPT(num_layers=base.pop("num_layers"))
    return tiny.transformer_config(pp=base.pop("pp"), **base)


def test_config_errors():
    from megatron_vshape.runtime.chunks import check_model_config

    v4 = Placement("v", 4, 2)
    check_model_config(_config(), v4)  # 30 layers: any count, uneven stages (runtime/chunks.stage_layers_of)
    check_model_config(_config(num_layers=32), v4)
    with pytest.raises(ConfigError, match="multi-token prediction"):
        check_model_config(_config(num_layers=32, mtp_num_layers=1), v4)
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size=4 but the schedule has pp=2"):
        check_model_config(_config(num_layers=32), Placement("v", 2, 2))
    with pytest.raises(ConfigError, match="virtual_pipeline_model_parallel_size=4"):
        check_model_config(_config(num_layers=32, virtual_pipeline_model_parallel_size=4), v4)
