"""The GPT loss as megatron-core's forward-step contract wants it, shared by the training driver
and the tiny test model so both compute the same numbers."""
from __future__ import annotations

import torch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(summed loss over unmasked tokens, token count, {"lm loss": [sum, count]}): Megatron reduces
    the sums and counts over microbatches and data-parallel ranks, then divides."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach().clone(), tokens.float()])}
