"""Stand-in for Megatron-LM's pretrain_gpt.py (core_v0.16.1): the same functions, reduced."""
from functools import partial
from typing import List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.utils import get_attr_wrapped_model

from megatron.training import get_args, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.utils import get_batch_on_this_tp_rank, is_first_or_last_pipeline_stage


def get_batch(data_iterator, vp_stage: Optional[int] = None):
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None
    batch = get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank=False)
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model: GPTModel):
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, position_ids = get_batch(data_iterator, vp_stage)
    output_tensor = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask, model=model)


def is_dataset_built_on_rank(vp_stage=None):
    return is_first_or_last_pipeline_stage(vp_stage) and parallel_state.get_tensor_model_parallel_rank() == 0


class MockData:
    """Microbatches that depend only on (seed, iteration, microbatch): every layout reads the same data."""

    def __init__(self, args):
        from megatron_vshape.testing.tiny_gpt import TinyGPT

        self.tiny = TinyGPT(vocab_size=args.padded_vocab_size, seq_length=args.seq_length,
                            micro_batch_size=args.micro_batch_size, seed=args.seed)
        self.iters, self.m = args.train_iters, args.global_batch_size // args.micro_batch_size

    def __iter__(self):
        from megatron_vshape.testing.tiny_gpt import batch

        return (batch(self.tiny, step, i) for step in range(self.iters) for i in range(self.m))


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    print_rank_0("> building mock GPT datasets ...")
    return (MockData(args) if is_dataset_built_on_rank(vp_stage) else None), None, None


def get_embedding_ranks(pp_ranks: List[int]):
    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1 and not get_args().untie_embeddings_and_output_weights:
        ranks.append(pp_ranks[-1])
    return sorted(set(ranks))


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    from megatron_vshape.runtime.cpu_spec import cpu_gpt_block_spec

    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    return GPTModel(config=config, transformer_layer_spec=cpu_gpt_block_spec(config, vp_stage),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process, parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type="learned_absolute", vp_stage=vp_stage, pg_collection=pg_collection)


if __name__ == "__main__":
    torch.set_num_threads(1)
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             args_defaults={"tokenizer_type": "NullTokenizer"}, get_embedding_ranks=get_embedding_ranks)
