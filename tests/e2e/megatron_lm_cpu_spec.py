"""`--spec megatron_lm_cpu_spec LAYER` for Megatron-LM's gpt_builder: the CPU test layer spec
(megatron-core's local DotProductAttention allocates its buffer on CUDA)."""
from megatron_vshape.runtime.cpu_spec import cpu_gpt_layer_spec

LAYER = cpu_gpt_layer_spec()
