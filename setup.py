from setuptools import find_packages, setup

setup(
    name="megatron_vshape",
    version="0.1.0",
    description="V-shape pipeline schedules (V-Min, V-Half, V-ZB) with controllable memory for Megatron-core",
    packages=find_packages(include=["megatron_vshape", "megatron_vshape.*"]),
    python_requires=">=3.10",
    # The schedule engine and planner need nothing; the runtime needs torch and megatron-core,
    # which users bring (CUDA builds on clusters). requirements-cpu.txt pins the CPU test stack.
    extras_require={
        # Tested megatron-core range (runtime/compat.py refuses others at start-up): 0.16.0 to 0.20.0, i.e. the
        # releases 0.16.x-0.19.x on the package index and 0.20.0 as Megatron-LM main (d98e8a6) carries it.
        # 0.19.x asks for Python >= 3.12 in its metadata; its 3.11 wheel runs here (Makefile, .venv-mcore019).
        "runtime": ["torch>=2.4", "megatron-core>=0.16.0,<=0.20.0", "psutil"],
        "plots": ["matplotlib"],
        # `megatron-vshape plan --optimal`: the exact reference (planner/optimal.py, CP-SAT).
        "optimal": ["ortools==9.15.6755"],
        # GPU clusters only: Transformer Engine and apex are imported lazily when present.
        "te": ["transformer-engine[pytorch]>=2.3"],
        # What Megatron-LM's megatron.training (core_v0.16.0 to main) imports beyond megatron-core, pinned as
        # tested; triton because its initialize.py (and megatron-core's schedules from 0.18) import it.
        "megatron-lm": ["six==1.17.0", "regex==2024.11.6", "pyyaml==6.0.3", "pydantic==2.11.7", "triton==3.9.0"],
    },
    entry_points={"console_scripts": ["megatron-vshape=megatron_vshape.cli:main"]},
)
