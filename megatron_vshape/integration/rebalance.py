"""--pipeline-balance auto with --pipeline-replan-after N: the layout re-balanced once, from the op
times measured in iteration N, at a checkpoint boundary.

Why a checkpoint boundary: moving layers between ranks moves their weights and their optimizer
state (Adam's moments and step) with them.  A checkpoint already does exactly that, keyed by the
unpipelined model's layer numbers (integration/checkpoint.py; a checkpoint saved under one layout
resumes under another: tests/distributed/test_checkpoint.py::test_resume_under_another_layout).
So the driver saves iteration N to --save, rebuilds its chunks for the new layout and loads what
it saved; no other code moves tensors between ranks, and the run goes on exactly as a fresh
start with `--load DIR --ckpt-step N --pipeline-layout NEW` would.  The checkpoint stays, so a
restart can resume from it with the layout printed; it records that layout (a checkpoint that
--save-interval makes due at N is this one, saved once the layout is decided), which a run
resumed at or past N names (`resumed_past`): such a run has measured nothing before N here.

What is measured: the per-stage op times of iteration N (runtime.replan.measured, one collective,
the same table on every rank), split into per-part costs (schedule.balance.measured_parts: a
layer from the middle stages, the embedding and the output layer with the loss as what their end
stages measured beyond their layers), and searched exactly as `auto` searches the estimate
(schedule.balance.balance), with the current layout as the incumbent: it changes only when
another simulates MIN_GAIN faster.  Every rank decides alike from the same table.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

from ..schedule.errors import ConfigError
from .args import planning_budget
from .layout import model_shape


def check(args) -> None:
    """The flags re-balancing needs, before any process group (driver only: under Megatron-LM's loop
    --pipeline-replan-after is refused outright, megatron_lm.py)."""
    after = getattr(args, "pipeline_replan_after", None)
    if after is None or getattr(args, "pipeline_balance", None) != "auto":
        return
    if not getattr(args, "save", None):
        raise ConfigError(f"--pipeline-replan-after={after} with --pipeline-balance auto re-balances the layout at a "
                          f"checkpoint (iteration {after} is saved, the chunks are rebuilt and it is loaded back, "
                          "which moves each layer's weights and optimizer state to its new rank); give --save DIR "
                          "on storage every rank reads")


def rebalance(args, plan, stats, device, iteration: int) -> Tuple[object, dict, str]:
    """(plan, record, report): the plan for the layout the measured costs of the last iteration give
    (the same plan, with its order re-planned for them, when the layout stays).  Collective."""
    from ..runtime.replan import measured
    from ..schedule.balance import balance, measured_parts
    from ..schedule.layout import describe

    table = measured(stats, plan.schedule.num_stages, device=device)
    parts = measured_parts(table, plan.stage_layers, model_shape(args).parts())
    budget = planning_budget(args)
    record = {"iteration": iteration, "schedule": plan.name, "previous_layout": list(plan.stage_layers),
              "parts": {k: dataclasses.asdict(getattr(parts, k)) for k in ("layer", "embedding", "head")}}
    ms = lambda p: "/".join(f"{1e3 * getattr(p, k):.3g}" for k in ("F", "B", "W"))  # noqa: E731
    head = (f"  re-balancing at iteration {iteration} from the op times measured in it (F/B/W ms per microbatch: "
            f"a layer {ms(parts.layer)}, embedding {ms(parts.embedding)}, output layer and loss {ms(parts.head)}):")
    try:
        result = balance(parts, plan.name, plan.pp, plan.num_microbatches, plan.costs, budget,
                         incumbent=plan.stage_layers, **plan.options)
    except ConfigError as e:  # nothing fits the budget under the measured sizes: keep what runs
        record.update(layout=list(plan.stage_layers), changed=False)
        return plan, record, f"{head}\n  kept {describe(plan.stage_layers, plan.schedule.placement)}: {e}"
    changed = tuple(result.layout) != tuple(plan.stage_layers)
    record.update(layout=list(result.layout), changed=changed)
    report = head + "\n  " + result.summary(("current", "re-balanced")).replace("\n", "\n  ")
    new = dataclasses.replace(plan, schedule=result.schedule, stage_layers=tuple(result.layout),
                              balance=f"re-balanced at iteration {iteration} from measured costs")
    return new, record, report


def restart_hint(args, plan, iteration: int) -> str:
    """How a later start resumes with the re-balanced layout."""
    from ..schedule.layout import describe

    return (f"  layout now {describe(plan.stage_layers, plan.schedule.placement)}: chunks rebuilt from the checkpoint "
            f"of iteration {iteration} in {args.save} (a restart resumes it with --load {args.save} --ckpt-step "
            f"{iteration} --pipeline-layout {','.join(map(str, plan.stage_layers))})")


def resumed_past(args, plan, start_iter: int, saved_layers: Optional[Sequence[int]]) -> Optional[str]:
    """The start-up line of a run resumed at or beyond --pipeline-replan-after N, or None: no iteration
    before N runs in this process, so there is nothing measured to re-plan from and the re-plan is not
    redone.  The run still resumes (a checkpoint loads under any layout); with --pipeline-balance auto
    it names the layout in use, and when the checkpoint's run went on under another one (recorded as
    `saved_layers`, the re-balanced layout), the flags that keep it."""
    from ..schedule.layout import describe

    after = getattr(args, "pipeline_replan_after", None)
    if plan is None or after is None or start_iter < after:
        return None
    head = f"  --pipeline-replan-after={after}: resumed at iteration {start_iter}, so the re-"
    if not plan.balance:
        return head + f"plan at iteration {after} is past and not redone: the order planned at start-up is in use"
    line = (head + f"balance at iteration {after} is past and not redone: layout in use "
            f"{describe(plan.stage_layers, plan.schedule.placement)}")
    if saved_layers is None or tuple(saved_layers) == tuple(plan.stage_layers):
        return line + (" (the checkpoint's)" if saved_layers is not None else "")
    saved = ",".join(map(str, saved_layers))
    return (line + f", the estimate's; the checkpoint's run went on with {saved}: to keep it, resume with "
            f"--pipeline-layout {saved} instead of --pipeline-balance auto")
