"""The one K/V store of a generation (per layer, post-RoPE keys and values of every canvas column).

It owns allocation (every layer's buffer once per run, at the canvas's full size, before the first forward:
:meth:`KVStore.allocate`), in-place writes (:meth:`KVStore.put` for a full forward; the attention writes a
subset of columns in place, :func:`dllm.models.layers.attend`), reads (``k[layer]`` / ``v[layer]``), the
record of which columns were ever written (``filled``), row compaction (:meth:`KVStore.keep`) when
finished rows leave the batch, and scratch copies of some rows and leading columns for a forward of a sampler's
own (:meth:`KVStore.scratch`). Asked for (``KVStore(inputs=True)``, Elastic-Cache's depth-aware refresh), it
also keeps each layer's input hidden state for the columns it stores (``inputs[layer]``), so that a forward
can start at layer ℓ (:meth:`dllm.models.base.DiffusionLM.hidden`'s ``start_layer``); other stores pay nothing.
A cache's per-run state holds one (``dllm.caches.base.CacheState.kv``) and
drops it when the run ends.
"""

from __future__ import annotations

import torch


class KVStore:
    """Per-layer post-RoPE keys and values for every canvas column, addressed by column.

    ``k[layer]`` / ``v[layer]`` have shape [B, H_kv, L, D]; ``filled`` [B, L] marks the columns whose
    K/V were ever written. A forward that computes a subset of columns (``queries``) attends to the
    stored K/V of every other visible column and to the fresh K/V of its own; the fresh K/V of the
    columns chosen by ``write`` are stored in place. Which stored entries are stale is the business of
    the cache scheme that drives the store, not of the store; reading a column never written is an error.

    Devices: each layer's buffers live on the device the layer computes on (``model.layer_device``: the model's,
    or where a device map put the layer), ``filled`` on the canvas's.

    Memory: each layer's buffer is allocated once per run, at its final size, before the first forward
    (:meth:`allocate`; a store used without it allocates a layer's buffer at its first forward); forwards write
    into it in place, and when rows leave the batch (:meth:`keep`) the kept rows move to the front of the same
    buffer, which is then used through a view (no reallocation, no copy of the whole store).
    """

    def __init__(self, inputs: bool = False):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.filled: torch.Tensor | None = None
        self.keeps_inputs = inputs
        self.inputs: dict[int, torch.Tensor] = {}  # layer -> [B, L, d] the layer's input (only with inputs=True)
        self._bases: list = []  # (store, layer, buffer) of every buffer allocate() made, with its spare rows
        self._filled: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.k)

    def allocate(self, model, batch: int, length: int, capacity: int | None = None) -> KVStore:
        """Every layer's buffer at its final size (``batch`` rows, ``length`` columns: the canvas), zeros never
        read (the model checks that a forward reads only written columns), before the run's first forward; so
        no forward allocates, and a compiled forward sees the same store layout at every step. ``capacity``: rows
        the buffers hold beyond ``batch`` for rows that join later (:meth:`extend`), unused until then."""
        layers, heads, dim = model.kv_layout()
        rows = max(batch, capacity or 0)
        for layer in range(layers):
            device = model.layer_device(layer)  # each layer's K/V where it computes (a device map spreads them)
            for store in (self.k, self.v):
                store[layer] = torch.zeros(rows, heads, length, dim, dtype=model.dtype, device=device)
            if self.keeps_inputs:
                width = model.embedding.weight.shape[1]
                self.inputs[layer] = torch.zeros(rows, length, width, dtype=model.dtype, device=device)
        self.filled = torch.zeros(rows, length, dtype=torch.bool, device=model.device)
        self._bases = [(store, layer, t) for store in (self.k, self.v, self.inputs) for layer, t in store.items()]
        self._filled = self.filled
        if rows > batch:
            self._view(batch)
        return self

    def _view(self, n: int) -> None:
        """The store continues on the first ``n`` rows of its buffers."""
        for store, layer, base in self._bases:
            store[layer] = base[:n]
        self.filled = self._filled[:n]

    def keep(self, batch_index: torch.Tensor) -> None:
        """Keep only the batch rows ``batch_index`` (ascending), in place: each kept row moves to the front
        of its buffer and the store continues on a view of the first rows."""
        moves = [(j, i) for j, i in enumerate(batch_index.tolist()) if i != j]
        n = batch_index.shape[0]
        for store in (self.k, self.v, self.inputs):
            for layer, t in store.items():
                for j, i in moves:  # j < i: ascending moves never overwrite a row still to be moved
                    t[j].copy_(t[i])
                store[layer] = t[:n]
        if self.filled is not None:
            for j, i in moves:
                self.filled[j].copy_(self.filled[i])
            self.filled = self.filled[:n]

    def extend(self, rows: int) -> None:
        """``rows`` more rows after the store's (rows that join the run: none of their columns written), in the
        buffers' spare rows (:meth:`allocate`'s ``capacity``) where they hold them, else in new buffers."""
        n = 0 if self.filled is None else self.filled.shape[0]
        bases = self._bases
        spare = bool(bases) and all(
            base.shape[0] >= n + rows and store[layer].data_ptr() == base.data_ptr() for store, layer, base in bases
        )
        if spare and self._filled.shape[0] >= n + rows and self.filled.data_ptr() == self._filled.data_ptr():
            self._view(n + rows)
            self.filled[n:].fill_(False)
            return
        for store in (self.k, self.v, self.inputs):
            for layer, t in store.items():
                store[layer] = torch.cat([t, t.new_zeros(rows, *t.shape[1:])])
        if self.filled is not None:
            self.filled = torch.cat([self.filled, self.filled.new_zeros(rows, self.filled.shape[1])])
        self._bases = [(store, layer, t) for store in (self.k, self.v, self.inputs) for layer, t in store.items()]
        self._filled = self.filled

    def scratch(self, rows: torch.Tensor, width: int, extra: int) -> KVStore:
        """A new store for a forward of its own (a verifier's): the first ``width`` columns of the rows ``rows`` of
        this one, copied, and ``extra`` blank, never written columns after them; this store is left as it is."""
        out = KVStore()
        for mine, theirs in ((self.k, out.k), (self.v, out.v)):
            for layer, t in mine.items():
                t = t.index_select(0, rows.to(t.device))[:, :, :width]
                theirs[layer] = torch.cat([t, t.new_zeros(*t.shape[:2], extra, t.shape[3])], 2)
        filled = self.filled.index_select(0, rows)[:, :width]
        out.filled = torch.cat([filled, filled.new_zeros(filled.shape[0], extra)], 1)
        return out

    def buffers(self, layer: int, k: torch.Tensor, v: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K/V of ``layer``, allocated here (zeros, never read: the model checks that a forward reads
        only written columns) at the canvas width ``length`` when the layer has none yet; ``k``, ``v``
        [B, H_kv, R, D] give batch, heads, head size, dtype and device."""
        if layer not in self.k:
            b, h, _, d = k.shape
            self.k[layer], self.v[layer] = k.new_zeros(b, h, length, d), v.new_zeros(b, h, length, d)
        return self.k[layer], self.v[layer]

    def put(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store every column's K/V of ``layer`` (a full forward), in the existing buffer when there is one."""
        stored = self.k.get(layer)
        if stored is not None and stored.shape == k.shape and stored.dtype == k.dtype:
            stored.copy_(k)
            self.v[layer].copy_(v)
        else:
            self.k[layer], self.v[layer] = k, v

    def put_input(self, layer: int, x: torch.Tensor, queries: torch.Tensor | None, write, length: int) -> None:
        """Keep the input hidden states ``x`` [B, R, d] of ``layer`` for the columns ``queries`` ([B, R]; None:
        every column, R = L) where ``write`` says (True, False or bool [B, R]); a no-op unless the store keeps
        inputs. The buffer is allocated here (zeros) when the layer has none yet."""
        if not self.keeps_inputs or write is False:
            return
        stored = self.inputs.get(layer)
        if stored is None or stored.dtype != x.dtype:
            stored = self.inputs[layer] = x.new_zeros(x.shape[0], length, x.shape[2])
        if stored.device != x.device:  # the layer's buffer lives on its device (a model spread by a device map)
            x, queries, write = (t.to(stored.device) if isinstance(t, torch.Tensor) else t for t in (x, queries, write))
        if queries is None:
            stored.copy_(x)
            return
        index = queries[..., None].expand(-1, -1, x.shape[2])
        if write is not True:  # rows not kept keep their stored input
            x = torch.where(write[..., None], x, stored.gather(1, index))
        stored.scatter_(1, index, x)

    def mark(self, batch: int, length: int, queries: torch.Tensor | None, write, device) -> None:
        """Record that a forward wrote the K/V of ``queries`` (None: every column) where ``write`` says."""
        if self.filled is None:
            self.filled = torch.zeros(batch, length, dtype=torch.bool, device=device)
        if write is False:
            return
        if queries is None:
            self.filled.fill_(True)
        else:
            written = torch.ones_like(queries, dtype=torch.bool) if write is True else write
            self.filled.scatter_(1, queries, written | self.filled.gather(1, queries))
