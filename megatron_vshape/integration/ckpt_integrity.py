"""Checksums of a checkpoint's files, so that a damaged checkpoint is refused instead of loaded.

After a save, `checksums.json` in the checkpoint directory records the size and SHA-256 of every
file in it (written before the "latest" tracker names the checkpoint, so a checkpoint the tracker
names has one).  Before a load every file is checked against it: a flipped byte, a truncated or a
missing file is named in one line.  The work is shared: rank r hashes files r, r+world, ...
(`share`); the caller gathers the results.  A checkpoint without the file (saved by an older
version) loads unchecked.  Pure file work: no torch, no collectives.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Dict, Iterable, List, Optional, Tuple

MANIFEST = "checksums.json"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_BLOCK = 1 << 24


def files(target: str) -> List[str]:
    """Every file of the checkpoint at `target`, relative to it, sorted (the manifest excluded)."""
    out = []
    for folder, _, names in os.walk(target):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), target)
            if rel != MANIFEST and not name.endswith(".tmp"):
                out.append(rel)
    return sorted(out)


def share(names: List[str], rank: int, world: int) -> List[str]:
    return names[rank::world]


def digest(path: str) -> Tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def digests(target: str, names: Iterable[str]) -> Dict[str, list]:
    return {name: list(digest(os.path.join(target, name))) for name in names}


def write_manifest(target: str, entries: Dict[str, list]) -> None:
    tmp = os.path.join(target, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"algorithm": "sha256", "files": dict(sorted(entries.items()))}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(target, MANIFEST))


def read_manifest(target: str) -> Optional[Dict[str, list]]:
    """{file: [size, sha256]}, or None when the checkpoint has no manifest; ValueError when it is unreadable."""
    path = os.path.join(target, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return dict(json.load(f)["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{MANIFEST} is unreadable ({type(e).__name__})") from None


def problem(target: str, manifest: Dict[str, list], names: Iterable[str]) -> Optional[str]:
    """The first of `names` (manifest entries) that is missing, of another size or another checksum."""
    for name in names:
        path = os.path.join(target, name)
        size, sha = manifest[name]
        try:
            actual = os.path.getsize(path)
            if actual != size:
                return f"{name} has {actual} bytes, {size} when saved (truncated or overwritten)"
            if digest(path)[1] != sha:
                return f"{name} does not match its checksum (changed on disk since the save)"
        except OSError as e:
            return f"{name} cannot be read ({e.strerror or e})"
    return None


def iteration_dirs(root: str) -> List[Tuple[int, str]]:
    """(iteration, directory) of every `iter_*` checkpoint directory under `root`, newest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in names for m in [_ITER_DIR.match(n)] if m]
    return sorted((f for f in found if os.path.isdir(f[1])), reverse=True)


def retire(root: str, retain: int, keep: Iterable[str] = ()) -> List[str]:
    """Delete all but the newest `retain` complete checkpoints under `root`, never one in `keep`
    (the checkpoint a run resumed from); returns what was deleted."""
    keep = {os.path.realpath(k) for k in keep}
    complete = [d for _, d in iteration_dirs(root) if os.path.isfile(os.path.join(d, "metadata.json"))]
    gone = []
    for d in complete[retain:]:
        if os.path.realpath(d) not in keep:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone
