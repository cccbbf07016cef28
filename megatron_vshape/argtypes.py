"""Command-line plumbing shared by every `megatron-vshape` subcommand and the scripts.

* `Parser`: an ArgumentParser whose errors are one line naming the option, the value and the
  fix (exit 2), instead of the usage block.  Subparsers inherit it, so subcommands added later
  get the same errors without doing anything.
* Types for options: `positive_int`, `nonnegative_int`, `positive_float`, `nonnegative_float`
  (finite numbers only) and `output_path(*extensions)`.  A bad value is rejected while parsing.
* `check_output_paths(args)`: every `output_path` option of a parsed namespace can be written
  (its directory exists or can be made); called before any work, exit 1 when one cannot.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Callable, Optional, Sequence

EXIT_CONFIG_ERROR = 2  # the user's values: fix the command line
EXIT_RUN_ERROR = 1  # the run or the file system failed


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are a single line: `prog: error: what; fix`."""

    def error(self, message: str):  # argparse calls this for every usage error
        self.exit(EXIT_CONFIG_ERROR, f"{self.prog}: error: {_explain(message, self.prog)}\n")


# argparse's own wording -> ours (value and fix named).  Anything else keeps argparse's text.
_REWRITES = [
    (re.compile(r"argument (?P<opt>\S+): invalid int value: '(?P<val>.*)'$"),
     "{opt}={val!r} is not a whole number; give one, e.g. {opt} 4"),
    (re.compile(r"argument (?P<opt>\S+): invalid float value: '(?P<val>.*)'$"),
     "{opt}={val!r} is not a number; give one, e.g. {opt} 0.5"),
    (re.compile(r"argument (?P<opt>\S+): invalid choice: '(?P<val>.*)' \(choose from (?P<choices>.*)\)$"),
     "{opt}={val!r} is not one of the choices; choose from {choices}"),
    (re.compile(r"argument (?P<opt>\S+): expected one argument$"),
     "{opt} needs a value, e.g. {opt} VALUE"),
    (re.compile(r"argument (?P<opt>\S+): (?P<msg>.*)$"), "{opt}: {msg}"),
]


def _explain(message: str, prog: str) -> str:
    for pattern, template in _REWRITES:
        match = pattern.match(message)
        if match:
            return template.format(**match.groupdict())
    return f"{message}; see `{prog} --help`"


# ---- option types (each raises ArgumentTypeError: argparse prefixes the option name) ----------

def _number(kind: Callable, text: str, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def _at_least(kind: Callable, low, strict: bool, what: str) -> Callable[[str], object]:
    def check(text: str):
        value = _number(kind, text, what)
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"got {text}; give {what}")
        return value

    check.__name__ = what  # argparse names the type in some messages
    return check


positive_int = _at_least(int, 1, False, "a whole number >= 1")
nonnegative_int = _at_least(int, 0, False, "a whole number >= 0")
positive_float = _at_least(float, 0.0, True, "a finite number > 0")
nonnegative_float = _at_least(float, 0.0, False, "a finite number >= 0")


class OutputPath(str):
    """A path the user asked us to write (see `check_output_paths`)."""


def output_path(*extensions: str) -> Callable[[str], OutputPath]:
    """Type for an option naming a file to write; `extensions` (e.g. ".svg", ".png") limit its
    suffix, case-insensitively.  The directory is checked by `check_output_paths` after parsing."""

    def check(text: str) -> OutputPath:
        if not text:
            raise argparse.ArgumentTypeError("needs a file name")
        ext = os.path.splitext(text)[1].lower()
        if extensions and ext not in extensions:
            raise argparse.ArgumentTypeError(
                f"{text!r} has the unsupported extension {ext or '(none)'!r}; name a file ending in "
                f"{' or '.join(extensions)}")
        return OutputPath(text)

    check.__name__ = "output path"
    return check


def unwritable(path: str) -> Optional[str]:
    """Why `path` cannot be written (its directory made as needed), or None when it can."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return f"{path} is a directory"
    if os.path.exists(full):
        return None if os.access(full, os.W_OK) else f"{path} exists and is not writable"
    parent = os.path.dirname(full)
    while not os.path.exists(parent):  # the first existing ancestor decides
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable"
    return None


def check_output_paths(args: argparse.Namespace) -> Optional[str]:
    """One line for the first output option that cannot be written, or None."""
    for dest, value in vars(args).items():
        if isinstance(value, OutputPath):
            why = unwritable(value)
            if why:
                return f"--{dest.replace('_', '-')} {value}: cannot write it: {why}; choose a path in a writable directory"
    return None


# megatron-core's notices that say nothing to a user of ours: optional packages missing at
# import (it falls back to torch), and a deprecation its own TransformerConfig default
# (cuda_graph_scope="full") triggers.  Literal message prefixes: PYTHONWARNINGS, which spawned
# ranks read, takes only those.
MEGATRON_CORE_NOTICES: Sequence[str] = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
)


def quiet_megatron_notices() -> None:
    """Hide exactly megatron-core's notices listed above, in this process and in the ranks it starts
    (through PYTHONWARNINGS, read before a rank imports anything); every other warning,
    ours included, still shows."""
    import warnings

    entries = [f"ignore:{text}:UserWarning" for text in MEGATRON_CORE_NOTICES]
    for text in MEGATRON_CORE_NOTICES:
        warnings.filterwarnings("ignore", message=re.escape(text), category=UserWarning)
    current = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    os.environ["PYTHONWARNINGS"] = ",".join(current + [e for e in entries if e not in current])


def fail(prog: str, message: str, status: int) -> int:
    """Print `prog: error: message` on stderr and return `status` (the exit code)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status
