"""Stand-in for Megatron-LM's megatron.training (see ../../README.md)."""
from .global_vars import get_args, print_rank_0
from .training import pretrain
