"""A Llama-family decoder as a plain torch module (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3, SmolLM3,
Granite 3, OLMo 2, Phi-3, Gemma 2 and 3, and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE and
gpt-oss).

The forward pass takes a flat batch of tokens from any number of sequences; where their K/V lives
is described by an `AttentionBatch`. It returns hidden states: the caller picks the positions it
samples and only those go through the final norm and LM head (`logits`).
"""

from __future__ import annotations

import contextlib
from itertools import islice

import torch
import torch.nn.functional as F
from torch import nn

from shardline.kernels.attention import AttentionBatch, paged_attention
from shardline.shard.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 like the reference implementation, then scale in the model dtype.
        if x.dtype == torch.float32:  # one fused operator instead of seven
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """Rotary embedding in the rotate-half layout, with a cos/sin table over every position.

    rotate_half(x) * sin is computed as roll(x, half) * sin', where sin' is sin with its first
    half negated: the same products, exactly (negation is exact), in two operators instead of
    four.

    A partial rotary embedding (Phi-4-mini turns 96 of a head's 128 dimensions) is the whole
    head's with a table of no rotation (cos 1, sin 0: exact) on the dimensions that do not turn,
    once q's and k's dimensions are laid out so that the turning pairs are the head's rotate-half
    pairs (`head_order`, applied to their weights' rows at load; a dot product of q and k does
    not see an order both share). So every kernel that rotates a whole head serves it.

    LongRoPE's tables (Phi-3's) are two: the short factors' rows for every position, then the
    long factors' (from row `long_rows`), which a sequence turns by throughout where its prompt
    is longer than the model's original context (shard.proto's SequenceStep.long_rope)."""

    def __init__(self, cfg: ModelConfig, local: bool = False):
        """The tables of the model's global layers, or (`local`) those of its sliding-window
        layers (Gemma 3's: their own base, no scaling)."""
        super().__init__()
        head_dim, positions = cfg.head_dim, cfg.max_position
        self.long_rows = positions if cfg.rope_long_factors and not local else 0
        rows = positions + self.long_rows
        if torch.get_default_device().type == "meta":
            # a model built to be loaded: its tables are made where it is loaded (computing them
            # on meta tensors would import torch's symbolic machinery, sympy and all: 75 MB)
            for name in ("cos", "sin"):
                self.register_buffer(name, torch.empty(rows, head_dim), persistent=False)
            return
        turned = cfg.rotary_dim or head_dim
        # as transformers computes them: 1 / (factor * theta ** (2i / d)), in fp32, then / scale
        theta = cfg.local_rope_theta if local else cfg.rope_theta
        base = theta ** (torch.arange(0, turned, 2, dtype=torch.int64).float() / turned)

        def inverse(factors: list[float]) -> torch.Tensor:  # a global layer's: by its factors, or its scale
            if factors:
                return 1.0 / (torch.tensor(factors) * base)
            return 1.0 / base if cfg.rope_scale == 1 else 1.0 / base / cfg.rope_scale

        if local:  # Gemma 3's local layers: their base alone
            inv_freqs = [1.0 / base]
        else:
            inv_freqs = [inverse(cfg.rope_factors)] + ([inverse(cfg.rope_long_factors)] if self.long_rows else [])
        at = torch.arange(positions, dtype=torch.float32)[:, None]
        emb = torch.cat([torch.cat((at * f[None, :], at * f[None, :]), dim=-1) for f in inv_freqs])
        cos, sin = emb.cos() * cfg.rope_attention_factor, emb.sin() * cfg.rope_attention_factor
        n, still = turned // 2, (head_dim - turned) // 2
        ones, zeros = torch.ones(rows, still), torch.zeros(rows, still)
        self.register_buffer("cos", torch.cat((cos[:, :n], ones, cos[:, n:], ones), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin[:, :n], zeros, sin[:, n:], zeros), dim=-1), persistent=False)

    @staticmethod
    def head_order(cfg: ModelConfig) -> list[int] | None:
        """Where each of q's and k's head dimensions comes from in a checkpoint whose heads turn
        only their first `rotary_dim` (rotate-half pairs i, i + rotary_dim/2): the turning pairs
        become the head's pairs (i, i + head_dim/2), the dimensions that stay fill the rest. None:
        every dimension turns, in the checkpoint's order."""
        turned, head_dim = cfg.rotary_dim, cfg.head_dim
        if not turned or turned == head_dim:
            return None
        n, still = turned // 2, list(range(turned, head_dim))
        half = len(still) // 2
        return [*range(n), *still[:half], *range(n, turned), *still[half:]]

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (cos, sin') [T, 1, head_dim] of the tables' rows `positions` (a position,
        or for a sequence of long factors `long_rows` past it), looked up once and shared by
        every layer."""
        return (
            self.cos.index_select(0, positions).to(dtype)[:, None, :],
            self.sin.index_select(0, positions).to(dtype)[:, None, :],
        )

    @staticmethod
    def unrotated(cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of no rotation (x * 1 + roll(x) * 0 is x exactly), for a layer that does not
        rotate (SmolLM3's) in a kernel that always does."""
        return torch.ones_like(cos_sin[0]), torch.zeros_like(cos_sin[1])

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, heads, head_dim]."""
        cos, sin = cos_sin
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_size, cfg.hidden_size, bias=cfg.output_bias)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if cfg.attention_sinks else None
        # per head (Qwen3), or across all of q's heads and all of k's (OLMo 2)
        self.qk_norm_across_heads = cfg.qk_norm_across_heads
        q_width, k_width = (q_size, kv_size) if cfg.qk_norm_across_heads else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attention_scale or self.head_dim**-0.5
        self.rotates = layer not in cfg.nope_layers
        self.window = cfg.sliding_window if layer in cfg.sliding_layers else 0  # 0: the whole context
        self.softcap = cfg.attention_softcap

    def forward(self, x, cos_sin, k_pages, v_pages, batch: AttentionBatch):
        qkv = self.wqkv(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv[:, : self.num_heads + self.num_kv_heads], qkv[:, self.num_heads + self.num_kv_heads :]
        if self.q_norm is not None:
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            if self.qk_norm_across_heads:
                q, k = self.q_norm(q.flatten(1)).view_as(q), self.k_norm(k.flatten(1)).view_as(k)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
            qk = torch.cat([q, k], 1)
        if self.rotates:  # q and k rotate as one tensor: one set of operators per layer instead of two
            qk = Rotary.apply(qk, cos_sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = paged_attention(q, k, v, k_pages, v_pages, batch, self.scale, self.window, self.sinks, self.softcap)
        return self.wo(out.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """w2(act(gate) * up), act SiLU or (Gemma's) GELU's tanh approximation; or gpt-oss's clamped
    SwiGLU, (up + 1) * gate * sigmoid(alpha * gate) with gate and up clamped to `limit`."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        bias: bool = False,
        limit: float = 0.0,
        alpha: float = 1.0,
    ):
        super().__init__()
        self.w13 = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation, self.limit, self.alpha = activation, limit, alpha

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        if self.activation == "silu":
            return self.w2(F.silu(gate) * up)
        if self.activation == "gelu_tanh":
            return self.w2(F.gelu(gate, approximate="tanh") * up)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.w2((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class MoE(nn.Module):
    """A sparse MLP: the router (`gate`) scores every expert per token, the `top_k` best run on it
    and their outputs are summed, weighted by the softmax of the scores (renormalized over the
    picked ones where `norm_topk_prob`); a `shared` expert, where there is one, runs on every
    token, weighted by a sigmoid of its own gate.

    Rows are grouped by expert, so each expert multiplies all of its rows at once (a decode step
    of 16 streams with 8 of 64 experts each: some 60 experts of about 2 rows, not 128 products of
    one row); experts go in ascending order, as the reference sums them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.experts_per_token, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.expert_bias)
        expert = dict(
            activation=cfg.mlp_activation, bias=cfg.expert_bias, limit=cfg.activation_limit, alpha=cfg.activation_alpha
        )
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.expert_intermediate_size, **expert) for _ in range(cfg.num_experts)
        )
        shared = cfg.shared_expert_intermediate_size
        self.shared = MLP(cfg.hidden_size, shared) if shared else None
        self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> each token's experts [T, top_k] and their weights [T, top_k] (x's dtype)."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x):
        experts, weights = self.route(x)
        out = torch.zeros_like(x)
        picks = experts.flatten()
        order = torch.argsort(picks, stable=True)  # (token, choice) pairs, grouped by expert
        tokens, weights = order // self.top_k, weights.flatten()[order]
        start = 0
        for expert, count in enumerate(torch.bincount(picks, minlength=len(self.experts)).tolist()):
            if count:
                rows = tokens[start : start + count]
                y = self.experts[expert](x.index_select(0, rows)) * weights[start : start + count, None]
                out.index_add_(0, rows, y)
                start += count
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out


class Block(nn.Module):
    """Attention then the MLP, each added to the residual stream: normalized before (`attn_norm`,
    `mlp_norm`: Llama's), after (`attn_out_norm`, `mlp_out_norm`: OLMo 2's) or both, and scaled
    by `residual_scale` (Granite's) before the add."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()

        def norm(present: bool):
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if present else None

        self.attn_norm, self.attn_out_norm = norm(cfg.pre_norms), norm(cfg.post_norms)
        self.attn = Attention(cfg, layer)
        self.mlp_norm, self.mlp_out_norm = norm(cfg.pre_norms), norm(cfg.post_norms)
        self.mlp = MoE(cfg) if cfg.is_sparse(layer) else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_activation)
        self.residual_scale = cfg.residual_scale

    @staticmethod
    def _normed(norm, x):
        return x if norm is None else norm(x)

    def _residual(self, norm, out):
        out = out if norm is None else norm(out)
        return out if self.residual_scale == 1 else out * self.residual_scale

    def forward(self, x, cos_sin, k_pages, v_pages, batch):
        attended = self.attn(self._normed(self.attn_norm, x), cos_sin, k_pages, v_pages, batch)
        x = x + self._residual(self.attn_out_norm, attended)
        return x + self._residual(self.mlp_out_norm, self.mlp(self._normed(self.mlp_norm, x)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.build_rotary()

    @property
    def windows(self) -> list[int]:
        """Each layer's sliding window (0: none), as this module runs its layers."""
        return [block.attn.window for block in self.layers]

    def build_rotary(self) -> None:
        """The rotary tables (on the default device): a loader builds them where the model runs,
        once its weights are in."""
        self.rotary = Rotary(self.cfg)
        self.local_rotary = Rotary(self.cfg, local=True) if self.cfg.local_rope_theta else None

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv_pages: list[tuple],
        batch: AttentionBatch,
        hidden: torch.Tensor | None = None,
        layers: slice = slice(None),
    ) -> torch.Tensor:
        """tokens, positions [T] -> hidden states [T, hidden] (before the final norm). The
        positions index the rotary tables (Rotary.at); where K/V go, `batch` says. A later
        pipeline stage, or a step that starts past the first layer (`layers`, of this module's),
        passes the hidden states going into its first layer instead of embedding tokens."""
        x = self.embed(tokens) if hidden is None else hidden
        if hidden is None and self.cfg.embedding_scale != 1:
            x = x * self.cfg.embedding_scale
        cos_sin = self.rotary.at(positions, x.dtype)
        local = cos_sin if self.local_rotary is None else self.local_rotary.at(positions, x.dtype)
        windowed = batch.windowed or batch
        # islice, not self.layers[layers]: slicing a ModuleList builds a new one (70 us a step)
        for layer, (k_pages, v_pages) in islice(zip(self.layers, kv_pages), layers.start, layers.stop):
            if layer.attn.window:
                x = layer(x, local, k_pages, v_pages, windowed)
            else:
                x = layer(x, cos_sin, k_pages, v_pages, batch)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden)).float()
        if self.cfg.logit_scale != 1:
            logits = logits / self.cfg.logit_scale
        if cap := self.cfg.final_logit_softcap:
            logits = torch.tanh(logits / cap) * cap
        return logits


@contextlib.contextmanager
def uninitialized():
    """Modules built inside leave their weights uninitialized (every one is loaded right after):
    torch.nn.init's random fills cost seconds on a large model, and on the meta device they load
    torch's compiler (2 s of a tiny model's start, and 75 MB that stay resident)."""
    inits = {name: getattr(nn.init, name) for name in ("normal_", "uniform_", "kaiming_uniform_")}
    for name in inits:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, init in inits.items():
            setattr(nn.init, name, init)
