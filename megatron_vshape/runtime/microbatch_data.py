"""Each microbatch's data goes to its own ops, whatever order a schedule runs them in.

Megatron's `forward_step_func(data_iterator, model)` takes the next item of the chunk's iterator
for the microbatch it runs, so the item a forward op gets follows the op order.  Every generated
schedule runs a stage's forwards in microbatch order, but a hand-edited or solver-made op list
need not: with F1 before F0 on the first stage, microbatch 1 would embed microbatch 0's tokens and
the loss stage would score them against its own labels.  `ByMicrobatch` binds item k of a chunk's
iterator to microbatch k: `for_microbatch(k)` is an iterator whose next() is that item, read from
the underlying iterator in order (items read ahead are kept until their microbatch runs; nothing
is read before a forward asks, so stages that never read data read nothing).
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, Optional


class ByMicrobatch:
    def __init__(self, iterator: Iterator):
        self.iterator, self.read, self.kept = iterator, 0, {}  # type: Iterator, int, Dict[int, Any]

    def for_microbatch(self, k: int) -> "_Item":
        return _Item(self, k)

    def _take(self, k: int):
        while self.read <= k:
            self.kept[self.read] = next(self.iterator)
            self.read += 1
        if k not in self.kept:
            raise RuntimeError(f"microbatch {k}'s data was read twice: one forward per microbatch and chunk "
                               f"reads the data iterator once")
        return self.kept.pop(k)


class _Item:
    """The iterator a forward of microbatch k gets: next() is item k of the chunk's iterator."""

    def __init__(self, source: ByMicrobatch, k: int):
        self.source, self.k = source, k

    def __iter__(self):
        return self

    def __next__(self):
        return self.source._take(self.k)


def bind(iterators: list, shared: bool) -> list:
    """Per chunk, a `ByMicrobatch` over its iterator (None stays None).  `shared`: one iterator
    serves every chunk (the caller passed a single one), whose reads interleave over the chunks
    in op order as megatron-core's own schedules read it: left unbound."""
    if shared and len(iterators) > 1:
        return iterators
    # next() only: Megatron-LM's RerunDataIterator, which train_step passes, has __next__ but no __iter__.
    return [None if it is None else ByMicrobatch(it if hasattr(it, "__next__") else iter(it)) for it in iterators]


def for_op(data, k: int) -> Optional[Iterator]:
    return data.for_microbatch(k) if isinstance(data, ByMicrobatch) else data
