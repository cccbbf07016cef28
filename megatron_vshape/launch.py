"""Run a Megatron-LM training script with megatron_vshape's schedules installed.

    python -m megatron_vshape.launch /path/to/Megatron-LM/pretrain_gpt.py <Megatron-LM args> --pipeline-schedule v-half
    torchrun --nproc-per-node 8 -m megatron_vshape.launch /path/to/Megatron-LM/pretrain_gpt.py ...

The script runs as `python SCRIPT ...` would run it (as __main__, its folder first on sys.path, its
arguments in sys.argv), after `megatron_vshape.install()`.  A configuration mistake exits with
status 2 and one line on stderr (from rank 0 under torchrun; see integration/errors.py).
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

USAGE = "usage: python -m megatron_vshape.launch SCRIPT.py [SCRIPT ARGS ...] [--pipeline-schedule NAME ...]"


def main(argv: Optional[List[str]] = None) -> int:
    from .schedule.errors import ConfigError

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.strip().split("\n\n")[1], file=sys.stderr if not argv else sys.stdout)
        return 0 if argv else 2
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        print(f"megatron_vshape.launch: error: {argv[0]} is not a file; pass the training script first "
              f"(e.g. /path/to/Megatron-LM/pretrain_gpt.py)", file=sys.stderr)
        return 2
    sys.argv = [script] + argv[1:]
    sys.path.insert(0, os.path.dirname(script))
    try:
        from .integration.megatron_lm import install

        install()
        runpy.run_path(script, run_name="__main__")
    except ConfigError as e:  # found alike on every rank (Megatron-LM parses and validates on each): said once
        from .integration.errors import report

        report("megatron_vshape", str(e), shared=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
