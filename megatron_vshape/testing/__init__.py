"""Test and demo helpers: a tiny GPT with layout-independent weights and data, and its
non-pipelined reference run.  Not used by the runtime."""
