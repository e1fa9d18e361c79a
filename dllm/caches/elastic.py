"""Elastic-Cache ("Attention Is All You Need for KV Cache in Diffusion LLMs",
arXiv 2510.14973), reconstructed from the paper: no official code was available. EXPERIMENTAL.
Measurements: ``eval/results/caches/README.md``."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from dllm.caches.base import Cache, CacheState, Plan, columns_of, sources
from dllm.core.params import hp
from dllm.models.kv import KVStore
from dllm.models.layers import Observer


@dataclasses.dataclass(eq=False)
class _State(CacheState):
    """One generation's state. Per-row tensors [B, ...] have the canvas's rows; the per-layer tensors
    (``q``, ``reference``) have the working rows of the last step (they shrink when rows finish:
    :meth:`Elastic.keep`)."""

    layers: int = 0  # the model's decoder layers
    full: torch.Tensor = None  # [B] the row's next forward recomputes every column
    planned_full: torch.Tensor = None  # [B] the row's last forward was a refresh
    recent: torch.Tensor = None  # bool [B, L] committed at the row's last step
    tracked: torch.Tensor = None  # [B, layers] the most-attended decoded column per layer (the drift probe)
    trigger: torch.Tensor = None  # [B] first layer whose drift passed gamma at the row's last step (-1: none):
    # the row's next forward recomputes every column from there
    probed: torch.Tensor = None  # [B] the row has a reference row (it took a step with the probe)
    tracked_of_active: torch.Tensor | None = None  # [n, layers] the probes of this forward's rows
    q: dict = dataclasses.field(default_factory=dict)  # layer -> [n, H, L, D] queries as last computed
    reference: dict = dataclasses.field(default_factory=dict)  # layer -> [n, H, L] the probe's attention row
    pending: dict = dataclasses.field(default_factory=dict)  # layer -> (drift, tracked, reference) of this forward


class _Probe(Observer):
    """Per layer: the tracked column's attention row now against the one kept from the row's last step
    (drift = 1 - cosine similarity, mean over heads), and the next tracked column: the decoded column that
    the window's masks attend most (summed over heads and window queries)."""

    def __init__(self, state, columns, window, visible, decoded, window_valid=None, start=None):
        self.state, self.columns, self.window = state, columns, window
        self.start = start  # layers from here compute every column (a depth-aware refresh; None: no such layer)
        self.window_valid = window_valid  # bool [n, C]: window entries that are not padding (repeats)
        self.visible, self.decoded = visible, decoded  # bool [n, L] key columns; decoded columns

    def attention(self, index, q, keys, mask):
        state = self.state
        n, heads, _, dim = q.shape
        stored = state.q.get(index)
        every = self.columns is None or (self.start is not None and index >= self.start)
        if every or stored is None:
            stored = q if every else q.new_zeros(n, heads, keys.shape[2], dim)
        else:
            stored = stored.scatter(2, self.columns[:, None, :, None].expand(-1, heads, -1, dim), q)
        state.q[index] = stored
        keys = keys.float() if keys.shape[1] == heads else keys.float().repeat_interleave(heads // keys.shape[1], 1)

        def rows(columns):  # attention rows [n, H, C, L] of the columns [n, C]
            qc = stored.gather(2, columns[:, None, :, None].expand(-1, heads, -1, dim)).float()
            scores = (qc @ keys.transpose(-1, -2)) / math.sqrt(dim)
            return torch.softmax(scores.masked_fill(~self.visible[:, None, None, :], float("-inf")), -1)

        now = rows(state.tracked_of_active[:, index, None])[:, :, 0]
        before = state.reference.get(index)
        if before is None:
            drift = torch.zeros(n, device=q.device)
        else:
            drift = 1 - torch.nn.functional.cosine_similarity(now, before, dim=-1).mean(1)
        window_rows = rows(self.window)
        if self.window_valid is not None:  # a padded (repeated) window entry must not weigh twice
            window_rows = window_rows * self.window_valid[:, None, :, None]
        attended = window_rows.sum((1, 2)).masked_fill(~self.decoded, float("-inf"))
        tracked = attended.argmax(1)
        state.pending[index] = (drift, tracked, rows(tracked[:, None])[:, :, 0])


@dataclasses.dataclass(frozen=True)
class Elastic(Cache):
    """Elastic-Cache (arXiv 2510.14973), reconstructed from the paper; EXPERIMENTAL (no official code).

    A refresh (a full forward storing every column's K/V) starts the generation. Between refreshes a step
    computes only the *sliding window*, the leftmost ``window`` masks of the row (its masked tail beyond
    stays as stored: distant masks are "block-cached"), the tokens committed at the last step, and the
    tracked tokens; they attend to every column (stored K/V for the others) and write their fresh K/V back.
    The sampler commits only among the window's masks. At every forward and layer the cache measures the
    drift of the *most-attended decoded token* (chosen per layer at the previous step as the decoded column
    that the window's masks attend most): drift = 1 - cosine similarity of its attention rows at the two
    steps, averaged over heads. When some layer's drift exceeds ``gamma`` the row's next forward is a
    refresh; ``trigger`` records the first such layer ℓ (the paper's depth boundary). The refresh is
    depth-aware: below ℓ the row computes only its step's columns (the other columns keep their stored K/V);
    from ℓ on it recomputes every column, from each column's input of layer ℓ kept by the K/V store
    (``KVStore(inputs=True)``) with the fresh rows written in, and stores every column's K/V
    (:meth:`dllm.models.base.DiffusionLM.hidden`'s ``start_layer`` / ``row_start``). The first forward of a
    generation recomputes every layer. (How many layers the depth-aware refresh saves on the bundled models:
    ``eval/results/caches/README.md``.)

    gamma: drift threshold in [0, 1]: a drift above it triggers the refresh (the paper refreshes when the
        similarity falls below its threshold, 0.9 by default: ``gamma=0.1``, the default here). ``gamma=0``
        refreshes at every step (exactly the no-cache output); ``gamma=1`` never after the first forward.
    window: the sliding window's size in masks (the paper's beta, default 16).

    Deliberate differences from the paper (experimental reconstruction):
    - the refresh is decided at a step and taken at the row's next forward, from the first drifting layer ℓ
      itself: the paper switches within the same forward (the drift is seen at layer ℓ, whose reuse-mode pass
      is then done) and recomputes the layers after it;
    - batched: one forward starts at the lowest ℓ of its refreshing rows; between that layer and a row's own
      ℓ (or every layer from there, for a row not refreshing) the row's other columns are computed too but
      keep their stored K/V and inputs, so each row gets its own refresh (the compute saved is the
      forward's lowest ℓ);
    - batched, per row: each row keeps its own refresh state (rows refreshing and rows reusing share one
      forward); rows with nothing scheduled at a step do not update their state;
    - when a fixed-schedule step must commit more than ``window`` tokens the window grows to the quota;
    - for Dream the column before each window mask is computed too.
    """

    name: ClassVar[str] = "elastic"
    computes_needed: ClassVar[bool] = False  # its own window of masks only (see Cache)
    experimental: ClassVar[bool] = True
    gamma: float = hp(0.1, "[0, 1]", note="a drift threshold; 0 refreshes every step")
    window: int = hp(16, ">= 1", note="masks")

    @classmethod
    def every_step(cls):
        return cls(gamma=0)  # a refresh at every step

    def start(self, run):
        tokens = run.canvas.tokens
        b, device = tokens.shape[0], tokens.device
        flags = torch.zeros(b, dtype=torch.bool, device=device)
        layers = run.model.kv_layout()[0]
        return _State(
            layers=layers,
            full=~flags,
            planned_full=flags.clone(),
            recent=torch.zeros(tokens.shape, dtype=torch.bool, device=device),
            tracked=torch.full((b, layers), run.canvas.prompt_width - 1, dtype=torch.long, device=device),
            trigger=torch.full((b,), -1, dtype=torch.long, device=device),
            probed=flags.clone(),
            kv=KVStore(inputs=self.gamma > 0),  # each layer's input too: a refresh starts at the drifting layer
        )

    def keep(self, state, index, store=True):
        super().keep(state, index, store)
        state.q = {i: t.index_select(0, index) for i, t in state.q.items()}
        state.reference = {i: t.index_select(0, index) for i, t in state.reference.items()}

    def plan(self, step, state):
        canvas = step.canvas
        full = step.of_active(state.full)
        if self.gamma == 0:  # a refresh at every step by definition: no probe needed
            return Plan(refresh=True)
        masked = step.of_active(step.masked)
        rank = masked.long().cumsum(1) - 1
        width = torch.full_like(rank[:, 0], self.window)
        if step.quota is not None:
            width = torch.maximum(width, step.of_active(step.quota))
        first = masked & (rank < width[:, None])
        tracked = step.of_active(state.tracked)
        active = first | step.of_active(state.recent)
        active.scatter_(1, tracked, True)
        active |= sources(step, first)  # (Dream: the column before each window mask gives its logits)
        # a refreshing row recomputes from its first drifting layer (all layers at the first forward, trigger -1);
        # the forward starts at the lowest such layer of its rows (each row's own from there: ``row_start``)
        depth = torch.where(full, step.of_active(state.trigger).clamp(min=0), state.layers)
        deep = (full & (depth > 0)).any()
        active |= full[:, None] & ~deep
        counts, windows = active.sum(1), first.sum(1).clamp(min=1)
        all_full, any_full, most, most_window, deep, start = torch.stack(
            [full.all() & ~deep, full.any(), counts.max(), windows.max(), deep, depth.min()]
        ).tolist()
        state.planned_full = torch.zeros_like(state.planned_full).index_copy_(0, step.active, full)
        state.tracked_of_active = tracked
        visible = step.of_active(canvas.valid)
        window = columns_of(first | ~first.any(1, keepdim=True), windows, most_window)  # rows without masks: any
        queries = None if all_full else columns_of(active, counts, most)
        window_valid = torch.arange(window.shape[1], device=window.device) < windows[:, None]
        probe = _Probe(state, queries, window, visible, visible & ~masked, window_valid, start if deep else None)
        if all_full:
            return Plan(refresh=True, observer=probe)
        commit = first | full[:, None]
        if not deep:
            return Plan(queries=queries, commit=commit, refresh=bool(any_full), observer=probe)
        return Plan(queries=queries, commit=commit, refresh=True, observer=probe, start_layer=start, row_start=depth)

    def update(self, step, state, committed):
        ran = torch.zeros_like(state.full).index_fill_(0, step.active, True)
        if step.quota is not None:  # nothing scheduled: no forward of its own, no change
            ran &= step.quota > 0
        if not state.pending:  # gamma = 0: no probe
            state.recent = torch.where(ran[:, None], committed, state.recent)
            return
        ran_active = ran.index_select(0, step.active)
        layers = sorted(state.pending)
        drift = torch.stack([state.pending[i][0] for i in layers], 1)  # [n, layers]
        tracked = torch.stack([state.pending[i][1] for i in layers], 1)
        for i in layers:
            new = state.pending[i][2]
            old = state.reference.get(i, torch.zeros_like(new))
            state.reference[i] = torch.where(ran_active[:, None, None], new, old)
        passed = (drift > self.gamma) & step.of_active(state.probed)[:, None]  # no drift without a reference
        state.probed |= ran
        trigger = torch.where(passed.any(1), passed.long().argmax(1), -1)
        scatter = torch.zeros_like(state.trigger).index_copy_(0, step.active, trigger)
        state.trigger = torch.where(ran, scatter, state.trigger)
        refresh = torch.zeros_like(state.full).index_copy_(0, step.active, passed.any(1))
        state.full = torch.where(ran, refresh, state.full)
        track = torch.zeros_like(state.tracked).index_copy_(0, step.active, tracked)
        state.tracked = torch.where(ran[:, None], track, state.tracked)
        state.recent = torch.where(ran[:, None], committed, state.recent)
        state.pending = {}
