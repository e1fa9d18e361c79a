"""Counting the host's reads of device memory: every place where Python waits for a tensor's values.

On CUDA each of these is a device-to-host copy that synchronises the stream: the host waits for every kernel
enqueued so far, then the device waits for the host's next launch. The count is the same on any device, so a
CPU test can hold a decoding loop to a budget of reads (the device-step issue's contract: at most one per
forward on the static-shape path) that a GPU then profits from.

:class:`HostReads` counts two kinds, once each:

- a Python-level read of values (a :class:`~torch.overrides.TorchFunctionMode`): ``item``, ``tolist``,
  ``numpy``, ``bool(t)``, ``int(t)``, ``float(t)``, ``t.__index__()`` (a tensor used as a Python index);
- an operation whose output's shape depends on the values (a :class:`~torch.utils._python_dispatch.
  TorchDispatchMode`): ``nonzero``, ``masked_select``, ``unique``, indexing with or into a boolean mask,
  ``repeat_interleave`` without an output size, ``equal``, and a scalar read that reached ATen by another path
  (``_local_scalar_dense``).

It also counts, apart (``copies``, ``copied``), the other way: Python data made into a tensor (``torch.tensor`` /
``torch.as_tensor`` of a list or a number, a tensor indexed with a Python list, a Python number put at tensor
indices: ``t[rows, columns] = True``). On CUDA each is a copy from
pageable host memory, which ``torch.cuda.set_sync_debug_mode("error")`` reports as synchronising (an H200 run found
one inside the device step that the reads alone did not show).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Python-level reads of a tensor's values
_READ_METHODS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}
# ATen operations that read the device's values (their output shape, or a Python scalar, depends on them)
_READ_OPS = {
    "aten._local_scalar_dense",
    "aten.is_nonzero",
    "aten.item",
    "aten.nonzero",
    "aten.nonzero_static",  # (not a read: a static size; listed so that it is never mistaken for one below)
    "aten.masked_select",
    "aten._unique",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.equal",
}
_NOT_READS = {"aten.nonzero_static"}
_INDEXED = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"}  # reads with a bool index
# Python data made into a tensor: a host-to-device copy on CUDA
_FACTORIES = {torch.tensor, torch.as_tensor}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


class HostReads:
    """A context manager counting host reads (see the module docstring); ``count`` is the total, ``where`` the
    count of each kind (``"item"``, ``"tolist"``, ``"aten.nonzero"``, ...), so that a failing budget says what
    read."""

    def __init__(self):
        self.count = 0
        self.where: dict[str, int] = {}
        self.copies = 0  # Python data made into tensors (see the module docstring)
        self.copied: dict[str, int] = {}
        self._depth = 0  # inside a counted Python-level read: its own ATen read is not counted again
        self._stack = contextlib.ExitStack()

    def _add(self, kind: str) -> None:
        self.count += 1
        self.where[kind] = self.where.get(kind, 0) + 1

    def _copy(self, kind: str) -> None:
        self.copies += 1
        self.copied[kind] = self.copied.get(kind, 0) + 1

    def __enter__(self) -> HostReads:
        self._stack.enter_context(_Dispatch(self))
        self._stack.enter_context(_Functions(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


class _Functions(TorchFunctionMode):
    def __init__(self, counter: HostReads):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and args and not isinstance(args[0], torch.Tensor):
            self.counter._copy(f"torch.{func.__name__} of Python data")
        elif func in _INDEXING and len(args) > 1 and _python_index(args[1]):
            self.counter._copy("an index from a Python list")
        elif func is torch.Tensor.__setitem__ and len(args) > 2 and _scalar_put(args[1], args[2]):
            self.counter._copy("a Python number put at tensor indices")
        if func not in _READ_METHODS or self.counter._depth:
            return func(*args, **kwargs)
        self.counter._add(func.__name__.strip("_"))
        self.counter._depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.counter._depth -= 1


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: HostReads):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if not self.counter._depth:
            if name in _READ_OPS and name not in _NOT_READS:
                self.counter._add(name)
            elif name in _INDEXED and _bool_index(args):
                self.counter._add(f"{name} (boolean mask)")
            elif (
                name == "aten.repeat_interleave" and (kwargs or {}).get("output_size") is None and _tensor_repeats(args)
            ):
                self.counter._add(name)
        return func(*args, **(kwargs or {}))


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _tensor_repeats(args) -> bool:
    return len(args) > 0 and isinstance(args[0], torch.Tensor) and (len(args) == 1 or isinstance(args[1], torch.Tensor))


def _scalar_put(index, value) -> bool:
    """Whether ``t[index] = value`` puts a Python number at tensor indices: ``index_put_`` with the number made into
    a host tensor and copied (``t[mask] = value`` with one boolean mask is ``masked_fill_``, which copies nothing)."""
    if isinstance(value, torch.Tensor):
        return False
    parts = index if isinstance(index, tuple) else (index,)
    tensors = [part for part in parts if isinstance(part, torch.Tensor)]
    return bool(tensors) and not (len(parts) == 1 and tensors[0].dtype == torch.bool)


def _python_index(index) -> bool:
    """Whether an index holds a Python list (of ints or bools): made into a tensor, copied to the device."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, list) for part in parts)
