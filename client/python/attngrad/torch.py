"""PyTorch autograd bridge: a Gemma-3 attention layer whose forward runs locally and whose backward
runs on the attngrad service.

    import attngrad, attngrad.torch
    client = attngrad.Client("gpu-box:50051")
    attention = attngrad.torch.RemoteGemma3Attention(client, mode="return").cuda()
    out = attention(hidden_states, cos, sin)      # [B,S,3072]; cos/sin [B,S,128] (HF position_embeddings)
    loss(out).backward()                         # grad of hidden_states + weights from the service
    optimizer.step()                             # the next forward uploads the new weights

Modes:
  "return"     each backward's response carries the six weight gradients; autograd adds them into
               the parameters' .grad like any other layer's.
  "accumulate" the server adds them to its resident accumulators (no 100 MiB of weight gradients per
               backward on the wire); call attention.fetch_gradients() before optimizer.step(), or
               attention.attach(optimizer) once to have it done by a step pre-hook (PyTorch >= 2.0).

Memory saved on the trainer: RemoteAttentionBackward.forward runs under no_grad and saves only
hidden_states [B,S,H] and cos/sin [B,S,D] for the backward, i.e. (H + 2·D)·4 bytes per token, and
hidden_states is usually already kept by the layer before (a norm), so the marginal cost is ~2·D·4
bytes per token. Eager autograd of the same layer (gemma3_attention below) keeps the projections,
the normalised and rotated q/k, k and v expanded to the 24 query heads, the attention output and,
per query head, the tanh of the soft-capped scores and the softmax probabilities: measured with
saved-tensor hooks, about 27,900 + 48·S floats per token (34.1k at S=128, 40.3k at S=256), i.e.
~0.5 MB per token at S=2048 (1.04 GB for one 2048-token sequence in one layer) against 13.3 KB for the
bridge. check_autograd.py measures both with saved-tensor hooks. The local forward's transient
working set is bounded by processing one key-value head group (3 query heads) at a time.

The weights live in the module (nn.Parameters named like Hugging Face's Gemma3Attention:
q_proj.weight, k_proj.weight, v_proj.weight, o_proj.weight, q_norm.weight, k_norm.weight) and are
uploaded to the server whenever they changed since the last upload (tracked by the tensors' in-place
version counters, so after every optimizer step). Every backward names the weights version its
forward ran with, so a gradient is never computed against other weights: the server refuses with
FAILED_PRECONDITION instead. One trainer process per server layer: data-parallel ranks sharing one
server would overwrite each other's weights (give each rank its own server, or let one rank upload).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import nn

import grpc

from . import client as client_module
from .errors import AttngradError, FailedPreconditionError

__all__ = ["RemoteAttentionBackward", "RemoteGemma3Attention", "gemma3_attention",
           "rotary_tables", "fetch_all_gradients"]


def rotary_tables(position_ids: torch.Tensor, head_dim: int = 128, theta: float = 10000.0,
                  dtype=torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim] of SPEC section 3: inv_freq_i = theta^(-2i/head_dim), embedding [f, f]."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64,
                                       device=position_ids.device) / head_dim)
    freqs = position_ids.to(torch.float64)[..., None] * inv_freq
    embedding = torch.cat([freqs, freqs], dim=-1)
    return embedding.cos().to(dtype), embedding.sin().to(dtype)


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return torch.cat([-t[..., half:], t[..., :half]], dim=-1)


def gemma3_attention(hidden_states, cos, sin, q_weight, k_weight, v_weight, o_weight, q_norm_weight,
                     k_norm_weight, *, num_heads: int = 24, num_kv_heads: int = 8,
                     head_dim: int = 128, scaling: Optional[float] = None, softcap: float = 50.0,
                     eps: float = 1e-6, group_at_a_time: bool = False) -> torch.Tensor:
    """The Gemma-3 attention layer's forward of SPEC section 2 (returns A Woᵀ, [B,S,hidden]),
    differentiable with plain autograd. group_at_a_time=True computes the attention one key-value
    group at a time (less transient memory; used under no_grad by the bridge)."""
    if scaling is None:
        scaling = 1.0 / math.sqrt(head_dim)
    batch, seq_len, _ = hidden_states.shape
    group = num_heads // num_kv_heads
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, None], sin[:, None]  # [B|1,1,S,D]

    def heads(x, count):
        return x.view(batch, seq_len, count, head_dim).transpose(1, 2)  # [B,count,S,D]

    def norm_rope(x, weight):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        normed = (x * r) * (1.0 + weight)
        return normed * cos + _rotate_half(normed) * sin

    q = norm_rope(heads(hidden_states @ q_weight.t(), num_heads), q_norm_weight)
    k = norm_rope(heads(hidden_states @ k_weight.t(), num_kv_heads), k_norm_weight)
    v = heads(hidden_states @ v_weight.t(), num_kv_heads)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=hidden_states.device).triu(1)

    def attend(q_part, k_part, v_part):
        scores = (q_part @ k_part.transpose(-1, -2)) * scaling
        capped = softcap * torch.tanh(scores / softcap)
        capped = capped.masked_fill(causal, float("-inf"))
        return torch.softmax(capped, dim=-1) @ v_part

    if group_at_a_time:
        outputs = []
        for g in range(num_kv_heads):
            q_part = q[:, g * group:(g + 1) * group]                       # [B,3,S,D]
            outputs.append(attend(q_part, k[:, g:g + 1], v[:, g:g + 1]))   # broadcast over the 3
        attention = torch.cat(outputs, dim=1)
    else:
        attention = attend(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
    attention = attention.transpose(1, 2).reshape(batch, seq_len, num_heads * head_dim)
    return attention @ o_weight.t()


class _Binding:
    """What the backward needs besides tensors: the client, the scalars, the mode, and (ACCUMULATE)
    the tokens sent since the last fetch, to detect a lost accumulation window."""

    def __init__(self, client, *, config, mode: str, precision: str, scaling: float, softcap: float,
                 eps: float, wire_dtype: str):
        self.client = client
        self.config = config
        self.mode = mode
        self.precision = precision
        self.scaling, self.softcap, self.eps = scaling, softcap, eps
        self.wire_dtype = wire_dtype
        self.server_instance_id: Optional[str] = None
        self.pending_tokens = 0
        self.pending_batches = 0
        self.last_result: Optional[client_module.BackwardResult] = None


class RemoteAttentionBackward(torch.autograd.Function):
    """apply(hidden_states, cos, sin, q_w, k_w, v_w, o_w, q_norm_w, k_norm_w, binding, version):
    forward = gemma3_attention computed locally without saving activations; backward = the service."""

    @staticmethod
    def forward(ctx, hidden_states, cos, sin, q_weight, k_weight, v_weight, o_weight, q_norm_weight,
                k_norm_weight, binding: _Binding, weights_version: int):
        ctx.binding = binding
        ctx.weights_version = weights_version
        ctx.weight_meta = [(w.dtype, w.device) for w in (q_weight, k_weight, v_weight, o_weight,
                                                         q_norm_weight, k_norm_weight)]
        ctx.save_for_backward(hidden_states, cos, sin)
        config = binding.config
        compute = torch.float32
        output = gemma3_attention(
            hidden_states.to(compute), cos.to(compute), sin.to(compute), q_weight.to(compute),
            k_weight.to(compute), v_weight.to(compute), o_weight.to(compute),
            q_norm_weight.to(compute), k_norm_weight.to(compute), num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, scaling=binding.scaling,
            softcap=binding.softcap, eps=binding.eps, group_at_a_time=True)
        return output.to(hidden_states.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        hidden_states, cos, sin = ctx.saved_tensors
        binding: _Binding = ctx.binding
        batch, seq_len = hidden_states.shape[:2]
        if cos.dim() == 2:
            cos, sin = cos[None], sin[None]
        if cos.shape[0] != batch:
            cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
        result = binding.client.backward(
            hidden_states, grad_output, cos, sin, mode=binding.mode, precision=binding.precision,
            scaling=binding.scaling, softcap=binding.softcap, eps=binding.eps,
            expected_weights_version=ctx.weights_version, wire_dtype=binding.wire_dtype)
        binding.last_result = result
        if binding.server_instance_id is None:
            binding.server_instance_id = result.server_instance_id
        elif binding.server_instance_id != result.server_instance_id:
            raise AttngradError(
                grpc.StatusCode.ABORTED,
                f"the server restarted (instance {binding.server_instance_id} -> "
                f"{result.server_instance_id}): its weights and accumulated gradients are gone; "
                "re-upload the weights (module.sync_weights(force=True)) and redo the step")
        grad_hidden = result.grad_hidden_states.to(hidden_states.dtype)
        weight_grads = [None] * 6
        if binding.mode == "accumulate":
            binding.pending_tokens += batch * seq_len
            binding.pending_batches += 1
        else:
            for i, name in enumerate(client_module.WEIGHT_NAMES):
                if ctx.needs_input_grad[3 + i]:
                    dtype, device = ctx.weight_meta[i]
                    weight_grads[i] = result.weight_gradients[name].to(device=device, dtype=dtype)
        grad_hidden = grad_hidden if ctx.needs_input_grad[0] else None
        return (grad_hidden, None, None, *weight_grads, None, None)


class _Norm(nn.Module):
    """Holds a Gemma RMSNorm weight (the scale is 1 + weight) under the name `weight`."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))


class RemoteGemma3Attention(nn.Module):
    """A Gemma-3 attention layer (no KV cache; causal) whose backward runs on an attngrad server.

    Args:
      client: an attngrad.Client.
      mode: "return" or "accumulate" (see the module's docstring).
      precision: the server's precision: "auto" (fastest that meets SPEC section 4), "fp32", "tf32",
        "fp16".
      scaling, softcap, eps: None = the server's defaults (1/sqrt(head_dim), 50, 1e-6); used by the
        local forward and sent with every backward.
      wire_dtype: dtype of hidden_states/grad_output on the wire ("float32", or "float16" to halve
        the traffic when the server lists it).
      init: "random" draws the weights as in SPEC section 3 (projections randn·sqrt(2/hidden),
        norms randn·0.02); "server" leaves them zero for load_state_dict.
    forward(hidden_states [B,S,hidden], cos [B,S,D] or [S,D], sin) -> [B,S,hidden].
    """

    def __init__(self, client, *, mode: str = "return", precision: str = "auto",
                 scaling: Optional[float] = None, softcap: Optional[float] = None,
                 eps: Optional[float] = None, wire_dtype: str = "float32", init: str = "random",
                 device=None, dtype=torch.float32):
        super().__init__()
        if mode not in ("return", "accumulate"):
            raise ValueError(f"mode must be 'return' or 'accumulate', got {mode!r}")
        info = client.info()
        self.config = info
        hidden, heads, kv_heads, head_dim = (info.hidden_size, info.num_heads, info.num_kv_heads,
                                             info.head_dim)
        kwargs = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False, **kwargs)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False, **kwargs)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False, **kwargs)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False, **kwargs)
        self.q_norm = _Norm(head_dim).to(**kwargs)
        self.k_norm = _Norm(head_dim).to(**kwargs)
        if init == "random":
            self.reset_parameters()
        elif init != "server":
            raise ValueError(f"init must be 'random' or 'server', got {init!r}")
        self._binding = _Binding(
            client, config=info, mode=mode, precision=precision,
            scaling=info.default_scaling if scaling is None else scaling,
            softcap=info.default_softcap if softcap is None else softcap,
            eps=info.default_eps if eps is None else eps, wire_dtype=wire_dtype)
        self._uploaded: Optional[Tuple] = None
        self.weights_version: Optional[int] = None
        if mode == "accumulate":
            client.zero_gradients()

    @property
    def client(self):
        return self._binding.client

    @property
    def mode(self) -> str:
        return self._binding.mode

    @property
    def last_result(self) -> Optional[client_module.BackwardResult]:
        """The latest backward's BackwardResult (server timings, device, weights version)."""
        return self._binding.last_result

    def reset_parameters(self) -> None:
        hidden = self.config.hidden_size
        with torch.no_grad():
            for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
                linear.weight.normal_(0.0, math.sqrt(2.0 / hidden))
            self.q_norm.weight.normal_(0.0, 0.02)
            self.k_norm.weight.normal_(0.0, 0.02)

    def weights(self) -> Dict[str, torch.Tensor]:
        return {"q_proj": self.q_proj.weight, "k_proj": self.k_proj.weight,
                "v_proj": self.v_proj.weight, "o_proj": self.o_proj.weight,
                "q_norm": self.q_norm.weight, "k_norm": self.k_norm.weight}

    def _fingerprint(self) -> Tuple:
        return tuple((w.data_ptr(), w._version, w.dtype, w.shape) for w in self.weights().values())

    def sync_weights(self, force: bool = False) -> int:
        """Uploads the weights when they changed since the last upload; returns the server's version."""
        fingerprint = self._fingerprint()
        if force or fingerprint != self._uploaded or self.weights_version is None:
            with torch.no_grad():
                host = {name: w.detach().float().cpu() for name, w in self.weights().items()}
            expected = 0 if force or self.weights_version is None else self.weights_version
            try:
                self.weights_version = self.client.load_weights(host, expected_weights_version=expected)
            except FailedPreconditionError as error:
                raise FailedPreconditionError(
                    error.code, f"{error.message} (someone else changed this server's weights since "
                    "this module uploaded them; call sync_weights(force=True) to take them over)",
                    method="LoadWeights") from None
            self._uploaded = fingerprint
        return self.weights_version

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        version = self.sync_weights()
        w = self.weights()
        return RemoteAttentionBackward.apply(
            hidden_states, cos, sin, w["q_proj"], w["k_proj"], w["v_proj"], w["o_proj"],
            w["q_norm"], w["k_norm"], self._binding, version)

    def fetch_gradients(self, *, strict: bool = True) -> client_module.AccumulationState:
        """ACCUMULATE mode: fetches-and-zeroes the server's accumulated gradients and adds them into
        the parameters' .grad. strict: the window must cover exactly the tokens this module sent
        since the last fetch, against the weights it uploaded (else the window was lost or shared:
        FailedPreconditionError, and .grad is left untouched)."""
        if self.mode != "accumulate":
            raise RuntimeError("fetch_gradients is for mode='accumulate'; in 'return' mode the "
                               "gradients are already in .grad after backward()")
        gradients = self.client.fetch_gradients(zero_after_fetch=True)
        binding = self._binding
        state = gradients.state
        sent_tokens, sent_batches = binding.pending_tokens, binding.pending_batches
        binding.pending_tokens = binding.pending_batches = 0
        if strict:
            problems = []
            if state.tokens != sent_tokens:
                problems.append(f"it covers {state.tokens} tokens, this module sent {sent_tokens} "
                                f"in {sent_batches} backward calls")
            if sent_tokens and self.weights_version is not None and \
                    state.weights_version != self.weights_version:
                problems.append(f"it was computed against weights version {state.weights_version}, "
                                f"this module uploaded {self.weights_version}")
            if binding.server_instance_id and state.server_instance_id != binding.server_instance_id:
                problems.append(f"the server restarted ({binding.server_instance_id} -> "
                                f"{state.server_instance_id})")
            if problems:
                raise FailedPreconditionError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "the accumulation window does not match this module's backward calls: "
                    + "; ".join(problems) + ". Redo the step (the window was zeroed).",
                    method="FetchGradients")
        with torch.no_grad():
            for name, parameter in self.weights().items():
                value = torch.from_numpy(gradients[name]).to(device=parameter.device,
                                                             dtype=parameter.dtype)
                if parameter.grad is None:
                    parameter.grad = value
                else:
                    parameter.grad.add_(value)
        return state

    def attach(self, optimizer: torch.optim.Optimizer):
        """ACCUMULATE mode: fetch the gradients into .grad right before every optimizer.step()
        (a step pre-hook; PyTorch >= 2.0). Returns the hook's handle."""
        if not hasattr(optimizer, "register_step_pre_hook"):
            raise RuntimeError("optimizer step hooks need PyTorch >= 2.0: call "
                               "module.fetch_gradients() before optimizer.step() instead")
        return optimizer.register_step_pre_hook(lambda *_: self.fetch_gradients())


def fetch_all_gradients(model: nn.Module):
    """Calls fetch_gradients() on every ACCUMULATE-mode RemoteGemma3Attention inside MODEL."""
    return [m.fetch_gradients() for m in model.modules()
            if isinstance(m, RemoteGemma3Attention) and m.mode == "accumulate"]
