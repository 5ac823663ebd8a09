"""A stand-in for transformers' Gemma-3 text model, for the offload tests where transformers is not
installed: the same module tree and attribute names (model.model.layers[i].self_attn with q_proj,
k_proj, v_proj, o_proj, q_norm, k_norm, layer_idx, head_dim, scaling, is_sliding, sliding_window,
attn_logit_softcapping, config) and the same arithmetic (Gemma RMSNorm with 1 + weight, rotate-half
RoPE with a local and a global base, causal or sliding-window attention where key j is seen by
query i when i - window < j <= i, the attention called with keyword arguments as transformers'
decoder layer calls it), in plain PyTorch."""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

import torch
from torch import nn


@dataclasses.dataclass
class StandInConfig:
    vocab_size: int = 64
    hidden_size: int = 640
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 256
    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 4
    layer_types: Optional[List[str]] = None
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rms_norm_eps: float = 1e-6
    attn_logit_softcapping: Optional[float] = None

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                for i in range(self.num_hidden_layers)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: StandInConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = config.query_pre_attn_scalar ** -0.5
        self.attn_logit_softcapping = config.attn_logit_softcapping
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if self.is_sliding else None
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None,
                past_key_values=None, cache_position=None, **kwargs):
        batch, seq_len, _ = hidden_states.shape

        def heads(x, count):
            return x.view(batch, seq_len, count, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        cos, sin = cos[:, None], sin[:, None]
        q = self.q_norm(heads(self.q_proj(hidden_states), self.num_heads))
        k = self.k_norm(heads(self.k_proj(hidden_states), self.num_kv_heads))
        v = heads(self.v_proj(hidden_states), self.num_kv_heads)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.scaling
        if self.attn_logit_softcapping:
            scores = torch.tanh(scores / self.attn_logit_softcapping) * self.attn_logit_softcapping
        i = torch.arange(seq_len)[:, None]
        j = torch.arange(seq_len)[None, :]
        masked = j > i
        if self.sliding_window:
            masked = masked | (j <= i - self.sliding_window)
        scores = scores.masked_fill(masked, float("-inf"))
        attention = torch.softmax(scores.float(), dim=-1).type_as(q) @ v
        attention = attention.transpose(1, 2).reshape(batch, seq_len, -1)
        return self.o_proj(attention), None


class DecoderLayer(nn.Module):
    def __init__(self, config: StandInConfig, layer_idx: int):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size,
                                           bias=False),
                                 nn.GELU(approximate="tanh"),
                                 nn.Linear(config.intermediate_size, config.hidden_size,
                                           bias=False))

    def forward(self, hidden_states, position_embeddings_global, position_embeddings_local):
        sliding = self.attention_type == "sliding_attention"
        attention, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings_local if sliding
            else position_embeddings_global,
            attention_mask=None, past_key_values=None)
        hidden_states = hidden_states + self.post_attention_layernorm(attention)
        return hidden_states + self.mlp(hidden_states)


def rope(position_ids, head_dim: int, base: float, dtype):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = position_ids.to(torch.float64)[..., None] * inv_freq
    embedding = torch.cat((freqs, freqs), dim=-1)
    return embedding.cos().to(dtype), embedding.sin().to(dtype)


class TextModel(nn.Module):
    def __init__(self, config: StandInConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids):
        batch, seq_len = input_ids.shape
        hidden = self.embed_tokens(input_ids) * math.sqrt(self.config.hidden_size)
        positions = torch.arange(seq_len).expand(batch, seq_len)
        dtype = hidden.dtype
        global_rope = rope(positions, self.config.head_dim, self.config.rope_theta, dtype)
        local_rope = rope(positions, self.config.head_dim, self.config.rope_local_base_freq, dtype)
        for layer in self.layers:
            hidden = layer(hidden, global_rope, local_rope)
        return self.norm(hidden)


class CausalLM(nn.Module):
    """model.model.layers[i].self_attn, as Gemma3ForCausalLM; forward(input_ids) -> logits."""

    def __init__(self, config: StandInConfig):
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))

    def loss(self, input_ids):
        logits = self(input_ids)[:, :-1]
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           input_ids[:, 1:].reshape(-1))


def randomize(model: nn.Module, seed: int) -> None:
    """Every parameter drawn from a seeded normal (norm weights small, so 1 + w stays near 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            scale = 0.1 if parameter.dim() == 1 else 1.0 / math.sqrt(parameter.shape[-1])
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
