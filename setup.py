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
        "runtime": ["torch>=2.4", "megatron-core>=0.16.1", "psutil"],
        "plots": ["matplotlib"],
        # `megatron-vshape plan --optimal`: the exact reference (schedule/optimal.py, CP-SAT).
        "optimal": ["ortools==9.15.6755"],
        # GPU clusters only: Transformer Engine and apex are imported lazily when present.
        "te": ["transformer-engine[pytorch]>=2.3"],
        # What Megatron-LM's megatron.training (core_v0.16.1) imports beyond megatron-core, pinned as tested;
        # triton only because its initialize.py imports the batch-invariant kernels unconditionally.
        "megatron-lm": ["six==1.17.0", "regex==2024.11.6", "pyyaml==6.0.2", "pydantic==2.11.7", "triton==3.9.0"],
    },
    entry_points={"console_scripts": ["megatron-vshape=megatron_vshape.cli:main"]},
)
