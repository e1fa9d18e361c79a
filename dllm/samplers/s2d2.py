"""S2D2: training-free self-speculative decoding on block-diffusion models (Han, Wang, Gao, Xu, Srivastava,
arXiv 2603.25702), the SDAR variant: ``block_diffusion_generate`` of phymhan/S2D2 ``SDAR/generate_ssd_policy.py``."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
from dllm.core.params import hp
from dllm.core.rng import Stream
from dllm.engine.step import NO_OVERRIDE, Decision
from dllm.kernels.reference import ScoreSpec, gumbel_argmax, top_k_per_row
from dllm.samplers.sdar import SDAR, STRATEGIES

POLICIES = ("mask_span_length", "score_threshold", "score_hysteresis", "contextual_bandit_ucb")
ESTIMATORS = (
    "hard_margin_threshold",
    "hard_entropy_threshold",
    "soft_confidence_power",
    "soft_clipped_linear_margin",
    "soft_entropy_negexp",
    "soft_renyi_2_entropy",
)
SCORE_TYPES = ("difference_dynamic", "difference_static")
ENTROPY_SOURCES = ("span", "masked")


MAX_UCB_BUCKETS = 1 << 16  # contextual-bandit buckets per row: far beyond any useful context, bounded memory


@dataclasses.dataclass
class S2D2State:
    """Per-row state of one generation (B rows, L columns)."""

    causal: torch.Tensor  # bool [B, L]: columns whose K/V are computed token-causally (cache_ver / draft_ver)
    first: torch.Tensor  # [B] offset of the block's first mask at the row's last drafting forward (draft_ver)
    is_on: torch.Tensor  # bool [B]: the hysteresis switch, kept across blocks
    ucb_count: torch.Tensor  # float64 [B, 2, buckets]: decisions per (action: 0 skip / 1 verify, bucket)
    ucb_reward: torch.Tensor  # float64 [B, 2, buckets]: summed rewards
    ucb_t: torch.Tensor  # [B] decisions taken
    verified: torch.Tensor  # bool [B]: the rows the last step's verifier forward served


@dataclasses.dataclass(frozen=True)
class S2D2(SDAR):
    """S2D2 self-speculative decoding on SDAR (phymhan/S2D2 ``SDAR/generate_ssd_policy.py``, arXiv 2603.25702).

    Each step of a block drafts the block by one diffusion forward (as ``sdar``), then, when the routing
    policy says so, the same model verifies the first contiguous run of masks (the span) autoregressively:
    one more forward over ``[the block with every mask replaced by its draft | block_size mask tokens]``,
    both halves at the block's positions, the first half token-causal, mask ``i`` of the second half seeing
    the drafts before ``i`` and itself (the official "2L" verifier mask), so its logits are the block-size-1
    conditional of slot ``i``. Drafts are accepted left to right with probability ``min(1, (q/p) **
    ssd_ratio_tempering_factor)``; the first rejected slot is committed too, resampled from ``(q - p)+``
    (``allow_resample``; else its draft). When fewer than the step's ``n_i`` tokens were committed, the SDAR
    strategy commits the rest among the remaining masks (``remasking_strategy``, ``confidence_threshold``).
    NFE counts drafting and verifier forwards.

    Temperature 0 decodes greedily: drafts are the argmax, a draft is accepted iff it equals the verifier's
    argmax (or ``ssd_ratio_tempering_factor`` is 0, whose ratio is always 1) and the first mismatch commits the
    verifier's argmax (or the draft with ``allow_resample=False``); no random numbers are drawn. The ratio that
    ``ssd_ratio_threshold`` compares stays the official soft one, min(1, (q(x) / p(x)) ** gamma) with q the
    verifier's temperature-1 float32 softmax at the draft x and p the draft's probability clamped at 1e-12, as
    the official computes it at temperature 0 too. (The official ``do_sample=False`` path accepts with
    ``torch.rand < ratio`` on that soft ratio and resamples from ``(q - p)+``; greedy acceptance and resampling
    are our deliberate difference. The parity fixtures record the official code with only its coins and its
    residual resample made greedy, the verifier's logits unchanged: tests/test_parity_s2d2.py.) At temperature
    > 0, drafts and the verifier's distribution use the same temperature / ``top_k`` / ``top_p`` transform as
    the official, and the acceptance coins and residual
    resamples come from per-row counter-based streams (``Stream.ACCEPT``, ``Stream.RESAMPLE``).

    Routing (``do_verify_policy``; estimators of the per-token acceptance ``alpha_i`` from the draft
    distribution, expected accepted length ``E[K] = sum_k prod_{i<=k} alpha_i`` over the span):
    ``"mask_span_length"`` verifies iff the span has >= ``min_ssd_span_length`` masks
    (``legacy_ssd_span_strategy``: a short span still verifies unless enough masks are above the threshold);
    ``"score_threshold"`` iff score >= ``do_verify_score_threshold``; ``"score_hysteresis"`` switches on
    when score > ``hysteresis_threshold_on`` and off when score < ``hysteresis_threshold_off`` (the switch
    lives across blocks); ``"contextual_bandit_ucb"``: UCB1 (``ucb_beta``) over skip / verify per context
    bucket (span length, block progress, mean normalised entropy of ``ucb_entropy_source``; ``ucb_*_bins``
    bins each), rewarded by tokens committed per forward. score = ``E[K] - score_penalty_coef * N`` with
    ``N`` = masks above ``confidence_threshold`` (``"difference_dynamic"``) or 1 (``"difference_static"``).
    ``token_acceptance_estimator`` and its ``ssd_*`` parameters as the official. ``ssd_ratio_threshold``
    >= 0 also commits span slots (all masks of the block with ``ssd_threshold_all_spans``) whose ratio
    reaches it; ``always_check_high_confidence`` also commits masks above ``confidence_threshold``.

    ``cache_ver`` ("AR-like caching"): the K/V of the prompt and of every finished block are computed
    token-causally, as the verifier sees them. ``draft_ver``: while drafting, the block's columns before its
    first mask are token-causal (and, without ``cache_ver``, stay so when the block's K/V are stored: the
    official edits the block's mask rows in place and its store forward reads them).

    Defaults as the official function (policy ``mask_span_length`` with span 1, i.e. verify at every step).
    Deliberate differences from the official code:
    - batched (the official asserts batch size 1): routing, verification, acceptance and the fallback are
      per row; rows accept different numbers of drafts; the verifier runs on the rows that verify, with
      their own positions, masks and K/V; a row's output does not depend on its batch;
    - the finished block's K/V are stored by the next block's first forward (the ``sdar`` block cache),
      not by an extra forward per block and a prefill forward: NFE = drafting + verifier forwards, the
      official ``total_forward_steps`` minus its prefill and per-block store forwards;
    - the mask token is never proposed (its logit is -inf, in the verifier too); ``n_i`` is capped by the
      masks left (as the official S2D2 does); ties in top-k go to the leftmost slot;
    - at temperature 0 ``top_k`` / ``top_p`` are not applied (the official's ``temperature=0`` path);
    - ``steps_per_block`` may not exceed ``block_size`` (the official then has steps with ``n_i = 0`` that can
      leave masks and fail).
    Not implemented (a ConfigError says so): ``remasking_strategy="entropy_bounded"`` (the official's
    "entropy" is one scalar per block, summed over the drafts' probabilities: research/samplers_b.md §3.4).
    """

    name: ClassVar[str] = "s2d2"
    per_row_temperatures: ClassVar[bool] = False  # its verifier's acceptance ratio takes another form when greedy
    remasking_strategy: str = hp(
        "low_confidence_dynamic",
        choices=STRATEGIES,
        note="the official 'entropy_bounded' is not implemented: it computes one scalar entropy per block",
    )
    cache_ver: bool = False
    draft_ver: bool = False
    min_ssd_span_length: int = 1
    ssd_ratio_tempering_factor: float = hp(1.0, ">= 0", note="1 is plain speculative sampling")
    ssd_ratio_threshold: float | None = hp(-1.0, note="< 0 or None: off")
    ssd_threshold_all_spans: bool = False
    always_check_high_confidence: bool = False
    legacy_ssd_span_strategy: bool = False
    allow_resample: bool = True
    do_verify_policy: str = hp("mask_span_length", choices=POLICIES)
    do_verify_score_threshold: float = -1.0
    hysteresis_threshold_on: float = 0.0
    hysteresis_threshold_off: float = -1.0
    token_acceptance_estimator: str = hp("hard_margin_threshold", choices=ESTIMATORS)
    ssd_confidence_margin_threshold: float = 0.05
    ssd_confidence_power: float = hp(1.0, ">= 0", note="the acceptance estimate is p ** power")
    ssd_entropy_threshold: float = 0.5
    ssd_confidence_margin_coef: float = 1.0
    ssd_entropy_temperature: float = hp(1.0, ">= 0", note="the acceptance estimate is exp(-temperature * entropy)")
    ucb_beta: float = hp(1.0, ">= 0")
    ucb_span_length_bins: int = hp(2, note="the official default")
    ucb_block_progress_bins: int = hp(2, note="the official default")
    ucb_entropy_bins: int = hp(2, note="the official default")
    ucb_entropy_source: str = hp("span", choices=ENTROPY_SOURCES)
    do_verify_score_type: str = hp("difference_dynamic", choices=SCORE_TYPES)
    score_penalty_coef: float = 2.0
    eb_threshold: float | None = None  # the official's entropy_bounded parameter (that strategy is not implemented)

    def check_hyper_parameters(self):
        if self.do_verify_policy == "score_hysteresis" and not (
            self.hysteresis_threshold_on > self.hysteresis_threshold_off
        ):
            raise ConfigError(
                f"hysteresis_threshold_on ({self.hysteresis_threshold_on}) must be greater than "
                f"hysteresis_threshold_off ({self.hysteresis_threshold_off})"
            )
        bins = {k: getattr(self, k) for k in ("ucb_span_length_bins", "ucb_block_progress_bins", "ucb_entropy_bins")}
        buckets = max(1, bins["ucb_span_length_bins"]) * max(1, bins["ucb_block_progress_bins"])
        buckets *= max(1, bins["ucb_entropy_bins"])
        if buckets > MAX_UCB_BUCKETS:  # the bandit keeps two counters per bucket and row
            limits = ", ".join(f"{k} must be <= {MAX_UCB_BUCKETS // (buckets // max(1, v))}" for k, v in bins.items())
            raise ConfigError(
                f"the UCB context has {buckets} buckets ({' x '.join(f'{k}={v}' for k, v in bins.items())}); at most "
                f"{MAX_UCB_BUCKETS} are allowed (the official defaults are 2 x 2 x 2): with the other two as given, "
                f"{limits}"
            )

    # -- checks --------------------------------------------------------------------------------
    def check_cache(self, model, cache):
        super().check_cache(model, cache)
        if cache is not None and not cache.exact_prefix:
            raise ConfigError(
                f"'s2d2' runs with the block K/V cache (cache='default') or without one (cache=None), not with "
                f"{type(cache).__name__}: its verifier forward reads and extends the exact block K/V store"
            )

    def check_run(self, run):
        super().check_run(run)
        if run.steps_per_block > run.canvas.block_size:
            raise ConfigError(
                f"steps_per_block={run.steps_per_block} exceeds block_size={run.canvas.block_size}: S2D2's schedule "
                f"commits at least one token per step; use steps_per_block <= {run.canvas.block_size}"
            )

    def row_forwards(self, state, working, forwards):
        # a step's forwards: the drafting one, and the verifier's (one, of the rows that verify) where any verifies
        if forwards == 0:
            return torch.zeros_like(working, dtype=torch.long)
        return working.long() * (forwards - (~state.verified).long() * (forwards - 1))

    # -- state and the drafting forward's attention --------------------------------------------
    def init_state(self, run):
        b, length = run.canvas.tokens.shape
        device = run.canvas.tokens.device
        bins = (self.ucb_span_length_bins, self.ucb_block_progress_bins, self.ucb_entropy_bins)
        buckets = max(1, bins[0]) * max(1, bins[1]) * max(1, bins[2])
        return S2D2State(
            causal=torch.zeros(b, length, dtype=torch.bool, device=device),
            first=torch.zeros(b, dtype=torch.long, device=device),
            is_on=torch.zeros(b, dtype=torch.bool, device=device),
            ucb_count=torch.zeros(b, 2, buckets, dtype=torch.float64, device=device),
            ucb_reward=torch.zeros(b, 2, buckets, dtype=torch.float64, device=device),
            ucb_t=torch.zeros(b, dtype=torch.long, device=device),
            verified=torch.zeros(b, dtype=torch.bool, device=device),
        )

    def begin_block(self, step, state, rows):
        cols = step.columns
        if self.cache_ver:  # the prompt and every finished block: stored token-causally
            state.causal |= rows[:, None] & (cols < step.start[:, None])
        elif self.draft_ver:  # the finished block keeps its causal rows before its last first mask
            prev = step.start - step.canvas.block_size
            finished = rows & (step.block > 0)
            state.causal |= finished[:, None] & (cols >= prev[:, None]) & (cols < (prev + state.first)[:, None])
        state.first = torch.where(rows, 0, state.first)

    def forward_mask(self, step, state, plan):
        if not (self.cache_ver or self.draft_ver):
            return None
        causal = state.causal
        if self.draft_ver:
            masks = step.committable
            first = torch.where(masks.any(1), masks.long().argmax(1) - step.start, state.first)
            state.first = first
            causal = causal | (step.in_block & (step.columns < (step.start + first)[:, None]))
        positions = step.of_active(step.canvas.positions)
        return _causal_rows(
            step.model, positions, step.valid, step.of_active(causal), plan.queries, plan.keys, step.canvas.block_size
        )

    # -- scoring -------------------------------------------------------------------------------
    def score_spec(self, run):
        # at temperature > 0: temperature, top-k, top-p, then the tempered, filtered distribution is sampled as
        # is (Gumbel-max at temperature 1); greedy: the raw logits' argmax
        t = run.temperature
        warps = {"temper": t, "top_k": self.top_k, "top_p": self.top_p} if t > 0 else {}
        return ScoreSpec(
            need=frozenset({"prob"}),
            temperature=1.0 if t > 0 else 0.0,
            dtype=torch.float32,
            order=("temper", "top_k", "top_p"),
            **warps,
        )

    def _logits(self, step, hidden, rows, columns):
        """Sampling logits [n, K, V] of ``columns`` [n, K] from ``hidden`` (rows: their batch rows): the
        scoring seam's, with the spec's warps (temperature, top-k, top-p) applied."""
        return step.run.scorer.logits(step, rows, columns, hidden, warped=True)

    # -- the step ------------------------------------------------------------------------------
    def select(self, step, state):
        canvas, bs = step.canvas, step.canvas.block_size
        window = step.window(bs)  # [B, bs]: each row's block
        masked = step.committable.gather(1, window)
        x0 = step.scores.token.gather(1, window)
        p0 = step.scores.prob.gather(1, window).float()
        offsets = torch.arange(bs, device=window.device)
        working = masked.any(1)
        first = masked.long().argmax(1)
        span = masked & (masked | (offsets < first[:, None])).long().cumprod(1).bool()  # first run of masks
        high = masked & (p0 > self.confidence_threshold)

        draft_probs = None
        if self.do_verify_policy != "mask_span_length":
            draft_probs = self._draft_probs(step, window)
        verify, ucb = self._route(step, state, masked, span, high, p0, draft_probs, working, window)
        state.verified = verify

        transfer = torch.zeros_like(masked)
        tokens = x0.clone()
        # one read-back: whether any row verifies, and the widest canvas prefix the verifier needs
        any_verify, width = torch.stack([verify.any().long(), (step.end * verify).max()]).tolist()
        if any_verify:
            transfer, tokens = self._verify(step, state, verify, window, masked, span, x0, p0, transfer, tokens, width)
        if self.always_check_high_confidence:
            transfer |= high
        k = torch.minimum(step.quota - transfer.sum(1), (masked & ~transfer).sum(1)).clamp(min=0)
        transfer |= self._fallback(masked & ~transfer, p0, k)

        if ucb is not None:
            action, bucket = ucb
            reward = transfer.sum(1).double() / torch.where(verify, 2.0, 1.0).double()
            index = (action.long() * state.ucb_count.shape[2] + bucket)[:, None]
            w = working.double()[:, None]
            state.ucb_count.view(len(w), -1).scatter_add_(1, index, w)
            state.ucb_reward.view(len(w), -1).scatter_add_(1, index, w * reward[:, None])

        commit = torch.zeros_like(canvas.valid).scatter(1, window, transfer)
        out = torch.full_like(canvas.tokens, NO_OVERRIDE).scatter(1, window, torch.where(transfer, tokens, NO_OVERRIDE))
        return Decision(commit=commit, tokens=out)

    def _fallback(self, remaining, p0, k):
        """The SDAR strategy's picks among the ``remaining`` masks, ``k`` [B] of them (0: none)."""
        if self.remasking_strategy == "sequential":
            return remaining & (remaining.long().cumsum(1) <= k[:, None])
        confidence = p0.masked_fill(~remaining, float("-inf"))
        top = top_k_per_row(confidence, k) & remaining
        if self.remasking_strategy == "low_confidence_static":
            return top
        above = remaining & (p0 > self.confidence_threshold)
        enough = above.sum(1) >= k
        return torch.where(enough[:, None], above, top) & (k > 0)[:, None]

    def _draft_probs(self, step, window):
        """float32 probabilities [B, bs, V] of the drafting distribution (zeros for rows not computed)."""
        rows = step.active
        logits = self._logits(step, step.hidden, rows, window.index_select(0, rows))
        probs = torch.softmax(logits.float(), dim=-1)
        out = probs.new_zeros(window.shape[0], *probs.shape[1:])
        return out.index_copy(0, rows, probs)

    # -- routing -------------------------------------------------------------------------------
    def _route(self, step, state, masked, span, high, p0, probs, working, window):
        """bool [B] rows that verify now, and the UCB (action, bucket) per row (None for other policies)."""
        policy = self.do_verify_policy
        span_len = span.sum(1)
        if policy == "mask_span_length":
            short = span_len < self.min_ssd_span_length
            if self.legacy_ssd_span_strategy:
                short &= high.sum(1) >= torch.clamp(masked.sum(1), max=self.min_ssd_span_length)
            return working & ~short, None
        if policy in ("score_threshold", "score_hysteresis"):
            score = self._score(span, high, p0, probs)
            if policy == "score_threshold":
                return working & ~(score < self.do_verify_score_threshold), None
            on, off = self.hysteresis_threshold_on, self.hysteresis_threshold_off
            verify = torch.where(state.is_on, ~(score < off), score > on)  # strict >, as the official code
            verify &= working
            state.is_on = torch.where(working, verify, state.is_on)
            return verify, None
        return self._ucb(step, state, masked, span, probs, working, window)

    def _normalized_entropy(self, probs):
        entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
        return entropy / torch.log(torch.tensor(float(probs.shape[-1]), device=probs.device, dtype=probs.dtype))

    def _score(self, span, high, p0, probs):
        """float64 [B]: the official ``do_verify_score`` of each row's span."""
        estimator = self.token_acceptance_estimator
        if estimator in ("hard_margin_threshold", "soft_clipped_linear_margin"):
            top2 = torch.topk(probs, 2, dim=-1).values
            margin = top2[..., 0] - top2[..., 1]
            if estimator == "hard_margin_threshold":
                alpha = (margin > self.ssd_confidence_margin_threshold).float()
            else:
                alpha = (self.ssd_confidence_margin_coef * margin).clamp(0.0, 1.0)
        elif estimator in ("hard_entropy_threshold", "soft_entropy_negexp"):
            h = self._normalized_entropy(probs)
            if estimator == "hard_entropy_threshold":
                alpha = (h < self.ssd_entropy_threshold).float()
            else:
                alpha = torch.exp(-self.ssd_entropy_temperature * h)
        elif estimator == "soft_confidence_power":
            alpha = p0.clamp(0.0, 1.0) ** self.ssd_confidence_power
        else:  # soft_renyi_2_entropy
            alpha = (probs**2).sum(-1).clamp(0.0, 1.0)
        alpha = torch.where(span, alpha.clamp(0.0, 1.0), torch.ones_like(alpha))
        expected = torch.where(span, alpha.cumprod(1), torch.zeros_like(alpha)).sum(1).double()
        c = float(self.score_penalty_coef)
        if self.do_verify_score_type == "difference_dynamic":
            return expected - c * high.sum(1).double()
        return expected - c

    def _ucb(self, step, state, masked, span, probs, working, window):
        bins_s, bins_p, bins_e = (
            max(1, self.ucb_span_length_bins),
            max(1, self.ucb_block_progress_bins),
            max(1, self.ucb_entropy_bins),
        )
        bs = step.canvas.block_size
        chosen = span if self.ucb_entropy_source == "span" else masked
        h = self._normalized_entropy(probs)
        n = chosen.sum(1)
        mean_h = (torch.where(chosen, h, torch.zeros_like(h)).sum(1) / n.clamp(min=1)).double()
        generated = (window >= step.canvas.prompt_width).sum(1)
        progress = ((generated - masked.sum(1)).double() / max(1, bs)).clamp(0.0, 1.0)
        span_bin = _bin(span.sum(1).clamp(min=1).double(), 1.0, float(max(1, bs)), bins_s)
        bucket = (span_bin * bins_p + _bin(progress, 0.0, 1.0, bins_p)) * bins_e + _bin(mean_h, 0.0, 1.0, bins_e)
        state.ucb_t = state.ucb_t + working.long()
        log_t = torch.log(state.ucb_t.clamp(min=1).double())
        index = bucket[:, None, None].expand(-1, 2, 1)
        count = state.ucb_count.gather(2, index).squeeze(2)  # [B, 2]
        reward = state.ucb_reward.gather(2, index).squeeze(2)
        bonus = torch.where(log_t[:, None] > 0, self.ucb_beta * torch.sqrt(log_t[:, None] / count.clamp(min=1)), 0.0)
        score = torch.where(count > 0, reward / count.clamp(min=1) + bonus, float("inf"))
        verify = working & (score[:, 1] >= score[:, 0])
        return verify, (verify, bucket)

    # -- verification --------------------------------------------------------------------------
    def _verify(self, step, state, verify, window, masked, span, x0, p0, transfer, tokens, width):
        """The verifier forward of the rows ``verify`` over the first ``width`` columns (no key past the blocks
        verified is visible) and their acceptance; returns (transfer, tokens) [B, bs]."""
        run, model, canvas = step.run, step.model, step.canvas
        bs = canvas.block_size
        rows = verify.nonzero().squeeze(1)
        n = rows.shape[0]
        act = step.store_rows(rows)
        win = window.index_select(0, rows)
        draft = canvas.tokens.index_select(0, rows)[:, :width]
        draft = draft.scatter(1, win, torch.where(masked[rows], x0[rows], draft.gather(1, win)))
        positions = canvas.positions.index_select(0, rows)[:, :width]
        ext_tokens = torch.cat([draft, torch.full((n, bs), model.mask_id, dtype=draft.dtype, device=draft.device)], 1)
        ext_positions = torch.cat([positions, positions.gather(1, win)], 1)
        blank = torch.zeros_like(win, dtype=torch.bool)
        ext_valid = torch.cat([canvas.valid.index_select(0, rows)[:, :width], ~blank], 1)
        ext_cols = width + torch.arange(bs, device=win.device).expand(n, -1)
        causal = torch.cat([state.causal.index_select(0, rows)[:, :width], blank], 1)
        if run.cache is None:
            queries, kv = None, None
        else:
            queries, kv = torch.cat([win, ext_cols], 1), run.cache_state.kv.scratch(act, width, bs)
        mask = _verifier_mask(model, ext_positions, ext_valid, causal, win[:, 0], width, bs, queries)
        hidden = run.forward(ext_tokens, ext_positions, queries=queries, kv=kv, write=kv is not None, mask=mask)
        # a shifted model (Fast-dLLM v2) reads the first verifier mask's logit from the column before it: the row's
        # block's last draft, at its own block end (which is the mask half's start alone, not where a batch row's
        # block ends later: there, the column before is a pad)
        q_cols = ext_cols
        if model.shift:
            q_cols = ext_cols.clone()
            q_cols[:, 0] = step.end.index_select(0, rows)
        q_logits = self._logits(step, hidden, rows, q_cols)  # [n, bs, V]

        x0v, p0v, spanv, maskedv = x0[rows], p0[rows], span[rows], masked[rows]
        greedy = run.temperature == 0
        # the ratio min(1, (q(x) / p(x)) ** gamma) at each draft x, q the verifier's float32 softmax (at
        # temperature 0 the untempered one, as the official ``_probs_from_logits``)
        q_probs = torch.softmax(q_logits.float(), dim=-1)
        ratio = self._ratio(q_probs.gather(-1, x0v[..., None]).squeeze(-1), p0v)
        if greedy:  # greedy acceptance: the ratio of the one-hot verifier (0 or 1) is 1
            q_token = q_logits.argmax(-1)
            accept = self._ratio((x0v == q_token).float(), p0v) > 0
        else:
            accept = step.uniform(Stream.ACCEPT).gather(1, window)[rows] < ratio.double()
        reject = spanv & ~accept
        rejected = reject.any(1)
        at = reject.long().argmax(1)
        offsets = torch.arange(bs, device=win.device)
        upto = (offsets < at[:, None]) | ~rejected[:, None]
        hit = (offsets == at[:, None]) & rejected[:, None]
        update = spanv & (upto | hit)
        new = x0v.clone()
        if self.allow_resample:
            if greedy:
                resampled = q_token.gather(1, at[:, None]).squeeze(1)
            else:
                resampled = self._resample(step, rows, win, at, q_probs)
            new = torch.where(hit & rejected[:, None], resampled[:, None], new)
        threshold = self.ssd_ratio_threshold
        if threshold is not None and threshold >= 0:  # the soft ratio, also when decoding greedily (official)
            among = maskedv if self.ssd_threshold_all_spans else spanv
            update |= among & ~update & (ratio >= threshold)
        transfer = transfer.index_put((rows,), update)
        tokens = tokens.index_put((rows,), torch.where(update, new, x0v))
        return transfer, tokens

    def _ratio(self, q_sel, p_sel):
        """min(1, (q / p) ** ssd_ratio_tempering_factor) with p clamped at 1e-12, as the official."""
        ratio = q_sel.clamp_min(0.0) / p_sel.clamp_min(1e-12)
        if self.ssd_ratio_tempering_factor != 1.0:
            ratio = ratio**self.ssd_ratio_tempering_factor
        return ratio.clamp(max=1.0)

    def _resample(self, step, rows, win, at, q_probs):
        """Tokens [n] drawn from normalise((q - p)+) at each row's rejected slot (from q if that is empty)."""
        column = win.gather(1, at[:, None])  # [n, 1]
        p_logits = self._logits(step, step.hidden.select(step.active_rows(rows)), rows, column)
        p = torch.softmax(p_logits.float(), dim=-1)[:, 0]
        q = q_probs.gather(1, at[:, None, None].expand(-1, 1, q_probs.shape[-1]))[:, 0]
        delta = (q - p).clamp_min(0.0)
        empty = (delta.sum(-1) <= 0) | ~torch.isfinite(delta).all(-1)
        weights = torch.where(empty[:, None], q.clamp_min(0.0), delta)
        offsets = column - step.canvas.prompt_width
        uniform = step.run.rng.uniform(Stream.RESAMPLE, rows, step.t[rows], offsets, vocab=weights.shape[-1])
        return gumbel_argmax(torch.log(weights)[:, None], 1.0, uniform)[:, 0]


def _bin(value: torch.Tensor, vmin: float, vmax: float, bins: int) -> torch.Tensor:
    """The official ``_linear_bin_idx`` per row (float64 values)."""
    if bins <= 1 or vmax <= vmin:
        return torch.zeros_like(value, dtype=torch.long)
    ratio = (value.clamp(vmin, vmax) - vmin) / (vmax - vmin)
    return (ratio * bins).long().clamp(0, bins - 1)


def _causal_rows(model, positions, valid, causal, queries, keys, block_size):
    """The model's block-causal mask [n, 1, R, L] with the query columns flagged in ``causal`` [n, L] made
    token-causal (keys at positions <= the query's)."""
    allowed = model.attention_mask(positions, valid, queries, keys, block_size)  # the generation's blocks (LLaDA2)
    q_pos = positions if queries is None else positions.gather(1, queries)
    q_causal = causal if queries is None else causal.gather(1, queries)
    token_causal = positions[:, None, :] <= q_pos[:, :, None]
    return allowed & (~q_causal[:, :, None] | token_causal)[:, None]


def _verifier_mask(model, positions, valid, causal, start, width, bs, queries):
    """The official 2L verifier mask over the extended canvas ``[width columns | bs verifier masks]``.

    Block query ``s+i`` (the draft-filled first half) sees every earlier real column and the block up to
    itself; verifier mask ``width+i`` sees every earlier real column, the drafts before ``i`` and itself.
    Without a cache (``queries`` None) the other columns are computed as in a drafting forward."""
    n, length = positions.shape
    cols = torch.arange(length, device=positions.device)
    q_cols = cols.expand(n, -1) if queries is None else queries
    q_pos = positions.gather(1, q_cols)
    real = ((cols < width)[None, :] & valid)[:, None, :]
    first_half = real & (positions[:, None, :] <= q_pos[:, :, None])
    second_half = (real & (positions[:, None, :] < q_pos[:, :, None])) | (cols[None, None, :] == q_cols[:, :, None])
    is_ext = q_cols >= width
    allowed = torch.where(is_ext[:, :, None], second_half, first_half)
    if queries is None:
        in_block = (q_cols >= start[:, None]) & (q_cols < (start + bs)[:, None])
        other = _causal_rows(model, positions, valid, causal, None, None, bs)[:, 0] & (cols < width)[None, None, :]
        allowed = torch.where((in_block | is_ext)[:, :, None], allowed, other)
    return allowed[:, None]
