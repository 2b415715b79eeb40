"""Find where code reads device values back on the host: what a CUDA graph cannot capture, and what
stalls a GPU step until the device catches up.

On a GPU, a capture fails on such a read (and torch.cuda.set_sync_debug_mode reports it); on a CPU
nothing is asynchronous, so `HostReads` looks for the reads themselves: the aten operators whose
CUDA kernels copy a value to the host (a scalar read, nonzero and everything built on it, bincount's
size, unique, equal, repeat_interleave without output_size, indexing with a boolean mask), and
Tensor.tolist / numpy / item, which bypass the dispatcher. Reads by Triton's CPU interpreter (it
copies tensors to NumPy to run a kernel) are not the code's own and are not counted.
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.bincount,
    aten.masked_select,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.equal,
    aten.is_nonzero,
    aten.histc,
    aten.argwhere,
}
MASK_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
PYTHON_READS = ("tolist", "numpy", "item")


class HostReads(TorchDispatchMode):
    """with HostReads() as reads: ...  -> reads.found: the names of the reads, in order."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self._saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in READS:
            self.found.append(func.name())
        elif (
            packet is aten.repeat_interleave
            and func is aten.repeat_interleave.Tensor
            and kwargs.get("output_size") is None
        ):
            self.found.append(func.name())
        elif packet in MASK_INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
        ):
            self.found.append(f"{func.name()} (boolean mask)")
        return func(*args, **kwargs)

    def __enter__(self):
        for name in PYTHON_READS:
            self._saved[name] = original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._watch(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def _watch(self, name, original):
        found = self.found

        def read(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith("triton"):
                found.append(f"Tensor.{name}")
            return original(tensor, *args, **kwargs)

        return read
