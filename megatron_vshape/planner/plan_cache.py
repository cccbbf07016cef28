"""The search's plans kept per problem: the latest in memory, and, when the environment variable
MEGATRON_VSHAPE_PLAN_CACHE names a directory, every one on disk for other processes.

Every rank of a job plans the same problem (the search is deterministic), and so does every
`megatron-vshape` command that meets it again; a v-auto plan at pp=16 takes up to 2 s, `auto`
weighs several.  With the directory set, a process that finds a plan there reads it instead of
searching: one JSON file per problem, named by a hash of the problem and of this package's
schedule and planner source (an edited planner never reads an older plan), written whole
under a temporary name and renamed, so concurrent ranks never read half a file.  A file that
does not parse, or names another problem, is planned again and rewritten.  Plans read from it
are verified like any other (search.plan).  Pure Python, no torch.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import tempfile
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

ENV = "MEGATRON_VSHAPE_PLAN_CACHE"
_PACKAGE = pathlib.Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of the source a plan depends on: the schedule model and the planner."""
    h = hashlib.sha256()
    for path in sorted((_PACKAGE / "schedule").glob("*.py")) + sorted((_PACKAGE / "planner").glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


class PlanCache:
    """`fn`'s results by its arguments (their repr names them): the last `size` in memory, all
    on disk under $MEGATRON_VSHAPE_PLAN_CACHE.  `cache_clear()` empties the memory, and this
    process reads no file written before it: the next call plans again (what the benchmarks
    timing the search and the tests comparing two builds mean by it)."""

    def __init__(self, fn: Callable[..., Any], size: int = 256):
        functools.update_wrapper(self, fn)
        self.fn, self.size, self.memory, self.since = fn, size, OrderedDict(), 0
        self.warned = False  # an unwritable folder is said once

    def __call__(self, *args):
        if args in self.memory:
            self.memory.move_to_end(args)
            return self.memory[args]
        name = repr(args)
        path = self._path(name)
        value = self._read(path, name) if path else None
        if value is None:
            value = self.fn(*args)
            if path:
                self._write(path, name, value)
        self.memory[args] = value
        if len(self.memory) > self.size:
            self.memory.popitem(last=False)
        return value

    def cache_clear(self) -> None:
        self.memory.clear()
        self.since = time.time_ns()

    @staticmethod
    def _path(name: str) -> Optional[pathlib.Path]:
        root = os.environ.get(ENV)
        if not root:
            return None
        key = hashlib.sha256(f"{code_version()}\0{name}".encode()).hexdigest()[:32]
        return pathlib.Path(root) / f"{key}.json"

    def _read(self, path: pathlib.Path, name: str):
        try:
            if path.stat().st_mtime_ns < self.since:
                return None
            data = json.loads(path.read_text())
            if data["args"] != name:
                return None
            return tuple(tuple(ops) for ops in data["order"]), data["how"]
        except (OSError, ValueError, KeyError, TypeError):
            return None  # absent, half-gone or not ours: planned again and rewritten

    def _write(self, path: pathlib.Path, name: str, value) -> None:
        order, how = value
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".plan-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"args": name, "order": [list(ops) for ops in order], "how": how}, f)
            os.replace(tmp, path)
        except OSError as exc:  # a full or read-only disk costs the next process a search, nothing more
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            if not self.warned:
                import warnings

                warnings.warn(f"{ENV}: plans are not kept in {path.parent}: {exc}", RuntimeWarning, stacklevel=3)
                self.warned = True
