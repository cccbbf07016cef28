"""What the driver builds on GPUs: what Megatron-LM users get, each part where its kernel exists.

A pure function of the flags and of what is importable (`importable(module) -> bool`), so the
choice is tested on CPU for every combination.  On CPU everything stays off (no kernels), as
before: the CPU path is unchanged.

* layers: Transformer Engine's when `--transformer-impl` is unset and TE is installed (and new
  enough for a schedule that splits the backward), else megatron-core's local ones;
* fusions: bias+dropout and bias+activation (torch.jit, every GPU); masked softmax with the
  compiled `scaled_*masked_softmax_cuda` kernels; the persistent layer norm with apex's; RoPE
  with TE's; gradient-accumulation fusion with apex's `fused_weight_gradient_mlp_cuda`
  (megatron-core's own output layer needs it even under TE layers);
* `deallocate_pipeline_outputs`: True, as Megatron-LM forces it (a stage output's data is freed
  once sent; only its autograd node is kept).
"""
from __future__ import annotations

import importlib.util
from typing import Callable, Dict, Optional, Tuple

OFF = dict(bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
           gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)
# Fusion -> the compiled modules it needs (all of them).
KERNELS: Dict[str, Tuple[str, ...]] = {
    "masked_softmax_fusion": ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"),
    "persist_layer_norm": ("apex.contrib.layer_norm.layer_norm",),
    "apply_rope_fusion": ("transformer_engine",),
    "gradient_accumulation_fusion": ("fused_weight_gradient_mlp_cuda",),
}


def importable(module: str) -> bool:
    """Whether `module` can be found, without importing it (its parent packages are imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def transformer_impl(flag: Optional[str], gpu: bool, te_version: Optional[tuple], split: bool,
                     te_min_for_split: tuple) -> str:
    """`--transformer-impl` as given, or the default: TE on GPUs where it is installed and can
    run the schedule (a split schedule needs TE >= te_min_for_split), else local."""
    if flag is not None:
        return flag
    if gpu and te_version is not None and (not split or te_version >= te_min_for_split):
        return "transformer_engine"
    return "local"


def config_options(args, gpu: bool, has: Callable[[str], bool] = importable) -> dict:
    """TransformerConfig options for speed: all fusions off on CPU; on GPUs each fusion whose
    kernels `has`, and deallocate_pipeline_outputs."""
    if not gpu:
        return dict(OFF)
    out = dict(OFF, bias_dropout_fusion=True, bias_activation_fusion=True, deallocate_pipeline_outputs=True)
    for option, modules in KERNELS.items():
        out[option] = all(has(m) for m in modules)
    if getattr(args, "position_embedding_type", "learned_absolute") != "rope":
        out["apply_rope_fusion"] = False
    return out
