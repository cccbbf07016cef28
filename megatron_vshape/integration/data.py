"""GPT data for the training driver through megatron-core's datasets: mock data, or indexed
`.bin/.idx` data (megatron's IndexedDataset) with a tokenizer, and Megatron's sample order.

Every rank builds the same datasets (they are small index files over memory-mapped data), and
iteration i's global batch is samples [i*gbs, (i+1)*gbs) of the split in the dataset's shuffled
order, data-parallel rank d taking its contiguous slice of micro_batch_size*microbatches
samples, as Megatron's pretraining sampler does.  So a run resumed at any iteration, under any
schedule or pipeline size, sees the same samples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import torch

from ..schedule.errors import ConfigError

TOKENIZERS = ("NullTokenizer",)


def build_tokenizer(args):
    if args.tokenizer_type not in TOKENIZERS:
        raise ConfigError(f"--tokenizer-type {args.tokenizer_type} is not supported by this driver; use "
                          f"{', '.join(TOKENIZERS)} with --vocab-size (token ids as stored in the .bin files)")
    if not args.vocab_size:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size N (ids 0..N-1; N is end-of-document)")
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return NullTokenizer(args.vocab_size)


def _blend(paths: Optional[List[str]]):
    """Megatron's --data-path: `prefix` or `weight prefix weight prefix ...`."""
    if not paths:
        return None
    if len(paths) == 1:
        return [paths[0]], None
    try:
        weights = [float(w) for w in paths[0::2]]
    except ValueError:
        raise ConfigError(f"--data-path {' '.join(paths)}: give one prefix, or weight prefix pairs") from None
    return list(paths[1::2]), weights


@dataclass
class Datasets:
    train: object
    valid: Optional[object]
    tokenizer: object


def build_datasets(args, train_samples: int, valid_samples: int) -> Datasets:
    """megatron-core GPT datasets (train, valid) with at least the given numbers of samples."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    tokenizer = build_tokenizer(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=_blend(args.data_path),
        split=args.split, tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, path_to_cache=args.data_cache_path,
        mmap_bin_files=True)
    cls = _mock_dataset_class() if args.mock_data else GPTDataset
    train, valid, _ = BlendedMegatronDatasetBuilder(cls, [train_samples, valid_samples or None, None],
                                                    lambda: True, config).build()
    if train is None:
        raise ConfigError(f"--split {args.split} leaves no training samples; give the train split a weight")
    return Datasets(train, valid, tokenizer)


MOCK_DOCUMENTS = 1000


def _mock_dataset_class():
    """megatron-core's MockGPTDataset over MOCK_DOCUMENTS of its mock documents instead of its
    hard-coded 100000: indexing those takes 10-30 s per rank on a small CPU machine; the dataset
    repeats epochs to serve any number of samples."""
    from megatron.core.datasets.gpt_dataset import MockGPTDataset, MockGPTLowLevelDataset

    class Documents(MockGPTLowLevelDataset):
        size = MOCK_DOCUMENTS

    class Mock(MockGPTDataset):
        @staticmethod
        def build_low_level_dataset(dataset_path, config):
            return Documents(config.tokenizer)

    return Mock


def microbatches(dataset, first_sample: int, dp_rank: int, micro_batch_size: int,
                 num_microbatches: int) -> List[Dict[str, torch.Tensor]]:
    """This data-parallel rank's microbatches of the global batch that starts at `first_sample`, each a dict
    of [b, s] tensors."""
    start = first_sample + dp_rank * micro_batch_size * num_microbatches
    out = []
    for j in range(num_microbatches):
        first = start + j * micro_batch_size
        samples = [dataset[(first + k) % len(dataset)] for k in range(micro_batch_size)]
        out.append({key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                    for key in ("tokens", "labels", "loss_mask", "position_ids")})
    return out


def iterators(batches: List[Dict[str, torch.Tensor]], chunks: int) -> List[Iterator]:
    """One iterator per model chunk over the same microbatches (each chunk's forward takes what it needs)."""
    return [iter(batches) for _ in range(chunks)]
