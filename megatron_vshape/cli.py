"""`megatron-vshape`: plan, compare, export and check pipeline schedules (no torch needed).

Each subcommand is one function taking the parsed arguments and returning an exit code;
main() only parses and dispatches.  Every error is one line on stderr naming the option, the
value and the fix: exit 2 for configuration mistakes (bad values are rejected while parsing,
by the shared types and parser of `argtypes`, which subcommands added later inherit), 1 for
run-time failures (a file that cannot be written, a run that fails).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .argtypes import EXIT_CONFIG_ERROR, EXIT_RUN_ERROR, Parser, check_output_paths, fail, output_path, \
    positive_int, quiet_megatron_notices
from .integration import verify_cmd
from .schedule import registry
from .schedule.errors import ConfigError
from .schedule.export import FORMATS
from .schedule.export import to_dict as export_dict
from .schedule.export import write as export_write
from .schedule.ops import Costs, Schedule, check_sizes
from .schedule.predictions import Prediction, predict
from .planner.search import lower_bound
from .schedule.simulate import SimResult, simulate

EXIT_IO_ERROR = EXIT_RUN_ERROR
PICTURE_EXTENSIONS = (".svg", ".png", ".pdf")


def _costs(text: Optional[str]) -> Costs:
    return Costs() if text is None else Costs.parse(text)


def _options(args: argparse.Namespace) -> Dict[str, object]:
    """Schedule options the user gave (only those; defaults stay the generator's)."""
    options = {k: v for k, v in (("chunks", args.chunks), ("group", args.group)) if v is not None}
    if getattr(args, "memory_budget", None) is not None and not (args.schedule != "v-auto" and getattr(args, "optimal", False)):
        if args.schedule != "v-auto":  # (plan --optimal reads it from args: the solver's cap)
            raise ConfigError(f"--memory-budget {args.memory_budget:g} applies to --schedule v-auto; use it there, "
                              "or `compare --memory-budget` to find the fastest schedule that fits")
        options["memory_budget"] = args.memory_budget
    if getattr(args, "stage_costs", None):
        from .schedule.stage_costs import load

        options["stage_costs"] = load(args.stage_costs)
    elif getattr(args, "model", None):  # the even split's stage costs, estimated from the model's shape
        options["stage_costs"] = _model_stage_costs(args, registry.build(args.schedule, args.pp, args.microbatches,
                                                                         **{k: v for k, v in options.items()}))
    return options


def _model_shape(args):
    from .integration.layout import shape_from_config

    if getattr(args, "stage_costs", None):
        raise ConfigError(f"--model {args.model} and --stage-costs {args.stage_costs}: pass one (the model's shape "
                          "gives the stage costs)")
    return shape_from_config(args.model, args.vocab_size, args.machine)


def _layers_flag(args) -> str:
    """How an error names the layer count read from --model."""
    return f"--model {args.model}: num-layers"


def _priced(shape) -> str:
    return f"priced for {shape.machine.about} (--machine {shape.machine.name})"


def _model_stage_costs(args, schedule: Schedule):
    from .schedule.layout import even_split

    shape = _model_shape(args)
    layout = even_split(shape.num_layers, schedule.placement, schedule.name, _layers_flag(args))
    return shape.stage_costs(layout, args.pp)


def _check_machine(args) -> None:
    """--machine and --vocab-size qualify --model's estimate: alone they would change nothing."""
    if getattr(args, "machine", None) and not getattr(args, "model", None):
        raise ConfigError(f"--machine {args.machine} prices the stage costs estimated from --model; give --model "
                          "FILE.yaml, or drop --machine")
    if "model" in vars(args) and getattr(args, "vocab_size", None) and not args.model:  # (verify's is its own)
        raise ConfigError(f"--vocab-size {args.vocab_size} replaces the vocabulary of --model's shape; give --model "
                          "FILE.yaml, or drop --vocab-size")


def summary(schedule: Schedule, sim: SimResult) -> dict:
    """The export's figures without the op lists, plus the papers' prediction."""
    out = {k: v for k, v in export_dict(schedule, sim).items() if k != "ranks"}
    out["prediction"] = prediction_of(schedule).to_dict()
    return out


def prediction_of(schedule: Schedule) -> Prediction:
    """The papers' figures for a built schedule; predict takes the user's per-rank costs,
    which are the schedule's per-stage costs times its chunks."""
    c, k = schedule.costs, schedule.placement.chunks
    user_costs = Costs(c.F * k, c.B * k, c.W * k, c.C)
    return predict(schedule.name, schedule.pp, schedule.microbatches, user_costs, chunks=k,
                   group=int(schedule.meta.get("group", 0)))


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


AUTO = "auto"  # plan/export --schedule auto: what --pipeline-schedule auto runs


def _built(args: argparse.Namespace) -> Tuple[Schedule, Optional[str]]:
    """--schedule NAME built with the options given; `auto` is the schedule --pipeline-schedule auto
    runs at --memory-budget (choose.fastest_within: v-auto weighed at every budget step up to it,
    so a larger budget is never slower), with the reason it was chosen."""
    if args.schedule != AUTO:
        return registry.build(args.schedule, args.pp, args.microbatches, _costs(args.costs), **_options(args)), None
    if args.memory_budget is None:
        raise ConfigError("--schedule auto picks the fastest schedule within --memory-budget X: give X (activation "
                          "memory as a fraction of 1F1B's, e.g. 0.6)")
    given = [flag for flag, v in (("--chunks", args.chunks), ("--group", args.group), ("--model", getattr(args, "model", None)),
                                  ("--optimal", getattr(args, "optimal", False))) if v]
    if given:
        raise ConfigError(f"--schedule auto picks the schedule and its options itself; unset {', '.join(given)} "
                          "or name a schedule")
    from .planner.choose import fastest_within
    from .schedule.stage_costs import load

    stage_costs = load(args.stage_costs) if args.stage_costs else None
    return fastest_within(args.pp, args.microbatches, _costs(args.costs), args.memory_budget, stage_costs)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.schedule == AUTO:
        schedule, chosen = _built(args)  # (auto takes no --optimal or --model: one line if given)
    else:
        if args.optimal:
            from .planner.optimal import require_ortools

            require_ortools()  # before anything is built: one line naming the fix, exit 2
        if args.model and not args.optimal:
            return plan_balanced(args)
        schedule, chosen = _built(args)
    if args.optimal:
        return plan_optimal(args, schedule)
    sim = simulate(schedule)
    written: List[str] = []
    if args.export:
        export_write(schedule, args.export, "json", sim)
        written.append(args.export)
    if args.picture:
        from .schedule.render import write_picture

        written += write_picture(schedule, args.picture, sim)
    bound = lower_bound(schedule)  # the V problem's, memory aside (--optimal's proven bound is another)
    if args.json:
        out = summary(schedule, sim)
        if bound is not None:
            out["lower_bound"] = bound
        if chosen:
            out["chosen"] = chosen
        out["written"] = written
        print(json.dumps(out, indent=2))
        return 0
    c = schedule.costs
    pred = prediction_of(schedule)
    print(f"schedule          {schedule.name}  (placement {schedule.placement.kind}, {schedule.placement.chunks} chunk(s) per rank)")
    if chosen:
        print(f"chosen by auto    {chosen}")
    print(f"pp, microbatches  {schedule.pp}, {schedule.microbatches}")
    print(f"per-stage costs   F={c.F:g} B={c.B:g} W={c.W:g} C={c.C:g}")
    if schedule.stage_costs is not None:
        print("stage costs       " + " ".join(f"{k}:{sc.F:g}/{sc.B:g}/{sc.W:g}x{sc.size:g}" for k, sc in enumerate(schedule.stage_costs))
              + "  (stage:F/B/W x activation size)")
    if schedule.memory_budget is not None:
        print(f"memory budget     {schedule.memory_budget:g} of 1F1B")
    if schedule.meta.get("plan"):
        print(f"plan              {schedule.meta['plan']}")
    print(f"makespan          {sim.makespan:g}")
    if bound is not None:
        reached = sim.makespan <= bound * (1 + 1e-9)
        print(f"lower bound       {bound:g}  (no order of these ops is shorter, whatever the memory: "
              + ("reached, so the plan is optimal)" if reached else f"the plan is {_pct(sim.makespan / bound - 1)} above it)"))
    print(f"bubble rate       {_pct(sim.bubble_rate)}")
    print(f"span bubble rate  {_pct(sim.span_bubble_rate)}")
    print(f"peak activations  {' '.join(str(p) for p in sim.peak_activations)}  (stage-activations per rank)")
    print(f"peak vs 1F1B      {' '.join(f'{v:.3g}' for v in sim.peak_vs_1f1b)}  (max {max(sim.peak_vs_1f1b):.3g})")
    if pred.text():
        print(f"paper predicts    {pred.text()}")
    note = no_saving_note(schedule.name, schedule.pp)
    if note:
        print(f"note              {note}")
    if args.text:
        from .schedule.render import text

        print(text(schedule, sim))
    for path in written:
        print(f"wrote             {path}")
    return 0


def plan_optimal(args: argparse.Namespace, schedule: Schedule) -> int:
    """`plan --optimal`: the exact reference for the schedule's placement, B/W split, costs and
    memory budget (the schedule's own, or its peak), with the generated schedule as the hint."""
    from .planner import optimal

    if not args.time_limit > 0:
        raise ConfigError(f"--time-limit {args.time_limit:g}: give the solver's time in seconds, > 0 (e.g. 30)")
    work = getattr(args, "work_limit", None)
    if work is not None and not work > 0:
        raise ConfigError(f"--work-limit {work:g}: give the solver's deterministic time, > 0 (e.g. 5)")
    within = f"{args.time_limit:g} s" if work is None else f"{work:g} of deterministic time"
    problem = optimal.problem_of(schedule, getattr(args, "memory_budget", None))
    result = optimal.solve(problem, args.time_limit, hint=schedule, work_limit=work)
    base = simulate(schedule)
    if result.schedule is None:
        print(f"optimal: no schedule found in {within} ({result.status}); lower bound {result.bound:g}; "
              f"{schedule.name} as generated: {base.makespan:g}")
        return 1 if result.status == "unknown" else EXIT_CONFIG_ERROR
    solved, sim = result.schedule, simulate(result.schedule)
    info = {**result.to_dict(), "of": schedule.name, "generated_makespan": base.makespan,
            "memory_budget": problem.memory_budget, "cap_stage_activations": problem.cap}
    written: List[str] = []
    if args.export:
        out = export_dict(solved, sim)
        out["optimal"] = info
        import os

        os.makedirs(os.path.dirname(os.path.abspath(args.export)), exist_ok=True)
        with open(args.export, "w") as f:
            f.write(json.dumps(out, separators=(", ", ": ")) + "\n")
        written.append(args.export)
    if args.picture:
        from .schedule.render import write_picture

        written += write_picture(solved, args.picture, sim)
    if args.json:
        print(json.dumps({**summary(solved, sim), "optimal": info, "written": written}, indent=2))
        return 0
    exact = "exact" if not result.rounded else f"costs rounded to 1/{result.scale}"
    word = "optimal (proven)" if result.status == "optimal" else f"best found in {within}"
    print(f"exact reference   {schedule.name}'s problem: placement {problem.placement.kind}, "
          f"{'B/W split' if problem.split else 'combined backward'}, budget {problem.memory_budget:.4g} of 1F1B "
          f"({problem.cap:g} stage-activations per rank)")
    print(f"makespan          {result.makespan:g}  {word}")
    print(f"lower bound       {result.bound:g}  (gap {_pct(result.gap)})")
    print(f"generated         {base.makespan:g}  ({schedule.name}; {_pct(base.makespan / result.bound - 1)} above the bound)")
    print(f"bubble rate       {_pct(sim.bubble_rate)}  ({schedule.name}: {_pct(base.bubble_rate)})")
    print(f"peak activations  {' '.join(f'{p:g}' for p in sim.peak_activations)}  (stage-activations per rank)")
    print(f"solver            CP-SAT, {result.wall_s:.1f} s; integer time, {result.scale} units per cost unit ({exact})")
    if args.text:
        from .schedule.render import text

        print(text(solved, sim))
    for path in written:
        print(f"wrote             {path}")
    return 0


def compare_rows(pp: int, microbatches: int, costs: Costs, memory_budget: Optional[float] = None,
                 stage_costs=None, names: Optional[Sequence[str]] = None) -> List[dict]:
    """One row per registered schedule, or per name of `names` in that order (v-auto at the budget,
    default 1.0); a schedule that cannot serve the sizes gives its reason.  With stage costs,
    `equal_plan_makespan` is the makespan under them of the plan made for equal stages (the gain of
    planning for them)."""
    rows = []
    for name in registry.names() if names is None else names:
        row: dict = {"schedule": name}
        budgeted = memory_budget is not None and registry.plans_under_budget(name)
        options = {"memory_budget": memory_budget} if budgeted else {}
        try:
            schedule = registry.build(name, pp, microbatches, costs, stage_costs=stage_costs, **options)
        except ConfigError as exc:
            row["error"] = str(exc)
            row["prediction"] = predict(name, pp, microbatches, costs).to_dict()
            rows.append(row)
            continue
        sim = simulate(schedule)
        pred = prediction_of(schedule)
        row.update(
            placement=schedule.placement.kind,
            bubble_rate=sim.bubble_rate,
            span_bubble_rate=sim.span_bubble_rate,
            peak_vs_1f1b=max(sim.peak_vs_1f1b),
            makespan=sim.makespan,
            prediction=pred.to_dict(),
            prediction_text=pred.text(),
        )
        note = no_saving_note(name, pp)
        if note:
            row["note"] = note
        if stage_costs is not None:
            equal = schedule
            if registry.plans_for_stage_costs(name):
                equal = registry.build(name, pp, microbatches, costs, **options)
                equal.stage_costs = schedule.stage_costs
            row["equal_plan_makespan"] = simulate(equal).makespan
        rows.append(row)
    return rows


def no_saving_note(name: str, pp: int) -> Optional[str]:
    """Why `name`, a schedule built to save activation memory, saves none at this pp (its bound
    equals 1F1B's), or None.  Schedules whose bound is 1F1B's at every pp (V-ZB) get no note."""
    pred = predict(name, pp, 1)
    if not pred.memory_is_bound or pred.peak_vs_1f1b is None or pred.peak_vs_1f1b < 1:
        return None
    from_pp = next((q for q in range(pp + 1, 4 * pp + 8) if (predict(name, q, 1).peak_vs_1f1b or 1) < 1), None)
    if from_pp is None:
        return None
    return (f"{name} saves no activation memory at pp={pp}: its bound {pred.memory_formula} = "
            f"{pred.peak_vs_1f1b:g} is 1F1B's; it saves memory from pp={from_pp}")


def format_table(header: List[str], rows: List[List[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


def plan_balanced(args: argparse.Namespace) -> int:
    """plan --model: the layout that simulates fastest for this schedule, next to the even split."""
    from .schedule.balance import balance

    options = {k: v for k, v in (("chunks", args.chunks), ("group", args.group)) if v is not None}
    shape = _model_shape(args)
    result = balance(shape, args.schedule, args.pp, args.microbatches, _costs(args.costs),
                     args.memory_budget, flag="--memory-budget", layers_flag=_layers_flag(args), **options)
    written: List[str] = []
    if args.export:
        export_write(result.schedule, args.export, "json", result.sim)
        written.append(args.export)
    if args.picture:  # the balanced layout's timeline, as plan draws any schedule's
        from .schedule.render import write_picture

        written += write_picture(result.schedule, args.picture, result.sim)
    if args.json:
        out = summary(result.schedule, result.sim)
        out.update({"machine": shape.machine.name, "layout": list(result.layout), "even_layout": list(result.even_layout),
                    "even": {"makespan": result.even_sim.makespan, "bubble_rate": result.even_sim.bubble_rate,
                             "peak_vs_1f1b": result.even_sim.peak_vs_1f1b}, "written": written})
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.schedule} pp={args.pp} microbatches={args.microbatches}, stage costs estimated from {args.model}"
          f", {_priced(shape)} (layers per stage in model order; --pipeline-layout takes the balanced one):")
    print(result.summary())
    if args.text:
        from .schedule.render import text

        print(text(result.schedule, result.sim))
    for path in written:
        print(f"wrote             {path}")
    return 0


def cmd_compare_model(args: argparse.Namespace) -> int:
    """compare --model: every schedule's even split against its balanced layout, under the estimate."""
    from .schedule.balance import compare_balanced, row_cells

    shape = _model_shape(args)
    rows = compare_balanced(shape, args.pp, args.microbatches, _costs(args.costs), args.memory_budget,
                            layers_flag=_layers_flag(args))
    if args.json:
        print(json.dumps({"pp": args.pp, "microbatches": args.microbatches, "model": args.model,
                          "machine": shape.machine.name, "rows": rows}, indent=2))
        return 0
    base = next((r["even"]["makespan"] for r in rows if r["schedule"] == "1f1b" and "even" in r), None)
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["schedule"]] + ["-"] * 7 + ["cannot serve: " + r["error"]])
            continue
        table.append([r["schedule"]] + row_cells(r, base))
    print(f"pp={args.pp}  microbatches={args.microbatches}  model {args.model}: {shape.num_layers} layers, hidden "
          f"{shape.hidden_size}, FFN {shape.ffn}, seq {shape.seq_length}, vocab {shape.vocab_size}, tp "
          f"{shape.tensor_model_parallel_size}, {_priced(shape)}"
          + (f"  memory budget {args.memory_budget:g}" if args.memory_budget else ""))
    print(format_table(["schedule", "even: bubble", "peak vs 1F1B", "time vs 1F1B", "balanced layout", "bubble",
                        "peak vs 1F1B", "time vs 1F1B", "speed-up"], table))
    print("time: simulated iteration under the estimated stage costs (schedule/balance.py), relative to 1F1B's even split"
          + ("" if args.memory_budget is not None else "; balanced: the fastest layout whatever its memory (give "
             "--memory-budget X to cap every schedule's peak)"))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    costs = _costs(args.costs)
    check_sizes("compare", args.pp, args.microbatches)  # what every schedule needs; else no row would serve
    if args.model:
        return cmd_compare_model(args)
    stage_costs = None
    if args.stage_costs:
        from .schedule.stage_costs import load

        stage_costs = load(args.stage_costs)
        if len(stage_costs) % args.pp:  # a count no schedule can use: one error, exit 2
            raise ConfigError(f"--stage-costs {args.stage_costs} gives {len(stage_costs)} stages; at pp={args.pp} give "
                              f"{2 * args.pp} entries (the V's stages in model order; 1F1B's {args.pp} stages merge pairs)")
    rows = compare_rows(args.pp, args.microbatches, costs, args.memory_budget, stage_costs)
    choice = None
    if args.memory_budget is not None:
        from .planner.choose import fastest_within

        best, reason = fastest_within(args.pp, args.microbatches, costs, args.memory_budget, stage_costs)
        choice = {"schedule": best.name, "reason": reason}
    if args.json:
        out = {"pp": args.pp, "microbatches": args.microbatches, "costs": costs.to_dict(), "rows": rows}
        if choice:
            out["fastest_within_budget"] = choice
        print(json.dumps(out, indent=2))
        return 0
    base = next((r["makespan"] for r in rows if r["schedule"] == "1f1b" and "makespan" in r), None)
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["schedule"], "-", "-", "-", "-", "-"] + (["-"] if stage_costs else []) +
                         ["cannot serve: " + r["error"].splitlines()[0]])
            continue
        vs = f"{r['makespan'] / base:.3f}" if base else "-"
        extra = []
        if stage_costs is not None:
            e = r["equal_plan_makespan"]
            extra = [f"{e:g} ({r['makespan'] / e - 1:+.1%})" if abs(e - r["makespan"]) > 1e-9 else "same plan"]
        table.append(
            [r["schedule"], _pct(r["bubble_rate"]), _pct(r["span_bubble_rate"]), f"{r['peak_vs_1f1b']:.3g}",
             f"{r['makespan']:g}", vs] + extra + [r["prediction_text"]]
        )
    c = costs
    print(f"pp={args.pp}  microbatches={args.microbatches}  costs per rank F={c.F:g} B={c.B:g} W={c.W:g} C={c.C:g}"
          + (f"  stage costs from {args.stage_costs}" if stage_costs else ""))
    header = ["schedule", "bubble", "span bubble", "peak vs 1F1B", "makespan", "vs 1F1B"]
    header += ["plan for equal stages (change)"] if stage_costs else []
    print(format_table(header + ["paper predicts"], table))
    for r in rows:
        if "note" in r:
            print(f"note: {r['note']}")
    if choice:
        print(f"\nfastest within memory budget {args.memory_budget:g}: {choice['reason']}")
    return 0


def cmd_frontier(args: argparse.Namespace) -> int:
    from .planner import frontier

    check_sizes("frontier", args.pp, args.microbatches)
    if args.memory_budget is not None:
        raise ConfigError(f"--memory-budget {args.memory_budget:g}: frontier plans every budget from V-Min's to 2.0 "
                          "(its rows are the budgets); drop it, or ask plan/compare for one budget")
    costs = _costs(args.costs)
    stage_costs, balanced = None, None
    if args.stage_costs:
        from .schedule.stage_costs import load

        stage_costs = load(args.stage_costs)
    shape = _model_shape(args) if args.model else None
    if shape:  # the even split's estimated stage costs, and the balanced layout at every budget
        points, balanced = frontier.balanced(shape, args.pp, args.microbatches, costs, _layers_flag(args))
    else:
        points = frontier.frontier(args.pp, args.microbatches, costs, stage_costs)
    written = []
    c = costs
    title = f"pp={args.pp} microbatches={args.microbatches} costs F={c.F:g} B={c.B:g} W={c.W:g} C={c.C:g}" + (
        f", stage costs estimated from {args.model} for {shape.machine.about}: even split and balanced layout"
        if shape else "")
    if args.picture:
        written = frontier.write(points, title, args.picture, balanced)
    if args.json:
        out = {"pp": args.pp, "microbatches": args.microbatches, "costs": costs.to_dict(),
               "points": [p.to_dict() for p in points], "written": written}
        if balanced is not None:
            out.update(machine=shape.machine.name, balanced=[p.to_dict() for p in balanced])
        print(json.dumps(out, indent=2))
        return 0
    print(title)
    budget = lambda p: "-" if p.memory_budget is None else f"{p.memory_budget:.4g}"  # noqa: E731
    if balanced is None:
        table = [[p.schedule, budget(p), f"{p.peak_vs_1f1b:.3g}", f"{p.makespan:g}", _pct(p.bubble_rate),
                  f"{p.vs_1f1b:.3f}"] for p in points]
        print(format_table(["schedule", "budget", "peak vs 1F1B", "makespan", "bubble", "vs 1F1B"], table))
    else:
        print(format_table(["schedule", "budget", "even: peak vs 1F1B", "bubble", "vs 1F1B", "balanced layout",
                            "peak vs 1F1B", "bubble", "vs 1F1B", "speed-up"], _frontier_pairs(points, balanced)))
        print("vs 1F1B: simulated iteration under the estimated stage costs (schedule/balance.py), relative to 1F1B's "
              "even split; balanced: the layout --pipeline-balance auto picks at that budget; the baselines are "
              "balanced without a memory budget, so their balanced peak may exceed the even split's")
    for path in written:
        print(f"wrote {path}")
    return 0


def _frontier_pairs(even, balanced) -> List[List[str]]:
    """One row per budget (then per baseline): the even split's figures beside the balanced layout's."""
    key = lambda p: (p.schedule, None if p.memory_budget is None else round(p.memory_budget, 9))  # noqa: E731
    by_key = {key(p): p for p in balanced}
    rows = []
    keys = dict.fromkeys(key(p) for p in list(even) + list(balanced))  # the V's budgets ascending, then the baselines
    for k in sorted(keys, key=lambda k: (k[1] is None, k[1] or 0.0, list(keys).index(k))):
        e = next((p for p in even if key(p) == k), None)
        b = by_key.get(k)
        figures = lambda p: ([f"{p.peak_vs_1f1b:.3g}", _pct(p.bubble_rate), f"{p.vs_1f1b:.3f}"] if p  # noqa: E731
                             else ["-", "-", "-"])
        layout = ",".join(map(str, b.layout)) if b and b.layout else "-"
        gain = f"{e.makespan / b.makespan - 1:+.1%}" if e and b else "-"
        rows.append([k[0], "-" if k[1] is None else f"{k[1]:.4g}"] + figures(e) + [layout] + figures(b) + [gain])
    return rows


def cmd_export(args: argparse.Namespace) -> int:
    schedule, chosen = _built(args)
    export_write(schedule, args.output, args.format)
    print(f"wrote {args.output} ({args.format}, {schedule.name}, pp={schedule.pp}, microbatches={schedule.microbatches})")
    if chosen:
        print(f"chosen by auto: {chosen}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """`check FILE.json`: read an export (perhaps edited by hand) back through the verifier that
    training uses (--pipeline-schedule-file), and print its figures recomputed from the op lists."""
    from .schedule.export import load_json, stale_figures
    from .schedule.verify import forwards_out_of_order

    schedule = load_json(args.file)  # ConfigError listing every problem: exit 2
    sim = simulate(schedule)
    with open(args.file) as f:
        stale = stale_figures(json.load(f), sim)
    order = forwards_out_of_order(schedule)
    if args.json:
        print(json.dumps({**summary(schedule, sim), "file": args.file, "valid": True, "stale_figures": stale,
                          "forwards_out_of_order": order}, indent=2))
        return 0
    p = schedule.placement
    print(f"{args.file}: valid: {schedule.name}, pp={schedule.pp}, {schedule.microbatches} microbatches, placement "
          f"{p.kind} ({p.chunks} chunk(s) per rank), {sum(map(len, schedule.ranks))} ops, deadlock-free under the "
          f"matching rule" + ("" if schedule.memory_budget is None else
                              f", within its memory budget {schedule.memory_budget:g}"))
    print(f"makespan          {sim.makespan:g}")
    print(f"bubble rate       {_pct(sim.bubble_rate)}")
    print(f"peak activations  {' '.join(str(v) for v in sim.peak_activations)}  (stage-activations per rank)")
    print(f"peak vs 1F1B      {' '.join(f'{v:.3g}' for v in sim.peak_vs_1f1b)}  (max {max(sim.peak_vs_1f1b):.3g})")
    for line in stale:
        print(f"note              stale figure: {line}")
    for line in order:
        print(f"note              {line}: forwards out of microbatch order; the runtime gives each microbatch its "
              f"own data whatever the order")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Recorded op times (Recorder.dump, one file per rank or a list) -> a stage-costs file."""
    from .runtime.replan import from_recorders, load_stats

    stats = load_stats(args.stats)
    table = from_recorders(stats, args.stages)
    out = {"stage_costs": [c.to_dict() for c in table], "unit": "seconds",
           "source": [str(p) for p in args.stats], "ops_recorded": sum(len(r["ops"]) for r in stats)}
    import os

    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    rows = [[str(s), f"{c.F * 1e3:.4g}", f"{c.B * 1e3:.4g}", f"{c.W * 1e3:.4g}", f"{c.size:.3g}"] for s, c in enumerate(table)]
    print(format_table(["stage", "F ms", "B ms", "W ms", "size"], rows))
    print(f"wrote {args.output} ({len(table)} stages, from {out['ops_recorded']} recorded ops)")
    return 0


def _sizes(p: argparse.ArgumentParser, schedule: bool) -> None:
    if schedule:
        p.add_argument("--schedule", required=True, help="one of: " + ", ".join(registry.names()) +
                       f"; or {AUTO}: the fastest within --memory-budget, as --pipeline-schedule auto picks it")
    p.add_argument("--pp", type=int, required=True, help="pipeline-parallel size")
    p.add_argument("--microbatches", type=int, required=True, help="microbatches per iteration")
    p.add_argument("--costs", help="F,B,W[,C] for one rank's share of the model (default 1,1,1,0)")
    p.add_argument("--stage-costs", metavar="FILE.json",
                   help="per-stage F, B, W and activation size (unequal stages; see schedule/stage_costs.py)")
    p.add_argument("--model", metavar="FILE.yaml",
                   help="the model's shape from a driver config (configs/gpt/*.yaml: num-layers, hidden-size, "
                        "seq-length, vocab-size, ...): stage costs estimated from it; plan and compare then also "
                        "size the stages (the even split against the balanced layout)")
    p.add_argument("--vocab-size", type=positive_int, metavar="N", help="with --model: this vocabulary instead")
    p.add_argument("--machine", choices=("gpu", "cpu"),
                   help="with --model: what the estimate prices, H100-class GPUs in bf16 (gpu, the default) or one "
                        "CPU core per rank in fp32 (cpu, the driver's runs without CUDA)")
    p.add_argument("--memory-budget", type=float, metavar="X",
                   help="activation memory as a fraction of 1F1B's (v-auto: from V-Min's ((p+4)//3)/p to 2.0)")
    if schedule:
        p.add_argument("--chunks", type=positive_int, help="model chunks per rank (1f1b-interleaved; default 2)")
        p.add_argument("--group", type=positive_int, help="Megatron's microbatch_group_size_per_vp_stage (1f1b-interleaved; default pp)")


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="megatron-vshape", description="Plan V-shape and baseline pipeline schedules.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="one schedule: bubble rates, makespan, per-rank peak memory")
    _sizes(p, schedule=True)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--export", metavar="PATH", type=output_path(),
                   help="write the schedule as JSON (format: docs/architecture.md)")
    p.add_argument("--picture", metavar="PATH", type=output_path(*PICTURE_EXTENSIONS),
                   help="draw the timeline: .svg (+ a PNG next to it with matplotlib), or .png/.pdf (matplotlib)")
    p.add_argument("--text", action="store_true", help="also draw the timeline in the terminal")
    p.add_argument("--optimal", action="store_true",
                   help="solve the schedule's problem exactly (placement, costs, memory budget) with OR-Tools CP-SAT "
                        "(pip install '.[optimal]'): best schedule found and proven lower bound")
    p.add_argument("--time-limit", type=float, default=30.0, metavar="S", help="seconds for --optimal (default 30)")
    p.add_argument("--work-limit", type=float, default=None, metavar="W",
                   help="stop --optimal after W of CP-SAT's deterministic time on one worker, so the result is the "
                        "same on any machine (--time-limit then only guards the wall clock)")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("compare", help="every registered schedule side by side")
    _sizes(p, schedule=False)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(run=cmd_compare)

    p = sub.add_parser("export", help="write a schedule as JSON or as torch.distributed.pipelining CSV")
    _sizes(p, schedule=True)
    p.add_argument("--format", choices=FORMATS, default="json")
    p.add_argument("--output", required=True, metavar="PATH", type=output_path())
    p.set_defaults(run=cmd_export)

    p = sub.add_parser("check", help="verify an exported schedule (e.g. edited by hand) and print its figures")
    p.add_argument("file", metavar="FILE.json", help="a schedule export (plan/export --export)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(run=cmd_check)

    p = sub.add_parser("profile", help="recorded op times (runtime.stats.Recorder.dump) -> a stage-costs file")
    p.add_argument("stats", nargs="+", metavar="STATS", help="JSON from Recorder.dump, one per rank (or a list of them)")
    p.add_argument("--output", required=True, metavar="PATH", help="stage-costs file to write (what --stage-costs reads)")
    p.add_argument("--stages", type=positive_int, help="stages of the schedule (default: the highest recorded stage + 1)")
    p.set_defaults(run=cmd_profile)

    p = sub.add_parser("frontier", help="fastest V-shape schedule for every memory budget, baselines beside it")
    _sizes(p, schedule=False)
    p.add_argument("--json", action="store_true", help="print the points as JSON")
    p.add_argument("--picture", metavar="PATH", type=output_path(".svg", ".png"),
                   help="draw memory vs makespan to SVG (+PNG next to it with matplotlib), or PNG")
    p.set_defaults(run=cmd_frontier)

    # verify_cmd imports torch only inside run(), so the planner stays torch-free.
    p = sub.add_parser("verify", help="run a schedule on a tiny GPT across ranks; compare losses, gradients, memory")
    verify_cmd.add_arguments(p)
    p.set_defaults(run=verify_cmd.run)

    # Its own parser (Megatron-LM's flag names), imported only when run: see main().
    sub.add_parser("pretrain", add_help=False,
                   help="GPT pretraining under a schedule, launched by torchrun (`pretrain --help` for its flags)")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_megatron_notices()  # megatron-core's "Apex is not installed" notices, nothing else
    if argv[:1] == ["pretrain"]:  # its own parser: Megatron-LM's flag names
        from .integration.train import main as pretrain

        return pretrain(argv[1:])
    ap = parser()
    args, extra = ap.parse_known_args(argv)  # bad values: one line, exit 2 (argtypes.Parser)
    prog = f"megatron-vshape {args.command}"
    if extra:  # named by the subcommand, whose --help lists what it takes
        subcommands = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices
        subcommands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    unwritable = check_output_paths(args)
    if unwritable:  # before any work, not after a long computation
        return fail(prog, unwritable, EXIT_RUN_ERROR)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        _check_machine(args)
        return run(args)
    except ConfigError as exc:
        return fail(prog, str(exc), EXIT_CONFIG_ERROR)
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        return fail(prog, f"{exc.strerror or exc}{where}", EXIT_RUN_ERROR)


if __name__ == "__main__":
    sys.exit(main())
