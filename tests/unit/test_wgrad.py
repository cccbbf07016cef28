"""The B/W split of megatron-core's Column/RowParallelLinear, in one process (world of one rank)."""
from __future__ import annotations

import pytest
import torch

from megatron_vshape.runtime import wgrad
from megatron_vshape.schedule.ops import Op


def _layers():
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    cfg = ModelParallelConfig(use_cpu_initialization=True)
    torch.manual_seed(0)
    init = torch.nn.init.normal_
    fc1 = ColumnParallelLinear(6, 10, config=cfg, init_method=init, bias=True, gather_output=False)
    fc2 = RowParallelLinear(10, 6, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                            skip_bias_add=False)
    model = torch.nn.ModuleList([fc1, fc2])
    assert wgrad.install(model) == 2
    return model


def _forward(model, x):
    h, _ = model[0](x)
    y, _ = model[1](torch.nn.functional.gelu(h))
    return (y * y).sum()


def _grads(model):
    return {n: (p.main_grad if hasattr(p, "main_grad") else p.grad) for n, p in model.named_parameters()}


def test_b_leaves_weights_to_w_and_w_matches_one_backward(megatron_world):
    x = torch.randn(4, 2, 6)
    ref = _layers()
    ref_x = x.clone().requires_grad_()
    _forward(ref, ref_x).backward()  # megatron-core's own backward (not under split_forward)
    model = _layers()
    sx = x.clone().requires_grad_()
    with wgrad.split_forward():
        loss = _forward(model, sx)
    entries = []
    with wgrad.collect(entries):
        loss.backward()
    assert len(entries) == 2
    assert torch.equal(sx.grad, ref_x.grad)  # B: the input gradient
    assert model[0].weight.grad is None and model[1].weight.grad is None  # weights wait for W
    assert torch.equal(model[0].bias.grad, ref[0].bias.grad)  # not split: done in B
    wgrad.run(entries)
    for name, g in _grads(ref).items():
        assert torch.equal(_grads(model)[name], g), name


def test_main_grad_path_fires_each_hook_once_at_w(megatron_world):
    model = _layers()
    fired = []
    keep = []
    for name, p in model.named_parameters():
        p.main_grad = torch.zeros_like(p)
        p.grad_added_to_main_grad = False
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(lambda *_, name=name, p=p: fired.append((name, p.grad is not None, p.grad_added_to_main_grad)))
        keep.append(acc)
    for mod in model:
        mod.gradient_accumulation_fusion = True
    x = torch.randn(4, 2, 6, requires_grad=True)
    with wgrad.split_forward():
        loss = _forward(model, x)
    entries = []
    with wgrad.collect(entries):
        loss.backward()
    assert sorted(n for n, *_ in fired) == ["0.bias", "1.bias"]  # B: biases only
    assert all(has_grad for _, has_grad, _ in fired)
    fired.clear()
    wgrad.run(entries)
    assert sorted(n for n, *_ in fired) == ["0.weight", "1.weight"]
    assert all(added for *_, added in fired)  # the hook must not add the dummy gradient again
    ref = _layers()
    _forward(ref, x.detach().clone().requires_grad_()).backward()
    for i in range(2):
        torch.testing.assert_close(model[i].weight.main_grad, ref[i].weight.grad, rtol=1e-6, atol=1e-7)


def test_backward_outside_b_computes_weight_gradients_at_once(megatron_world):
    model = _layers()
    with wgrad.split_forward():
        loss = _forward(model, torch.randn(4, 2, 6))
    loss.backward()
    assert model[0].weight.grad is not None and model[1].weight.grad is not None


def test_fifo_w_order():
    ops = [Op.parse(t) for t in "F0@0 F1@0 B0@0 B1@0 W0@0 W1@0".split()]
    assert wgrad.check_fifo_w_order(ops) is None
    swapped = [Op.parse(t) for t in "F0@0 F1@0 B0@0 B1@0 W1@0 W0@0".split()]
    assert "stage 0" in wgrad.check_fifo_w_order(swapped)


def test_unknown_linear_option_is_refused_under_split_and_passed_through_without(megatron_world):
    from megatron_vshape.schedule.errors import ConfigError

    model = _layers()
    x = torch.randn(4, 2, 6)
    fc1 = model[0]
    call = dict(input=x, weight=fc1.weight, bias=fc1.bias, gradient_accumulation_fusion=False,
                allreduce_dgrad=False, sequence_parallel=False, tp_group=None)
    with wgrad.split_forward(), pytest.raises(ConfigError, match="newer_option"):
        fc1._forward_impl(**call, newer_option=True)
    with wgrad.split_forward():  # an option left at None changes nothing: accepted
        split = fc1._forward_impl(**call, newer_option=None)
    assert torch.equal(split, type(fc1)._forward_impl(fc1, **call))  # same forward as megatron-core's own


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "main_grad"])
def test_w_op_holds_one_weight_gradient_at_a_time(megatron_world, fused):
    """#34: a W used to build every gradient of the stage (or a fresh dummy per weight on the fused path)
    before one autograd call.  Now one weight's at a time, the dummy reused: 4 weights of 64 KiB each."""
    from megatron_vshape.testing.memory import w_op_peak

    peak, weight = w_op_peak(4, 128, fused)
    print(f"W op peak, 4 linears of {weight} bytes, {'main_grad' if fused else 'plain'} path: {peak} bytes")
    # Plain: one GEMM result (+ a small transposed copy of grad_output); main_grad: CPU's addmm_ makes
    # the product before adding it (apex's kernel on GPUs accumulates in place), the dummy exists since
    # the first W.  The W before #34 held four weights' worth and more (plain 262144 bytes, main_grad 327680).
    assert peak <= weight + weight // 8


def test_w_after_an_autocast_forward_runs_the_gemm_in_the_gradient_dtype():
    """Under config.enable_autocast the forward saves its input uncast (fp32) while B's gradient is bf16; megatron-core's
    backward, under the forward's autocast, multiplies them in bf16.  W runs outside any autocast: before, it failed
    with 'expected m1 and m2 to have the same dtype'; now it casts as autocast would and the fp32 weight gets the
    gradient autograd would accumulate."""
    weight = torch.nn.Parameter(torch.randn(3, 5))
    grad_output = torch.randn(4, 2, 3, dtype=torch.bfloat16)
    x = torch.randn(4, 2, 5)
    wgrad.run([wgrad.WgradEntry(weight, grad_output, x, False, None, False)])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what the GEMM is under autocast
        want = grad_output.reshape(-1, 3).t().matmul(x.reshape(-1, 5))
    assert weight.grad.dtype == torch.float32 and torch.equal(weight.grad, want.float())
