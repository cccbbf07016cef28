"""Every bad value: one line on stderr naming the option, the value and the fix; exit 2 for a
configuration mistake, 1 for a run-time failure (a file that cannot be written).  No
substituted defaults, no tracebacks, no usage block."""
import argparse
import os
import subprocess
import sys

import pytest

from megatron_vshape import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = ("--schedule", "v-half", "--pp", "4", "--microbatches", "8")


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "megatron_vshape.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.fixture
def paths(tmp_path):
    (tmp_path / "a-file").write_text("x")
    return {"FILE": str(tmp_path / "a-file"), "DIR": str(tmp_path), "TMP": str(tmp_path)}


# (arguments with {FILE}/{DIR}/{TMP} placeholders, exit status, words the one line must contain)
CASES = [
    # verify: values it used to replace by defaults, crash on, or accept
    (("verify", "--microbatches", "0"), 2, ["--microbatches", "0", ">= 1"]),
    (("verify", "--num-layers", "0"), 2, ["--num-layers", "0", ">= 1"]),
    (("verify", "--timeout", "0"), 2, ["--timeout", "0", "> 0"]),
    (("verify", "--timeout", "nan"), 2, ["--timeout", "nan", "> 0"]),
    (("verify", "--tolerance", "-1"), 2, ["--tolerance", "-1", ">= 0"]),
    (("verify", "--steps", "0"), 2, ["--steps", "0", ">= 1"]),
    (("verify", "--pp", "two"), 2, ["--pp", "'two'", "whole number"]),
    (("verify", "--backend", "mpi"), 2, ["--backend", "'mpi'", "choose from"]),
    # argparse type errors: one line, not five lines of usage
    (("compare", "--pp", "x", "--microbatches", "8"), 2, ["--pp", "'x'", "whole number"]),
    (("compare", "--pp", "4", "--microbatches", "2.5"), 2, ["--microbatches", "'2.5'", "whole number"]),
    (("compare", "--pp", "4"), 2, ["--microbatches", "--help"]),
    (("compare", "--pp", "4", "--microbatches", "8", "--costs"), 2, ["--costs", "needs a value"]),
    (("plan", *SIZES, "--chunks", "0"), 2, ["--chunks", "0", ">= 1"]),
    (("plan", *SIZES, "--frobnicate"), 2, ["--frobnicate", "megatron-vshape plan --help"]),
    (("teleport",), 2, ["'teleport'", "choose from"]),
    # pictures: only formats we really write
    (("plan", *SIZES, "--picture", "{TMP}/x.jpg"), 2, ["--picture", "x.jpg", ".svg or .png or .pdf"]),
    (("plan", *SIZES, "--picture", "{TMP}/noext"), 2, ["--picture", "noext", ".svg"]),
    # unwritable outputs: refused before any work, naming the path and why
    (("plan", *SIZES, "--picture", "{FILE}/x.svg"), 1, ["--picture", "{FILE}/x.svg", "is a file, not a directory"]),
    (("plan", *SIZES, "--export", "{FILE}/x.json"), 1, ["--export", "{FILE}/x.json", "is a file, not a directory"]),
    (("plan", *SIZES, "--export", "{FILE}/deeper/x.json"), 1, ["--export", "is a file, not a directory"]),
    (("plan", *SIZES, "--picture", "/proc/1/x.svg"), 1, ["--picture", "/proc/1", "not writable"]),
    (("export", *SIZES, "--output", "{DIR}"), 1, ["--output", "{DIR}", "is a directory"]),
    (("export", *SIZES, "--output", "{FILE}/x.csv", "--format", "torch-csv"), 1, ["--output", "is a file"]),
]


@pytest.mark.parametrize("args, status, words", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_value(args, status, words, paths):
    args = [a.format(**paths) for a in args]
    r = run_cli(*args, cwd=paths["TMP"])
    assert r.returncode == status, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # one line: no usage block, no traceback, no warnings
    prog = "megatron-vshape" + ("" if args[0] == "teleport" else f" {args[0]}")
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    for word in words:
        assert word.format(**paths) in lines[0], (word, lines[0])
    assert r.stdout == ""
    assert not os.path.exists(os.path.join(paths["TMP"], "x.jpg"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_read_only_directory_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    r = run_cli("plan", *SIZES, "--picture", str(ro / "x.svg"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "not writable" in r.stderr


def test_pdf_picture_is_a_real_pdf(tmp_path):
    pytest.importorskip("matplotlib")
    r = run_cli("plan", *SIZES, "--picture", str(tmp_path / "x.pdf"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "x.pdf").read_bytes()[:5] == b"%PDF-"


def _subcommands():
    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_every_typed_option_of_every_subcommand_fails_in_one_line(name, capsys, monkeypatch):
    """Covers options added later: whatever a subcommand's typed options are, a value that is not
    one gives one line and exit 2 (the shared Parser), and --help names no missing document."""
    monkeypatch.setenv("PYTHONWARNINGS", "")  # main() adds its filters to the environment
    sub = _subcommands()[name]
    typed = [a for a in sub._actions if a.option_strings and a.type not in (None, str) and a.nargs != 0]
    for action in typed:
        option = action.option_strings[-1]
        with pytest.raises(SystemExit) as exit_:
            cli.main([name, option, "not-a-value"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2, (option, err)
        assert err.count("\n") == 1 and err.startswith(f"megatron-vshape {name}: error: "), (option, err)
    with pytest.raises(SystemExit) as exit_:
        cli.main([name, "--help"])
    assert exit_.value.code == 0
    assert "DESIGN.md" not in capsys.readouterr().out


def test_bench_script_refuses_bad_values_in_one_line(tmp_path):
    script = os.path.join(ROOT, "scripts", "bench", "cpu_pipeline.py")
    for args, status, word in ((["--steps", "0"], 2, "--steps"), (["--csv", str(tmp_path)], 1, "is a directory")):
        r = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": ROOT})
        assert r.returncode == status and r.stderr.count("\n") == 1 and word in r.stderr, r.stderr
