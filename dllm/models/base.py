"""The one interface every model family implements (DESIGN §3).

``logits(tokens, positions, attention_mask=, kv=, rows=)`` returns logits *aligned with the canvas*:
row i predicts the token of column i, whatever the family's training convention (Dream's one-position
shift is hidden in its adapter). Positions are explicit so that left padding never moves the RoPE
position of a real token (Dream, SDAR); LLaDA's official code has no position ids and numbers columns
0..L-1 even under left padding, which its adapter reproduces (RoPE is relative and pads are masked out
of attention, so the real tokens' attention is unchanged up to rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from dllm.core.errors import Checks, ModelError, require
from dllm.core.plan import Observer
from dllm.models.attention import FULL, Attention
from dllm.models.layers import ForwardContext, KVStore, execution_device, rope_cos_sin, run_layers, with_weights


class DiffusionLM(nn.Module):
    """A masked-denoising language model: one decoder stack shared by the families (:meth:`hidden`), an LM
    head run only on the columns whose logits are read (:meth:`head`)."""

    family: ClassVar[str]
    attention: ClassVar[Attention] = FULL  # the family's attention kind (dllm.models.attention), set by its registry
    # each registered family's adapter name and the mask token id of its released checkpoints (None: unknown), by
    # family name in registration order: kept by the family registry, named when a model has no mask token id
    published_mask_ids: ClassVar[dict[str, tuple[str, int | None]]] = {}
    # True: a block-causal model whose block size is the decoder's choice (LLaDA2's block_length), so the attention
    # mask takes each generation's block size; False: fixed by training (SDAR), ``block_size`` is the only one
    free_block_size: ClassVar[bool] = False
    # True: a uniform-state model (DiffusionGemma): no mask token, even where its tokenizer has one
    uniform_state: ClassVar[bool] = False

    def __init__(self, config: dict):
        super().__init__()
        self.config = dict(config)
        self.tokenizer = None  # set by dllm.load
        self.name_or_path: str | None = None
        self.block_size: int | None = None
        self.mask_id: int | None = None
        self.pad_id: int | None = None
        self.bos_id: int | None = None
        self.eos_ids: tuple[int, ...] = ()
        self.vocab_size: int = 0
        self.max_length: int = 0
        self.max_new_tokens: int | None = None  # the checkpoint's default generation length, if it ships one
        # the longest prompt and answer (tokens) the model was trained on, from the training.json that
        # python -m dllm.train writes beside a checkpoint (the bundled models'); None: not known
        self.trained_lengths: dict[str, int] | None = None

    def read_token_ids(self, config: dict) -> None:
        """Special token ids from the official config field names (the loader adds the tokenizer's)."""
        self.mask_id = config.get("mask_token_id")
        self.pad_id = config.get("pad_token_id")
        self.bos_id = config.get("bos_token_id")
        eos = config.get("eos_token_id")
        self.eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())

    # -- facts ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the canvas lives and a forward starts: the embedding's execution device when a device map placed
        the model (:func:`dllm.load`'s ``device_map``; its weights may be offloaded), else where the weights are."""
        return execution_device(self.embedding) or next(self.parameters()).device

    def layer_device(self, index: int) -> torch.device:
        """The device decoder layer ``index`` computes on, where its K/V live (:class:`~dllm.models.kv.KVStore`):
        :attr:`device` unless a device map spread the layers over devices."""
        return execution_device(self.decoder[index]) or self.device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def eos_id(self) -> int:
        """The id written after the end of a finished row (the first end-of-sequence id)."""
        if not self.eos_ids:
            raise ModelError(f"{self.family} model has no end-of-sequence token id; set eos_token_id in config.json")
        return self.eos_ids[0]

    @property
    def filler_id(self) -> int:
        """The id laid under the attention mask where a canvas needs padding (left of a short prompt, right of a
        short span): the pad id, else the first EOS id, else the lowest id that is not the mask. A filler
        column is never attended to as a token, so any id serves; a checkpoint whose config names neither a
        pad nor an EOS id (some WeDLM configs) still decodes ragged batches."""
        if self.pad_id is not None:
            return self.pad_id
        if self.eos_ids:
            return self.eos_ids[0]
        return 1 if self.mask_id == 0 else 0

    def prepare(self) -> None:
        """After its weights are loaded on one device (:func:`dllm.load` without a device map): the projections of
        one input fused into one product (each module with a ``fuse()``: q, k and v; gate and up), as views of the
        same parameters (:func:`dllm.models.layers.fuse`). A family with more to prepare extends it. A prepared
        model prepares again when it is moved or cast (:meth:`_apply`)."""
        for module in self.modules():
            if module is not self and callable(getattr(module, "fuse", None)):
                module.fuse()
        self._prepared = True

    def _apply(self, fn, recurse=True):
        """``to`` / ``cuda`` / ``half`` ...: the parameters become new tensors, no longer views of the fused ones,
        so a prepared model prepares again."""
        out = super()._apply(fn, recurse)
        if self.__dict__.get("_prepared"):
            self.prepare()
        return out

    def check_usable(self) -> None:
        """Raise a clear error when the model cannot be sampled from."""
        if self.mask_id is None:
            known = DiffusionLM.published_mask_ids.values()
            published = ", ".join(f"{adapter} {mask_id}" for adapter, mask_id in known if mask_id is not None)
            raise ModelError(
                f"{self.family} model has no mask token id: set 'mask_token_id' in config.json "
                f"({published}) or give the tokenizer a mask_token"
            )
        if self.pad_id is not None and self.pad_id == self.mask_id:
            raise ModelError(
                f"pad token id equals the mask token id ({self.mask_id}): padded prompts would be decoded as "
                "masks. Give the tokenizer a different pad token (e.g. the EOS token)"
            )
        if not 0 <= self.mask_id < self.vocab_size:
            raise ModelError(f"mask token id {self.mask_id} is outside the vocabulary (size {self.vocab_size})")

    def positions(self, valid: torch.Tensor) -> torch.Tensor:
        """Position ids [B, L] for a canvas whose real (non-pad) columns are ``valid``.

        Default: real tokens count from 0 in order, so left padding does not shift them; pads get 0.
        """
        return (valid.long().cumsum(-1) - 1).clamp(min=0)

    # -- forward -------------------------------------------------------------------------------
    # Families provide: ``embedding`` (nn.Embedding), ``decoder`` (the layer stack), ``final_norm``,
    # ``output`` (the LM head: a Linear, or None to reuse the embedding matrix), ``head_dim``, ``rope_theta``.
    shift: ClassVar[int] = 0  # logits of column i are read from the hidden state of column i - shift

    @property
    def rotary_dim(self) -> int:
        """The channels of each head that RoPE rotates (the first ones; all of them unless a family rotates part)."""
        return self.head_dim

    def kv_layout(self) -> tuple[int, int, int]:
        """(layers, K/V heads, head size) of this model's K/V store (:meth:`dllm.models.kv.KVStore.allocate`)."""
        k_proj = next(m for name, m in self.decoder[0].named_modules() if name.rsplit(".", 1)[-1] == "k_proj")
        return len(self.decoder), k_proj.out_features // self.head_dim, self.head_dim

    def attention_mask(self, positions, valid, queries, keys=None, block_size=None) -> torch.Tensor | None:
        """bool [B, 1, R, L], True where a query row may attend a key column; None = everything. block_size: the
        blocks of a block-causal pattern (default: the model's ``block_size``)."""
        if self.attention.attends_everything and keys is None and valid is None:
            return None
        allowed = self.attention.allowed(positions, queries, block_size or self.block_size)
        if valid is not None:
            allowed = allowed & valid[:, None, :]
        if keys is not None:
            allowed = allowed & keys[:, None, :]
        if valid is not None:
            # A pad query row attends to itself, so no row is empty (empty rows give NaN in some SDPA
            # backends); pad rows never influence real ones because pad keys are masked out.
            cols = torch.arange(positions.shape[1], device=positions.device)
            q_cols = cols[None, :, None] if queries is None else queries[:, :, None]
            q_valid = valid[:, :, None] if queries is None else valid.gather(1, queries)[:, :, None]
            allowed = allowed | ((cols[None, None, :] == q_cols) & ~q_valid)
        return allowed[:, None]

    def hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        queries: torch.Tensor | None = None,
        keys: torch.Tensor | None = None,
        kv: KVStore | None = None,
        write: bool | torch.Tensor = True,
        observer: Observer | None = None,
        checks: Checks | None = None,
        mask: torch.Tensor | None = None,
        start_layer: int = 0,
        row_start: torch.Tensor | None = None,
        block_size: int | None = None,
    ) -> Hidden:
        """The decoder body over the canvas columns ``queries`` ([B, R] indices; None = all): their final
        (normed) hidden states, from which :meth:`head` reads logits.

        attention_mask: [B, L] real columns (1) and pads (0). keys: bool [B, L] key columns visible to this
        forward (None: all the model's own mask allows). kv: with ``queries``, the K/V of every other
        visible column are read from this store (an error if it never received them); the fresh K/V of the
        queries are written to it where ``write`` says (True, False or bool [B, R]). checks: collect the
        store check instead of synchronising for it. mask: a bool [B, 1, R, L] attention mask replacing the
        model's own (training objectives with their own patterns). block_size: the blocks of the model's own
        block-causal mask (a model with ``free_block_size``: the generation's; default: the model's ``block_size``).

        start_layer: a forward started at layer ℓ (Elastic-Cache's depth-aware refresh, arXiv 2510.14973):
        the layers below ℓ compute only ``queries`` (none when ``queries`` is None), against the stored K/V
        as above; from layer ℓ on, every column is computed, from the store's kept inputs of layer ℓ
        (``KVStore(inputs=True)``) with the fresh rows of the queries written in, and every column's K/V is
        stored (``write`` must be True). The states returned are every column's. row_start: [B] (with
        ``queries``) each row's own first such layer (>= ``start_layer``): below it the row's other columns
        keep their stored K/V and inputs, and the states returned for a row that never reaches it (``row_start``
        = the number of layers) are its queries' only (padded by repeating its first).
        """
        if start_layer or row_start is not None:
            options = (queries, keys, kv, write, observer, checks, mask, row_start, block_size)
            return self._hidden_from(start_layer, tokens, positions, attention_mask, *options)
        if mask is None:
            valid = None if attention_mask is None else attention_mask.bool()
            mask = self.attention_mask(positions, valid, queries, keys, block_size)
        if queries is not None and kv is not None:
            self._check_store(kv, queries, mask, tokens.shape, checks)
        ctx = ForwardContext(queries, tokens.shape[1], mask, kv, write, observer)
        ids = tokens if queries is None else tokens.gather(1, queries)
        pos = positions if queries is None else positions.gather(1, queries)
        x = self.embedding(ids)
        cos, sin = rope_cos_sin(pos, self.rotary_dim, self.rope_theta)
        # the states on the canvas's device (a device map may have put the last layers elsewhere)
        x = self.final_norm(run_layers(self.decoder, x, cos, sin, ctx)).to(tokens.device)
        if kv is not None:
            kv.mark(tokens.shape[0], tokens.shape[1], queries, write, tokens.device)
        return Hidden(x, queries, tokens.shape[1])

    def _hidden_from(
        self,
        start,
        tokens,
        positions,
        attention_mask,
        queries,
        keys,
        kv,
        write,
        observer,
        checks,
        mask,
        row_start,
        block_size,
    ):
        """:meth:`hidden` started at layer ``start`` (see there): the same decoder loop, in two ranges."""
        if not 0 <= start < len(self.decoder):
            raise ModelError(f"start_layer must be in [0, {len(self.decoder)}) (the decoder's layers), got {start}")
        if kv is None or not kv.keeps_inputs or write is not True or mask is not None:
            raise ModelError(
                "a forward started at a layer needs a KVStore that keeps inputs (KVStore(inputs=True)), "
                "write=True and the model's own attention mask"
            )
        b, length = tokens.shape
        valid = None if attention_mask is None else attention_mask.bool()
        full_mask = self.attention_mask(positions, valid, None, keys, block_size)
        computed = tokens.new_zeros(b, 0) if queries is None else queries
        self._check_store(kv, computed, full_mask, tokens.shape, checks)  # every other column was stored
        if queries is not None:  # the layers below start (if any): the queries only, against the stored K/V
            below = self.attention_mask(positions, valid, queries, keys, block_size)
            ctx = ForwardContext(queries, length, below, kv, True, observer)
            cos, sin = rope_cos_sin(positions.gather(1, queries), self.rotary_dim, self.rope_theta)
            x = run_layers(self.decoder, self.embedding(tokens.gather(1, queries)), cos, sin, ctx, stop=start)
            kv.put_input(start, x, queries, True, length)
        x = kv.inputs[start].clone()  # every column's input of layer start (the queries' fresh rows written in)
        ctx = ForwardContext(None, length, full_mask, kv, True, observer)
        cos, sin = rope_cos_sin(positions, self.rotary_dim, self.rope_theta)
        hold = None
        if row_start is not None and queries is not None:
            hold = (torch.ones_like(tokens, dtype=torch.bool).scatter_(1, queries, False), row_start)
        x = self.final_norm(run_layers(self.decoder, x, cos, sin, ctx, start=start, hold=hold)).to(tokens.device)
        kv.mark(b, length, None, True, tokens.device)
        if hold is None:
            return Hidden(x, None, length)
        every = torch.arange(length, device=tokens.device).expand(b, -1)
        padded = torch.cat([queries, queries[:, :1].expand(-1, length - queries.shape[1])], 1)
        columns = torch.where((row_start < len(self.decoder))[:, None], every, padded)
        return Hidden(x.gather(1, columns[..., None].expand(-1, -1, x.shape[-1])), columns, length)

    def _check_store(self, kv: KVStore, queries, mask, shape, checks: Checks | None) -> None:
        b, length = shape
        seen = torch.ones(b, length, dtype=torch.bool, device=queries.device) if mask is None else mask.any(2)[:, 0]
        computed = torch.zeros_like(seen).scatter_(1, queries, True)
        missing = seen & ~computed
        missing = missing if kv.filled is None else missing & ~kv.filled
        error = ModelError(
            "the forward attends to columns whose K/V were never computed: the cache plan must compute or "
            "store every visible column (a missing K/V is never filled with zeros)"
        )
        require(missing.any(), error, checks)

    def source_columns(self, columns: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        """Columns whose hidden states give the logits of ``columns`` (Dream: the column before). ``first`` [B]: each
        row's first real column, where a row's first column reads itself (as it does without left padding, which
        then changes nothing), not the pad before it."""
        if not self.shift:
            return columns
        source = columns - self.shift
        return source.clamp(min=0) if first is None else torch.maximum(source, first[:, None])

    def computed(self, hidden: Hidden, columns: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor | None:
        """bool [B, K]: whether the forward computed the source of each of ``columns`` (None: it computed
        every column; ``first``: as :meth:`source_columns`)."""
        if hidden.columns is None:
            return None
        return self._rows_of(hidden, self.source_columns(columns, first)) >= 0

    @staticmethod
    def _rows_of(hidden: Hidden, source: torch.Tensor) -> torch.Tensor:
        n, r = hidden.columns.shape
        where = torch.full((n, hidden.length), -1, dtype=torch.long, device=source.device)
        where.scatter_(1, hidden.columns, torch.arange(r, device=source.device).expand(n, -1))
        return where.gather(1, source)

    def head(
        self,
        hidden: Hidden,
        columns: torch.Tensor,
        checks: Checks | None = None,
        strict: bool = True,
        first: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, K, V] of canvas ``columns`` [B, K], aligned: entry (b, k) predicts column
        ``columns[b, k]``. The LM head runs on these K rows only. Every column's source (see
        :meth:`source_columns`, with ``first``) must be among the columns ``hidden`` computed; ``strict=False``:
        the caller discards the logits of the others (see :meth:`computed`), which are placeholders."""
        source = self.source_columns(columns, first)
        if hidden.columns is None:
            index = source
        else:
            index = self._rows_of(hidden, source)
            if strict:
                error = ModelError(
                    "logits were asked for a column the forward did not compute (the cache plan must "
                    "include every scored column, for Dream the column before it)"
                )
                require((index < 0).any(), error, checks)
            index = index.clamp(min=0)
        return self.project(hidden.states.gather(1, index[..., None].expand(-1, -1, hidden.states.shape[-1])))

    def project(self, states: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states [..., d] (no alignment: Dream's shift is :meth:`head`'s business)."""
        if self.output is None:  # tied: the embedding matrix is the head (brought in where it is offloaded)
            embedding = self.embedding
            logits = with_weights(embedding, lambda s: torch.nn.functional.linear(s, embedding.weight), states)
        else:
            logits = self.output(states)
        return logits.to(states.device)  # from the head's device where a device map placed it elsewhere

    def logits(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        kv: KVStore | None = None,
        rows: torch.Tensor | None = None,
        write: bool = True,
        block_size: int | None = None,
    ) -> torch.Tensor:
        """Logits for canvas columns ``rows`` ([B, R] indices; None = all), aligned: row i predicts column i.

        Without ``kv`` the whole canvas is computed. With a ``kv`` store and ``rows``, only ``rows`` (and, for
        shifted families, the columns before them) are computed, the other columns' K/V are read from the
        store and (``write=True``) the fresh K/V are written to it; with a store and no ``rows``, the whole
        canvas is computed and stored. block_size: as :meth:`hidden`'s.
        """
        queries = None
        if kv is not None and rows is not None:
            source = self.source_columns(rows)
            queries = rows if source is rows else torch.cat([source, rows], 1)
        out = self.hidden(
            tokens, positions, attention_mask=attention_mask, queries=queries, kv=kv, write=write, block_size=block_size
        )
        if rows is None:
            rows = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        return self.head(out, rows)

    def forward(self, tokens, positions=None, attention_mask=None):
        """Plain full forward (aligned logits) for convenience; samplers use ``hidden`` and ``head``."""
        if positions is None:
            valid = torch.ones_like(tokens, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
            positions = self.positions(valid)
        return self.logits(tokens, positions, attention_mask=attention_mask)


@dataclass
class Hidden:
    """Final hidden states of the columns a forward computed."""

    states: torch.Tensor  # [B, R, d], on the canvas's device
    columns: torch.Tensor | None  # [B, R] canvas column of each row; None: all columns in order
    length: int  # canvas length L

    def select(self, index: torch.Tensor) -> Hidden:
        """The same for the batch rows ``index``."""
        columns = None if self.columns is None else self.columns.index_select(0, index)
        return Hidden(self.states.index_select(0, index), columns, self.length)
