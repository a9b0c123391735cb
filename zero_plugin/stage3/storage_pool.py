"""Resident memory lent to the unsharded parameters of stage-3 units on the CPU.

[Note: lent storage]
Each parameter's unsharded tensor keeps one storage object for the whole run ([Note: stage-3
parameter storage] in ``param.py``): autograd saved views of it.  Growing that storage from 0 bytes at
each gather and shrinking it back at each release (``resize_``) sends every gather through the host
allocator: on glibc, unit-sized blocks (1-3 MiB at 34M parameters) sit in the heap among the
activations of the same sizes, the released units leave holes the next activations fall into, and the
heap only stays bounded if it is trimmed, whose pages the next gather faults in again
([Note: heap trimming] in ``engines/hostmem.py``).  Measured on ``blocks34m`` (2 ranks): the step peak
sat at the end of backward, ~150 MiB above the end of forward while the bytes in use fell, because
the backward's gathers landed on trimmed pages.

Instead a gather *swaps* memory into the parameter's storage object (``UntypedStorage._swap_data_ptr_``:
the two storage objects exchange their allocations, every view of either stays valid) from a pool of
storages that are allocated once and stay resident, and a release swaps it back into the pool.  Decoder
layers have the same sizes, so after the first step no gather or release touches the allocator; the
heap then holds only what DDP's does (activations, their gradients, temporaries), and needs no trim.

Memory in the pool is memory the allocator cannot give to activations, so the pool keeps a storage only
while it is likely to be lent again soon: one not lent again within ``max_idle_lends`` lends (a few
units' parameters: the embedding, gathered at the start of forward and again at the end of backward) is
dropped (returned to the allocator), and so are the storages freed longest ago beyond ``max_free_bytes``,
so a model whose units all differ in size never keeps more than that bound besides its gathered units.

No pool where another allocator is preloaded (``engines/hostmem.malloc_preloaded``, [Note: host allocator] in
``launch/allocator.py``): tcmalloc and jemalloc reuse unit-sized blocks among the activations themselves, and the
pool's unlent storages only add to the peak (33.7M on tcmalloc, 2 ranks: 610-611 MiB without it, 621-623 with).
"""

from __future__ import annotations

import collections

import torch

__all__ = ["StoragePool", "can_lend_storage"]


def can_lend_storage(device: torch.device) -> bool:
    """Lending applies to host memory only: the CUDA caching allocator reuses blocks itself (and orders
    them across streams, which a swap would bypass)."""
    return torch.device(device).type == "cpu" and hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class StoragePool:
    """Free storages by size; :meth:`lend` fills a storage object, :meth:`take_back` empties it again."""

    def __init__(self, max_free_bytes: int, max_idle_lends: int) -> None:
        self.max_free_bytes = max_free_bytes
        self.max_idle_lends = max_idle_lends
        # id(storage) -> (storage, the lend count when it came back), oldest first
        self._free: collections.OrderedDict[int, tuple[torch.UntypedStorage, int]] = collections.OrderedDict()
        self._free_bytes = 0
        self._lends = 0

    def lend(self, target: torch.UntypedStorage, nbytes: int) -> torch.UntypedStorage:
        """Give the 0-byte ``target`` ``nbytes`` of memory; returns the emptied storage object (the husk),
        which :meth:`take_back` needs."""
        assert target.nbytes() == 0, "lend: the storage already holds memory"
        self._lends += 1
        self._drop_idle()
        source = self._pop(nbytes)
        if source is None:
            source = torch.UntypedStorage(nbytes, device=target.device)
        target._swap_data_ptr_(source)
        return source

    def take_back(self, target: torch.UntypedStorage, husk: torch.UntypedStorage) -> None:
        """Move ``target``'s memory back into ``husk`` and keep it for the next :meth:`lend`."""
        target._swap_data_ptr_(husk)
        self._free[id(husk)] = (husk, self._lends)
        self._free_bytes += husk.nbytes()
        while self._free_bytes > self.max_free_bytes and self._free:
            self._drop_oldest()

    def _drop_idle(self) -> None:
        while self._free and next(iter(self._free.values()))[1] < self._lends - self.max_idle_lends:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, (dropped, _) = self._free.popitem(last=False)
        self._free_bytes -= dropped.nbytes()

    def _pop(self, nbytes: int) -> torch.UntypedStorage | None:
        # Newest first: the storage freed last is the likeliest to be in cache.
        for key in reversed(self._free):
            storage = self._free[key][0]
            if storage.nbytes() == nbytes:
                del self._free[key]
                self._free_bytes -= nbytes
                return storage
        return None

    def clear(self) -> None:
        self._free.clear()
        self._free_bytes = 0

    def held_bytes(self) -> int:
        """Bytes kept and not lent."""
        return self._free_bytes
