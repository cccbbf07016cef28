"""Test and demo helpers: a tiny GPT with layout-independent weights and data, and its
non-pipelined reference run; timed steps for the CPU benchmarks; commands bounded in time with
everything they start.  Not used by the runtime."""
