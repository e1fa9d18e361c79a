"""DiffusionGemma (google/diffusiongemma-26B-A4B-it, June 2026): a uniform-state block-diffusion encoder–decoder
over one Gemma-4 mixture-of-experts text stack. Our own implementation of the published layout (transformers'
``models/diffusion_gemma`` is the reference; research/diffusion_gemma.md §2–§3).

There is no mask token: a canvas of ``canvas_length`` (256) random ids is refined in place by the **decoder**
(bidirectional over the canvas, reading the encoder's K/V), and finished canvases are appended autoregressively.
The **encoder** is the same layers run causally over the prompt and then over each finished canvas; only its K/V
are used (:meth:`DiffusionGemma.encode` into an :class:`Encoded`). The decoding process is
:mod:`dllm.engine.renoise`; the family's sampler :class:`dllm.samplers.diffusion_gemma.EntropyBound`.

Layer (both modes): ``h += post_attention_layernorm(attn(input_layernorm(h)))``; then a dense gated-GELU MLP and a
mixture of experts in parallel on the same residual r — ``m1 = post_feedforward_layernorm_1(mlp(
pre_feedforward_layernorm(r)))``, experts chosen by a softmax router on the raw residual (a weightless RMSNorm,
times ``router.scale`` and hidden^-½; top-k renormalised, times ``per_expert_scale``), run on
``pre_feedforward_layernorm_2(r)``, ``m2 = post_feedforward_layernorm_2(moe)`` — ``h = r +
post_feedforward_layernorm(m1 + m2)``, and the whole residual times the layer's ``layer_scalar`` (the encoder's
own buffer, stored under ``model.encoder.language_model.layers.{i}.layer_scalar``). RMSNorms in float32 without
Gemma 1–3's +1 offset. Attention: q/k RMSNorm, RoPE, v a weightless RMSNorm, scaling 1; sliding layers (head_dim,
``num_key_value_heads``, their own ``v_proj``, default RoPE θ 1e4) see the last ``sliding_window`` positions in the
encoder and the last ``sliding_window - 1`` encoded positions plus the whole canvas in the decoder (transformers'
sliding cache keeps W - 1 keys); full layers (``global_head_dim``, ``num_global_key_value_heads``, no ``v_proj``: V
is the raw k projection, proportional RoPE θ 1e6 over a quarter of the frequencies) see everything. Decoder input:
``post_norm(embed(canvas)·√d + self_conditioning(softmax(previous logits) @ embed·√d))`` (the second term's input:
:meth:`DiffusionGemma.soft_embedding`). Logits: tied head, float32, ``tanh(l / 30) · 30``.

Checkpoint: ``config.json`` ``model_type: "diffusion_gemma"`` with the text fields under ``text_config`` in either
form (the Hub's ``global_head_dim`` / ``num_global_key_value_heads``, or the ``per_layer_config`` that transformers'
``save_pretrained`` writes); text weights under ``model.decoder.*``; the vision tower's weights
(``model.encoder.vision_tower.*``, ``model.encoder.embed_vision.*``) and any stored tied copies of the encoder's text
weights are ignored: dllm decodes text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dllm.core.errors import CheckpointError, ModelError
from dllm.models import moe
from dllm.models.base import DiffusionLM, Hidden
from dllm.models.layers import GatedMLP, with_weights

SLIDING, FULL = "sliding_attention", "full_attention"
CANVAS_LENGTH = 256  # transformers' and the published config's canvas_length


@dataclass(frozen=True)
class GemmaShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    eps: float
    softcap: float | None
    experts: int
    top_k: int
    moe_intermediate: int
    window: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]  # per layer
    kv_heads: tuple[int, ...]  # per layer
    rope: tuple[tuple[str, float, float, float], ...]  # per layer type: (type, theta, partial_rotary_factor, factor)
    bias: bool
    tie: bool

    @classmethod
    def from_config(cls, config: dict) -> GemmaShape:
        text = config.get("text_config") or config
        if text.get("use_bidirectional_attention") == "all":
            raise CheckpointError(
                "DiffusionGemma: use_bidirectional_attention='all' (a bidirectional encoder) is not supported; the "
                "published checkpoint uses 'vision' (causal text)"
            )
        if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise CheckpointError(f"DiffusionGemma: hidden_activation={text['hidden_activation']!r} is not supported")
        try:
            layers, heads = int(text["num_hidden_layers"]), int(text["num_attention_heads"])
            types = list(text.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(layers)])
            if len(types) != layers or set(types) - {SLIDING, FULL}:
                raise CheckpointError(
                    f"DiffusionGemma config.json: layer_types must list {layers} of {SLIDING!r} / {FULL!r}"
                )
            types[-1] = FULL  # transformers forces the last layer to full attention
            head_dim, kv = int(text.get("head_dim") or 256), int(text.get("num_key_value_heads") or heads)
            per_layer = text.get("per_layer_config")
            if per_layer is None:  # the Hub's form: every full layer takes the global fields
                full = {"head_dim": int(text.get("global_head_dim") or 512)}
                if text.get("num_global_key_value_heads") is not None:
                    full["num_key_value_heads"] = int(text["num_global_key_value_heads"])
                per_layer = {i: full for i, t in enumerate(types) if t == FULL}
            per_layer = {int(i): v for i, v in per_layer.items()}
            head_dims = tuple(int(per_layer.get(i, {}).get("head_dim", head_dim)) for i in range(layers))
            kv_heads = tuple(int(per_layer.get(i, {}).get("num_key_value_heads", kv)) for i in range(layers))
            default_rope = {
                SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
            }
            rope_parameters = text.get("rope_parameters") or default_rope
            rope = []
            for kind in (SLIDING, FULL):
                r = rope_parameters.get(kind) or default_rope[kind]
                if r.get("rope_type", "default") not in ("default", "proportional"):
                    raise CheckpointError(f"DiffusionGemma: rope_type {r['rope_type']!r} ({kind}) is not supported")
                rope.append(
                    (
                        r.get("rope_type", "default"),
                        float(r.get("rope_theta", 10_000.0)),
                        float(r.get("partial_rotary_factor", 1.0)),
                        float(r.get("factor", 1.0)),
                    )
                )
            shape = cls(
                hidden=int(text["hidden_size"]),
                intermediate=int(text["intermediate_size"]),
                layers=layers,
                heads=heads,
                vocab=int(text["vocab_size"]),
                eps=float(text.get("rms_norm_eps", 1e-6)),
                softcap=text.get("final_logit_softcapping", 30.0),
                experts=int(text["num_experts"]),
                top_k=int(text["top_k_experts"]),
                moe_intermediate=int(text["moe_intermediate_size"]),
                window=int(text.get("sliding_window", 512)),
                layer_types=tuple(types),
                head_dims=head_dims,
                kv_heads=kv_heads,
                rope=tuple(rope),
                bias=bool(text.get("attention_bias", False)),
                tie=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
            )
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"DiffusionGemma config.json lacks or misstates a text_config field: {e}") from None
        for i, (d, k) in enumerate(zip(head_dims, kv_heads)):
            if heads % k or d % 2:
                raise CheckpointError(
                    f"DiffusionGemma config.json: layer {i} has head_dim={d}, {k} K/V heads: need an even head_dim "
                    f"and num_attention_heads={heads} a multiple of the K/V heads"
                )
        if not 1 <= shape.top_k <= shape.experts:
            raise CheckpointError(f"DiffusionGemma: top_k_experts={shape.top_k} must be in [1, {shape.experts}]")
        if shape.window < 1:
            raise CheckpointError(f"DiffusionGemma: sliding_window={shape.window} must be >= 1")
        return shape

    def inv_freq(self, layer_type: str, device=None) -> torch.Tensor:
        """RoPE inverse frequencies [head_dim / 2] of a layer type (proportional: the first ``partial_rotary_factor``
        share of the frequencies, the rest 0: those channel pairs are not rotated)."""
        kind, theta, partial, factor = self.rope[0 if layer_type == SLIDING else 1]
        d = self.head_dims[self.layer_types.index(layer_type)]
        rotary = int(d * partial) if kind == "default" else 2 * int(partial * d // 2)
        # (exponents over the rotated channels for the default kind, over head_dim for the proportional one)
        scale = rotary if kind == "default" else d
        freq = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float, device=device) / scale)
        freq = torch.cat([freq, torch.zeros(d // 2 - rotary // 2, device=device)])
        return freq / factor


class Norm(nn.Module):
    """Gemma-4's RMSNorm: ``x · (mean(x²) + eps)^-½ · weight`` in float32 (no +1 offset); ``scale=False``: no weight."""

    def __init__(self, dim: int, eps: float, scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, T, H, D] with cos / sin [B, T, 1, D] (NeoX halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class SelfAttention(nn.Module):
    def __init__(self, s: GemmaShape, index: int):
        super().__init__()
        d, kv = s.head_dims[index], s.kv_heads[index]
        self.head_dim, self.sliding = d, s.layer_types[index] == SLIDING
        self.q_proj = nn.Linear(s.hidden, s.heads * d, bias=s.bias)
        self.k_proj = nn.Linear(s.hidden, kv * d, bias=s.bias)
        self.v_proj = nn.Linear(s.hidden, kv * d, bias=s.bias) if self.sliding else None  # full layers: V = K
        self.o_proj = nn.Linear(s.heads * d, s.hidden, bias=s.bias)
        self.q_norm = Norm(d, s.eps)
        self.k_norm = Norm(d, s.eps)
        self.v_norm = Norm(d, s.eps, scale=False)

    def forward(self, x, cos, sin, past, mask):
        """x [B, T, d]; past: (keys, values) [B, H_kv, T', D] attended before the fresh ones (or None); mask: bool
        [B, 1, T, T' + T] or None. Returns (output [B, T, d], the fresh (keys, values))."""
        b, t, _ = x.shape
        q = _rotate(self.q_norm(self.q_proj(x).view(b, t, -1, self.head_dim)), cos, sin).transpose(1, 2)
        raw = self.k_proj(x).view(b, t, -1, self.head_dim)
        v = raw if self.v_proj is None else self.v_proj(x).view(b, t, -1, self.head_dim)
        k = _rotate(self.k_norm(raw), cos, sin).transpose(1, 2)
        v = self.v_norm(v).transpose(1, 2)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        if q.shape[1] != keys.shape[1]:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0)
        return self.o_proj(out.transpose(1, 2).flatten(2)), (k, v)


class Router(nn.Module):
    def __init__(self, s: GemmaShape):
        super().__init__()
        self.s = s
        self.norm = Norm(s.hidden, s.eps, scale=False)
        self.proj = nn.Linear(s.hidden, s.experts, bias=False)
        self.scale = nn.Parameter(torch.ones(s.hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(s.experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [n, k], weights [n, k] float32) of the rows x [n, d]: softmax in float32, top-k renormalised,
        times the chosen experts' ``per_expert_scale``."""
        probs = F.softmax(self.proj(self.norm(x) * self.scale * self.s.hidden**-0.5), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.s.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return experts, weights * self.per_expert_scale[experts]


class Experts(nn.Module):
    """Stacked expert weights: ``gate_up_proj`` [E, 2I, d] (gate first), ``down_proj`` [E, d, I]."""

    def __init__(self, s: GemmaShape):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(s.experts, 2 * s.moe_intermediate, s.hidden))
        self.down_proj = nn.Parameter(torch.empty(s.experts, s.hidden, s.moe_intermediate))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(_gelu(gate) * up, self.down_proj[e])

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_j weights[i, j] · expert[chosen[i, j]](x[i]): the (row, slot) pairs sorted by expert, one grouped GEMM
        per projection over them where this torch has one and no gradient is taken (:func:`dllm.models.moe.grouped`:
        no host read), else one matmul per expert that received rows (one host read of the counts); under
        torch.compile without the grouped GEMM, every expert on every row, weighted (no host read)."""
        n, k = chosen.shape
        if moe.use_grouped(x, self.gate_up_proj):
            return moe.grouped(x, chosen, weights, self.gate_up_proj, None, self.down_proj, _gelu)
        if torch.compiler.is_compiling():
            dense = torch.zeros(n, self.gate_up_proj.shape[0], dtype=weights.dtype, device=x.device)
            dense.scatter_(1, chosen, weights)
            out = torch.zeros_like(x)
            for e in range(self.gate_up_proj.shape[0]):
                out = out + self.expert(e, x) * dense[:, e : e + 1].to(x.dtype)
            return out
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        rows, slot_weights = order // k, weights.reshape(-1)[order].to(x.dtype)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        out, start = torch.zeros_like(x), 0
        for e, count in enumerate(counts):
            if count:
                part = rows[start : start + count]
                y = self.expert(e, x.index_select(0, part)) * slot_weights[start : start + count, None]
                out.index_add_(0, part, y)
            start += count
        return out


class Layer(nn.Module):
    def __init__(self, s: GemmaShape, index: int):
        super().__init__()
        self.self_attn = SelfAttention(s, index)
        self.mlp = GatedMLP(s.hidden, s.intermediate, _gelu)
        names = (
            "input_layernorm post_attention_layernorm pre_feedforward_layernorm post_feedforward_layernorm "
            "post_feedforward_layernorm_1 post_feedforward_layernorm_2 pre_feedforward_layernorm_2"
        )
        for name in names.split():
            setattr(self, name, Norm(s.hidden, s.eps))
        self.router = Router(s)
        self.experts = Experts(s)
        self.layer_scalar = _scalar()

    def forward(self, h, cos, sin, past, mask, scaled=True, kv_only=False):
        """(the layer's output, its fresh (keys, values)); ``scaled``: times the decoder's ``layer_scalar`` (False: the
        caller applies the encoder's); ``kv_only``: the fresh K/V alone (the output is not needed)."""
        attn, kv = self.self_attn(self.input_layernorm(h), cos, sin, past, mask)
        if kv_only:
            return None, kv
        r = h + self.post_attention_layernorm(attn)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(r)))
        flat = r.reshape(-1, r.shape[-1])
        chosen, weights = self.router(flat)
        moe = self.experts(self.pre_feedforward_layernorm_2(flat), chosen, weights).view_as(r)
        h = r + self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(moe))
        return (h * self.layer_scalar if scaled else h), kv


class SelfConditioning(GatedMLP):
    """The gated MLP (its module names flat, as the checkpoint's ``self_conditioning.{gate,up,down}_proj``) between a
    scaled and a weightless RMSNorm, added to the canvas's embedding."""

    def __init__(self, s: GemmaShape):
        super().__init__(s.hidden, s.intermediate, _gelu)
        self.pre_norm = Norm(s.hidden, s.eps)
        self.post_norm = Norm(s.hidden, s.eps, scale=False)

    def forward(self, embedded, soft):
        return self.post_norm(embedded + super().forward(self.pre_norm(soft)))


class Decoder(nn.Module):
    """``model.decoder``: the text stack (shared with the encoder), its final norm and the self-conditioning block."""

    def __init__(self, s: GemmaShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(Layer(s, i) for i in range(s.layers))
        self.norm = Norm(s.hidden, s.eps)
        self.self_conditioning = SelfConditioning(s)


def _scalar() -> nn.Parameter:
    """A layer's ``layer_scalar`` (a buffer in transformers; a parameter without gradient here, so that a device map
    streams and offloads it as a weight)."""
    return nn.Parameter(torch.ones(1), requires_grad=False)


class _Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_scalar = _scalar()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.layer_scalar


class _Encoder(nn.Module):
    """``model.encoder.language_model``: only the encoder's own per-layer ``layer_scalar`` (its other text weights are
    the decoder's)."""

    def __init__(self, s: GemmaShape):
        super().__init__()
        self.layers = nn.ModuleList(_Scalar() for _ in range(s.layers))


@dataclass
class Encoded:
    """The encoder's K/V of every column encoded so far (the prompt, then each finished canvas): per layer
    [B, H_kv, T_ℓ, D] — a sliding layer keeps its last ``sliding_window - 1`` columns, as transformers' cache —
    and which of the T columns are real (pads: False; a row's pads all lie left of its real tokens, so a column
    distance is a position distance). RoPE positions count a row's real tokens from 0
    (:meth:`DiffusionLM.positions`)."""

    keys: list
    values: list
    valid: torch.Tensor  # bool [B, T]

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def select(self, rows: torch.Tensor) -> Encoded:
        """The same for the batch rows ``rows``."""
        pick = lambda ts: [t.index_select(0, rows.to(t.device)) for t in ts]  # noqa: E731 (a layer's device)
        return Encoded(pick(self.keys), pick(self.values), self.valid.index_select(0, rows))


class DiffusionGemma(DiffusionLM):
    """The DiffusionGemma adapter. :meth:`encode` extends an :class:`Encoded` (not a counted forward, as in
    transformers); :meth:`hidden` is the decoder over a canvas (each counted forward); :meth:`head` its logits."""

    uniform_state = True  # no mask token (Gemma's tokenizer has a <mask>, which the model never uses)

    def __init__(self, config: dict):
        super().__init__(config)
        s = self.shape = GemmaShape.from_config(config)
        self.model = nn.Module()
        self.model.decoder = Decoder(s)
        self.model.encoder = nn.Module()
        self.model.encoder.language_model = _Encoder(s)
        self.lm_head = None if s.tie else nn.Linear(s.hidden, s.vocab, bias=False)
        text = config.get("text_config") or config
        self.read_token_ids({**text, **{k: v for k, v in config.items() if k.endswith("_token_id")}})
        self.mask_id = None  # uniform-state: no mask token
        self.vocab_size = s.vocab
        self.max_length = int(text.get("max_position_embeddings", 262_144))
        self.block_size = int(config.get("canvas_length") or CANVAS_LENGTH)

    def check_usable(self) -> None:
        """A uniform-state model needs no mask token; its canvas ids must be in the vocabulary."""
        if self.pad_id is not None and not 0 <= self.pad_id < self.vocab_size:
            raise ModelError(f"pad token id {self.pad_id} is outside the vocabulary (size {self.vocab_size})")

    # -- the parts DiffusionLM reads -----------------------------------------------------------------------------
    @property
    def embedding(self) -> nn.Embedding:
        return self.model.decoder.embed_tokens

    @property
    def decoder(self) -> nn.ModuleList:
        return self.model.decoder.layers

    @property
    def final_norm(self) -> Norm:
        return self.model.decoder.norm

    @property
    def output(self) -> nn.Linear | None:
        return self.lm_head

    @property
    def head_dim(self) -> int:
        return self.shape.head_dims[0]

    def prepare(self) -> None:
        """The fused projections (:meth:`DiffusionLM.prepare`), and whether the grouped GEMM runs here, tried once
        outside any trace (:func:`dllm.models.moe.grouped_usable`)."""
        super().prepare()
        weight = self.decoder[0].experts.gate_up_proj
        moe.grouped_usable(weight.device, weight.dtype)

    def kv_layout(self) -> tuple[int, int, int]:
        raise ModelError("DiffusionGemma keeps its encoder's K/V itself (dllm.models.diffusion_gemma.Encoded)")

    # -- forwards ------------------------------------------------------------------------------------------------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        return x * torch.tensor(self.shape.hidden**0.5, dtype=x.dtype)  # (the weight's dtype: bf16 rounds √d)

    def _decoder_input(self, tokens: torch.Tensor, conditioning: torch.Tensor | None) -> torch.Tensor:
        """The decoder's input: the canvas's embedding with its self-conditioning input (None: zeros) added."""
        x = self._embed(tokens)
        soft = torch.zeros_like(x) if conditioning is None else conditioning.to(x.dtype)
        return self.model.decoder.self_conditioning(x, soft)

    def _rope(self, positions: torch.Tensor, dtype) -> dict:
        out = {}
        for kind in set(self.shape.layer_types):
            freqs = positions.float()[..., None] * self.shape.inv_freq(kind, positions.device)
            emb = torch.cat([freqs, freqs], dim=-1)[:, :, None]
            out[kind] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return out

    def _kept(self, layer: int, length: int) -> int:
        """Encoded columns a layer keeps: a sliding layer its last ``sliding_window - 1``."""
        return min(length, self.shape.window - 1) if self.shape.layer_types[layer] == SLIDING else length

    def new_encoded(self, batch: int, device) -> Encoded:
        """An empty :class:`Encoded` for ``batch`` rows (each layer's K/V on the device it computes on; the rest on
        ``device``)."""
        s = self.shape
        empty = [
            torch.zeros(batch, s.kv_heads[i], 0, s.head_dims[i], dtype=self.dtype, device=self.layer_device(i))
            for i in range(s.layers)
        ]
        return Encoded(empty, [t.clone() for t in empty], torch.zeros(batch, 0, dtype=torch.bool, device=device))

    def encode(self, tokens: torch.Tensor, valid: torch.Tensor, encoded: Encoded) -> Encoded:
        """``encoded`` extended by the causal encoder over ``tokens`` [B, T] (real columns ``valid``), at the positions
        after those already encoded: sliding layers see the last ``sliding_window`` positions, pads are never seen.
        Only the K/V are kept (the encoder's hidden states are never read)."""
        s, t = self.shape, tokens.shape[1]
        start = encoded.length
        pos = torch.arange(start, start + t, device=tokens.device)  # columns (masks: pads lie left of real tokens)
        all_valid = torch.cat([encoded.valid, valid.bool()], 1)
        rope = self._rope(self.positions(all_valid)[:, start:], self.dtype)  # real tokens counted from 0
        keys, values = [], []
        h = self._embed(tokens)
        scalars = self.model.encoder.language_model.layers
        for i, layer in enumerate(self.decoder):
            stored = encoded.keys[i].shape[2]  # the last columns of those encoded (a sliding layer's window)
            key_pos = torch.arange(start - stored, start + t, device=tokens.device)
            allowed = key_pos[None, :] <= pos[:, None]
            if s.layer_types[i] == SLIDING:
                allowed = allowed & (key_pos[None, :] > pos[:, None] - s.window)
            mask = allowed[None] & all_valid[:, None, start - stored :]
            mask = mask | (key_pos[None, None, :] == pos[None, :, None])  # a pad query attends itself: no empty row
            past = (encoded.keys[i], encoded.values[i]) if stored else None
            last = i == s.layers - 1  # its K/V are all the encoder is for
            h, (k, v) = layer(h, *rope[s.layer_types[i]], past, mask[:, None], scaled=False, kv_only=last)
            h = None if last else scalars[i](h)  # the encoder's own layer_scalar
            keep = self._kept(i, start + t)
            keys.append(torch.cat([encoded.keys[i], k], 2)[:, :, stored + t - keep :])
            values.append(torch.cat([encoded.values[i], v], 2)[:, :, stored + t - keep :])
        return Encoded(keys, values, all_valid)

    def hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        attention_mask=None,
        encoded: Encoded | None = None,
        conditioning: torch.Tensor | None = None,
        columns: torch.Tensor | None = None,
        width: int | None = None,
        checks=None,
        **unused,
    ) -> Hidden:
        """The decoder over a canvas ``tokens`` [B, L] at ``positions`` [B, L], bidirectional, attending ``encoded``
        (sliding layers its last ``sliding_window - 1`` columns, full layers all; pads never); ``conditioning``: the
        self-conditioning input [B, L, d], :meth:`soft_embedding` of the previous step's processed logits (None at a
        canvas's first step: zeros); ``columns``: the
        canvas columns [B, L] the tokens stand in (what :meth:`head` is asked for; default 0 .. L - 1), in a canvas of
        ``width`` columns."""
        if encoded is None:
            raise ModelError("the DiffusionGemma decoder attends the encoder's K/V: pass encoded= (model.encode)")
        s, (b, length) = self.shape, tokens.shape
        h = self._decoder_input(tokens, conditioning)
        rope = self._rope(positions, h.dtype)
        padded = not bool(encoded.valid.all()) if checks is None else None
        for i, layer in enumerate(self.decoder):
            kept = encoded.keys[i].shape[2]
            mask = None
            if padded is None or padded:
                seen = torch.cat([encoded.valid[:, encoded.length - kept :], tokens.new_ones(b, length, dtype=bool)], 1)
                mask = seen[:, None, None, :].expand(-1, 1, length, -1)
            past = (encoded.keys[i], encoded.values[i]) if kept else None
            h, _ = layer(h, *rope[s.layer_types[i]], past, mask)
        states = self.final_norm(h).to(tokens.device)  # (a device map may have put the last layers elsewhere)
        if columns is None:
            return Hidden(states, None, length)
        if width is None:
            raise ModelError("a decoder forward given the canvas columns needs the canvas width (width=)")
        return Hidden(states, columns, width)

    def canvases_logits(
        self, clean: torch.Tensor, noisy: torch.Tensor, valid: torch.Tensor, start: int, conditioning=None
    ) -> torch.Tensor:
        """The decoder's logits [B, R, V] over every canvas of ``noisy`` [B, R] at once (the training forward): the
        noisy stand-ins for the columns ``start`` .. ``start + R`` of ``clean`` [B, T] (real columns ``valid``), in
        canvases of ``block_size`` from ``start``. Each canvas sees what its decoding sees (:meth:`encode`, then
        :meth:`hidden`): the causal encoder's K/V of the clean columns before it (a sliding layer's last
        ``sliding_window - 1``) and itself, bidirectionally; ``conditioning`` [B, R, d] is its self-conditioning input
        (None: zeros). The encoder runs over ``clean`` in the same forward, as the first half of one sequence
        ``[clean ; noisy]`` under one mask per layer type (BD3-LM's training trick, here for an encoder–decoder)."""
        s, t, r = self.shape, clean.shape[1], noisy.shape[1]
        device = clean.device
        columns = torch.arange(t, device=device)
        canvas = start + torch.div(torch.arange(r, device=device), self.block_size, rounding_mode="floor") * (
            self.block_size
        )  # each noisy column's canvas start
        encoder_keys = columns[None, :] <= columns[:, None]  # [T, T] causal
        before = columns[None, :] < canvas[:, None]  # [R, T] the clean columns before the canvas
        own = canvas[:, None] == canvas[None, :]  # [R, R] the canvas itself
        seen = torch.cat([valid.bool(), valid[:, start:].bool()], 1)[:, None, :]
        eye = torch.eye(t + r, dtype=torch.bool, device=device)[None]  # a pad query attends itself: no empty row
        masks = {}
        for kind in set(s.layer_types):
            enc, dec = encoder_keys, before
            if kind == SLIDING:
                enc = enc & (columns[None, :] > columns[:, None] - s.window)
                dec = dec & (columns[None, :] >= canvas[:, None] - (s.window - 1))
            top = torch.cat([enc, enc.new_zeros(t, r)], 1)
            masks[kind] = ((torch.cat([top, torch.cat([dec, own], 1)], 0)[None] & seen) | eye)[:, None]
        positions = self.positions(valid)
        rope = self._rope(torch.cat([positions, positions[:, start:]], 1), self.dtype)
        h = torch.cat([self._embed(clean), self._decoder_input(noisy, conditioning)], 1)
        scalars = self.model.encoder.language_model.layers
        for i, layer in enumerate(self.decoder):
            kind = s.layer_types[i]
            h, _ = layer(h, *rope[kind], None, masks[kind], scaled=False)
            h = torch.cat([scalars[i](h[:, :t]), h[:, t:] * layer.layer_scalar], 1)
        return self.project(self.final_norm(h[:, t:]))

    def soft_embedding(self, logits: torch.Tensor) -> torch.Tensor:
        """The self-conditioning input [..., d] of processed logits [..., V]: ``softmax(S) @ embedding · √d``, S cast
        to the embedding's dtype first and the softmax in float32, as transformers computes it in the decoder (here
        once, after the step that made S: a [L, d] state instead of [L, V] logits kept between steps)."""
        dtype = self.embedding.weight.dtype
        probs = F.softmax(logits.to(dtype), dim=-1, dtype=torch.float32).to(dtype)
        soft = with_weights(self.embedding, lambda p: p @ self.embedding.weight.to(p.device), probs).to(logits.device)
        return soft * torch.tensor(self.shape.hidden**0.5, dtype=dtype)

    def project(self, states: torch.Tensor) -> torch.Tensor:
        """Logits in float32, soft-capped: ``tanh(l / cap) · cap``."""
        if self.lm_head is None:  # tied: the embedding matrix (brought in where a device map offloads it)
            logits = with_weights(self.embedding, lambda x: F.linear(x, self.embedding.weight.to(x.device)), states)
        else:
            logits = self.lm_head(states)
        logits = logits.to(states.device).float()
        if self.shape.softcap:
            logits = torch.tanh(logits / self.shape.softcap) * self.shape.softcap
        return logits


def starts_at_one(model: DiffusionGemma):
    """The predicate ``random_init_(ones=...)`` takes for a model trained from scratch: its RMSNorm scales, router
    scales, per-expert scales and layer scalars start at 1 (random values there would scale whole streams)."""
    norms = {id(m.weight) for m in model.modules() if isinstance(m, Norm) and m.weight is not None}
    params = dict(model.named_parameters())
    ones = ("router.scale", "per_expert_scale", "layer_scalar")
    return lambda name: id(params[name]) in norms or name.endswith(ones)


def settle_tiny_weights(model: DiffusionGemma, scale: float = 1e-3) -> None:
    """A tiny random model's finishing touch: ``layer_scalar`` 1 (the random draw would scale whole residual streams),
    and the self-conditioning output scaled down: at O(1) random weights the block feeds each step's logits back
    strongly enough that rounding differences (a batch of another shape, another attention kernel) grow step by step
    until the tokens differ; a trained model contracts (its canvases settle)."""
    with torch.no_grad():
        model.model.decoder.self_conditioning.down_proj.weight.mul_(scale)
        for name, p in model.named_parameters():
            if name.endswith("layer_scalar"):
                p.fill_(1.0)


def tiny_diffusion_gemma_config(vocab_size, tokens, *, layers, hidden, heads, kv_heads, intermediate, max_length,
                                block_size=8, **shape):  # fmt: skip
    """A small DiffusionGemma config in the Hub's form: 4 experts, 2 per token, sliding window 8, every third layer
    full (the last one always), head_dim hidden / heads (full layers twice that, one K/V head), canvas
    ``block_size``."""
    head_dim = hidden // heads
    return {
        "model_type": "diffusion_gemma",
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "canvas_length": block_size,
        "eos_token_id": [tokens["eos_token_id"]],
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "diffusion_gemma_text",
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "global_head_dim": 2 * head_dim,
            "num_global_key_value_heads": 1,
            "layer_types": [SLIDING if (i + 1) % 3 else FULL for i in range(layers)],
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": max(hidden // 2, 8),
            "sliding_window": 8,
            "max_position_embeddings": max_length,
            "final_logit_softcapping": 30.0,
            "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh",
            "pad_token_id": tokens["pad_token_id"],
            "eos_token_id": tokens["eos_token_id"],
            "bos_token_id": tokens["bos_token_id"],
            "tie_word_embeddings": True,
        },
    }
