"""Every shell command in README.md runs exactly as printed, from a scratch copy of the repository.

Commands are the lines of the README's ```bash / ```sh / ```shell blocks (backslash continuations
joined, comment lines dropped), run in order with bash in a scratch copy of the repository whose
`.venv` links to the environment running this test, with no virtual environment on PATH (as a
user's shell after `make env`).  Each must exit 0.  New README sections are covered without
touching this file; the only commands not run are those matching SKIP (slow or needing things
this machine does not have, each with its reason) or PLACEHOLDER (not meant to run as printed).

The deterministic figures the README quotes (losses, bytes, ratios) are compared with what the
commands print today: the `verify` example's whole table, the quickstart's losses and per-rank
activation memory (the driver's own summary of the same runs), and its speed section's heading
and per-rank memory (the session's one demo run, tests/e2e/conftest.py); its times are a sample, labelled so.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

import pytest

from megatron_vshape.testing import processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 120  # seconds per command (a loaded 2-core machine): a README command that needs more belongs in SKIP, with its reason

SKIP = [
    (r"^make\b", "make targets create .venv or run the whole suite; this test runs inside that .venv"),
    (r"\btorchrun\b|megatron_vshape\.launch|megatron-vshape (verify|pretrain)\b|pretrain_gpt\.py"
     r"|scripts/bench/(cpu_pipeline|sweep_cpu|balanced_v)\.py",
     "starts training ranks (minutes on CPU); tests/distributed and tests/e2e run these paths"),
    (r"\b(sbatch|srun|salloc|squeue)\b|scripts/slurm/", "needs a SLURM cluster (tests/e2e covers the local one)"),
    (r"scripts/gpu_check\.py", "starts training ranks (a minute on CPU); tests/e2e/test_gpu_check.py runs it"),
    (r"scripts/bench/schedules\.py", "simulates the whole benchmark grid (minutes)"),
    (r"scripts/bench/report\.py", "reads the logs of a sweep that the skipped commands above produce"),
    (r"megatron-vshape profile\b", "reads the per-rank stats files a training run dumps"),
    (r"megatron-vshape frontier .*--model\b", "plans and balances v-auto at every budget (a minute or more on a "
     "loaded machine); tests/unit/test_cli.py runs frontier --model on a smaller problem"),
    (r"\bpip install\b|\bgit (clone|apply)\b|\bcd /", "installs or changes software outside this repository"),
]
PLACEHOLDER = re.compile(r"/path/to/|<[^<>\s]+>|<[A-Z][^<>]*>|\s\.\.\.(\s|$)")

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[ \t]*$")


def readme_commands(text):
    """[(command, skip reason or None)] from the README's shell blocks, in order."""
    commands, block, indent = [], None, ""
    for line in text.splitlines():
        fence = FENCE.match(line)
        if fence:
            if block is None:
                block, indent = (fence["lang"] in ("bash", "sh", "shell")), fence["indent"]
                block = [] if block else False
            else:
                if block:
                    commands += _join(block)
                block = None
            continue
        if block not in (None, False):
            block.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
    return [(c, _skip_reason(c)) for c in commands]


def _join(lines):
    out, current = [], ""
    for line in lines:
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            out.append(current.strip())
            current = ""
    return out + ([current.strip()] if current.strip() else [])


def _skip_reason(command):
    for pattern, reason in SKIP:
        if re.search(pattern, command):
            return reason
    if PLACEHOLDER.search(command):
        return "has placeholders to fill in (/path/to/..., <...>, ...)"
    return None


with open(os.path.join(ROOT, "README.md")) as _f:
    COMMANDS = readme_commands(_f.read())


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A copy of the repository's files (tracked and new, not ignored) with .venv linked to the
    environment running the tests, so nothing is written into the source tree."""
    dest = tmp_path_factory.mktemp("readme") / "repo"
    try:
        files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        files = None
    if files is None:
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".git", ".venv", "out", "__pycache__"))
    else:
        for name in filter(None, files):
            src = os.path.join(ROOT, name)
            if name == ".venv" or not os.path.isfile(src):
                continue
            os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, name))
    os.symlink(sys.prefix, dest / ".venv")
    return dest


def _env(scratch):
    venvs = {os.path.dirname(sys.executable), os.path.join(sys.prefix, "bin")}
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and os.path.realpath(d) not in {os.path.realpath(v) for v in venvs} and ".venv" not in d]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    # the scratch copy's package, not wherever the environment's editable install points
    env.update(PATH=os.pathsep.join(path), PYTHONPATH=str(scratch), MPLBACKEND="Agg")
    return env


def test_the_readme_has_commands_to_run():
    runnable = [c for c, reason in COMMANDS if reason is None]
    assert len(runnable) >= 5, COMMANDS  # the planner's commands at least


@pytest.mark.parametrize("command, skip", COMMANDS, ids=[c[:90] for c, _ in COMMANDS])
def test_readme_command_runs_as_printed(command, skip, scratch):
    if skip:
        pytest.skip(skip)
    code, out, err = processes.run(["bash", "-c", command], TIMEOUT, cwd=scratch, env=_env(scratch))
    if code is None:  # killed with whatever it started
        pytest.fail(f"{command!r} ran past {TIMEOUT}s: make it quicker or add a SKIP rule with the reason")
    assert code == 0, f"{command}\nexit {code}\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in err, err


# ---- the figures the README quotes -------------------------------------------------------------

def _readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _block(starting: str) -> str:
    """The ```text block of the README whose first line starts with `starting`."""
    for m in re.finditer(r"```text\n(.*?)```", _readme(), re.S):
        if m.group(1).startswith(starting):
            return m.group(1)
    raise AssertionError(f"README has no text block starting {starting!r}")


@pytest.mark.timeout(400)
def test_verify_example_is_what_verify_prints(capsys):
    from megatron_vshape.integration import verify_cmd

    quoted = _block("megatron-vshape verify: v-half pp=4")
    args = verify_cmd.add_arguments(argparse.ArgumentParser()).parse_args(["--schedule", "v-half", "--pp", "4"])
    assert verify_cmd.run(args) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert printed == [line for line in quoted.splitlines() if line.strip()]


def _quickstart_runs(rank, world_size):
    from megatron_vshape.argtypes import quiet_megatron_notices
    from megatron_vshape.integration import train

    quiet_megatron_notices()
    config = os.path.join(ROOT, "configs", "tiny", "tiny-cpu.yaml")
    out = {}
    for name, argv in (("v-half", ["--pipeline-schedule", "v-half", "--train-iters", "30", "--log-interval", "30"]),
                       ("1f1b", ["--pipeline-schedule", "1f1b", "--train-iters", "3", "--log-interval", "3",
                                 "--lr-warmup-iters", "0"])):
        args = train.parse_args(["--config", config] + argv)
        out[name] = train.run(args, train.validate(args, world_size=world_size))
    return out


@pytest.mark.timeout(600)
def test_quickstart_losses_and_memory_are_what_the_driver_prints():
    from megatron_vshape.integration.launch import launch

    quoted = _block("schedule picture: out/quickstart-v-half-pp4-m8.svg")
    runs = launch(_quickstart_runs, 4, (), timeout=560)[0]
    ours, base = runs["v-half"], runs["1f1b"]
    losses = ours["losses"]
    for it in (3, 30):  # each line's loss is its --log-interval 3's mean, as Megatron-LM's
        m = re.search(rf"iteration +{it}/ +30 \|.*lm loss: (\S+) \|.*peak activations MiB per pp rank: (\S+)", quoted)
        mean = sum(losses[it - 3:it]) / 3
        assert m and m.group(1) == f"{mean:.6E}", (it, m and m.group(1), f"{mean:.6E}")
        assert m.group(2) == "/".join(f"{b / 2 ** 20:.2f}" for b in ours["peak_activation_bytes"])
    assert f"loss (v-half): {ours['first_loss']:.3f} at iteration 1 -> {ours['final_loss']:.3f} at iteration 30" in quoted
    for r, (a, b) in enumerate(zip(ours["peak_activation_bytes"], base["peak_activation_bytes"])):
        row = f"{r:>4}  {a / 2**20:>8.2f} MiB  {b / 2**20:>8.2f} MiB  {a / max(base['peak_activation_bytes']):>12.2f}"
        assert row in quoted, row


@pytest.mark.timeout(400)
def test_quickstart_speed_section_is_what_the_demo_prints(quickstart_pp2):
    import importlib.util

    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(ROOT, "scripts", "quickstart.py"))
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    quoted = _block("schedule picture: out/quickstart-v-half-pp4-m8.svg")
    lines = quoted.splitlines()
    heading = next(line for line in lines if line.startswith("3) speed"))
    m = re.search(r"(\d+) launches of \d+ processes x (\d+) steps each", heading)
    assert heading == quickstart.speed_heading(int(m.group(1)), int(m.group(2)))
    assert int(m.group(1)) > 1 and int(m.group(2)) > 1  # the median of several steps and of more than one run
    # The session's demo run (conftest.py) at one launch of one step: memory does not depend on how
    # long it runs, and its speed section is the same pp=2 launches whatever the config.
    printed = quickstart_pp2[0].stdout.splitlines()
    printed = printed[next(i for i, line in enumerate(printed) if line.startswith("3) speed")) + 2:]
    table = lines[lines.index(heading) + 1:]
    assert table[0].split()[:3] == ["schedule", "step", "ms"]
    for name, row, demo in zip(quickstart.SPEED_SCHEDULES, table[1:], printed):
        cells, demo = row.split(), demo.split()
        assert cells[0] == demo[0] == name and len(cells) == len(demo) == 6 + quickstart.SPEED_PP, (row, demo)
        assert cells[6:] == demo[6:], (row, demo)
    assert float(table[1].split()[2]) == float(table[1].split()[3]) == 1.0  # 1F1B against itself
