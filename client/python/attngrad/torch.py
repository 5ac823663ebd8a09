"""PyTorch autograd bridge: a Gemma-3 attention layer whose forward runs locally and whose backward
runs on the attngrad service.

    import attngrad, attngrad.torch
    client = attngrad.Client("gpu-box:50051")
    attention = attngrad.torch.RemoteGemma3Attention(client, mode="return").cuda()
    # [B,S,3072]; cos/sin [B,S,128] (transformers' position_embeddings)
    out = attention(hidden_states, cos, sin)
    loss(out).backward()                         # grad of hidden_states + weights from the service
    optimizer.step()                             # the next backward uploads the new weights

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
~0.5 MB per token at S=2048 (1.04 GB for one 2048-token sequence in one layer) against 13.3 KB for
the bridge. check_autograd.py measures both with saved-tensor hooks. The local forward's transient
working set is bounded by processing one key-value head group (3 query heads) at a time.

The weights live in the module (nn.Parameters named like Hugging Face's Gemma3Attention:
q_proj.weight, k_proj.weight, v_proj.weight, o_proj.weight, q_norm.weight, k_norm.weight) and are
uploaded to the server whenever they changed since the last upload (tracked by the tensors' in-place
version counters, so after every optimizer step), by the backward that needs them: the forward
makes no remote call. Every backward names the weights version its
forward ran with, so a gradient is never computed against other weights: the server refuses with
FAILED_PRECONDITION instead. One trainer process per server layer: data-parallel ranks sharing one
server would overwrite each other's weights (give each rank its own server, or let one rank upload).
"""
from __future__ import annotations

import inspect
import math
import os
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

import grpc

from . import client as client_module
from . import sharded as sharded_module
from .errors import AttngradError, FailedPreconditionError

__all__ = ["RemoteAttentionBackward", "RemoteGemma3Attention", "gemma3_attention",
           "rotary_tables", "fetch_all_gradients", "offload", "OffloadHandle",
           "attention_modules"]


def rotary_tables(position_ids: torch.Tensor, head_dim: int = 128, theta: float = 10000.0,
                  dtype=torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim] of SPEC section 3: inv_freq_i = theta^(-2i/head_dim), embedding
    [f, f]."""
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
    """What the backward needs besides tensors: the client, the scalars, the mode, the layer and
    (ACCUMULATE) the tokens sent since the last fetch, to detect a lost accumulation window."""

    def __init__(self, client, *, config, mode: str, precision: str, scaling: float, softcap: float,
                 eps: float, wire_dtype: str, layer: Optional[int] = None,
                 sliding_window: Optional[int] = None, input_dtype: Optional[str] = None,
                 transport: str = "auto", stream_ordered: bool = True,
                 server_forward: Optional[bool] = None):
        if transport not in client_module.TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(client_module.TRANSPORTS)}, "
                             f"got {transport!r}")
        self.client = client
        self.transport = transport  # Client.backward's and Client.load_weights' transport
        # CUDA IPC calls queued on the trainer's stream (Client.submit_backward) instead of
        # answered before backward() goes on.
        self.stream_ordered = bool(stream_ordered)
        # The forward computed by the server too (Client.forward / submit_forward), not locally.
        self.server_forward = os.environ.get("ATTNGRAD_SERVER_FORWARD") == "1" \
            if server_forward is None else bool(server_forward)
        self._sender_uploads: Optional[bool] = None  # decided at the first use (sender_uploads)
        self.config = config
        self.mode = mode
        self.precision = precision
        self.scaling, self.softcap, self.eps = scaling, softcap, eps
        self.wire_dtype = wire_dtype
        self.input_dtype = input_dtype
        self.layer = layer
        self.sliding_window = sliding_window
        self.server_instance_id: Optional[str] = None
        self.pending_tokens = 0
        self.pending_batches = 0
        self.last_result: Optional[client_module.BackwardResult] = None

    @property
    def sender_uploads(self) -> bool:
        """With stream-ordered calls: changed weights are uploaded by the client's sender thread
        (queued by the forward, Client.submit_after_stream) instead of by the backward's thread
        before its call. On by default where the client orders the calls on the GPU
        (Client.orders_on_gpu): the backward's thread must then never synchronise the stream,
        which an upload there does. ATTNGRAD_SENDER_UPLOADS=1 or 0 forces it on or off. Decided
        at the first use, so that a forward and its backward agree."""
        if self._sender_uploads is None:
            forced = os.environ.get("ATTNGRAD_SENDER_UPLOADS")
            orders_on_gpu = getattr(self.client, "orders_on_gpu", None)
            if not self.stream_ordered:
                self._sender_uploads = False
            elif forced in ("0", "1"):
                self._sender_uploads = forced == "1"
            else:
                self._sender_uploads = orders_on_gpu is not None and \
                    bool(orders_on_gpu(layer=self.layer))
        return self._sender_uploads


def _remote_backward(binding: _Binding, hidden_states, cos, sin, grad_output, weights,
                     weight_meta, needs_weight_grads):
    """The backward of one attention call on the server: (grad of hidden_states in its dtype, the
    six weight gradients (RETURN mode, those in NEEDS_WEIGHT_GRADS; else None) in the weights'
    dtypes and devices). WEIGHTS: the weights version to pin (an int) or the forward's
    _PinnedWeights. Shared by every autograd Function of this module."""
    batch, seq_len = hidden_states.shape[:2]
    cos, sin = _tables_for(batch, cos, sin)
    arguments = _call_arguments(binding, hidden_states)
    arguments["mode"] = binding.mode
    if _queued_on_stream(binding, "submit_backward"):
        arguments["expected_weights_version"] = _version_to_pin(binding, weights, queued=True)
        answer = _submit_on_stream(binding, hidden_states, grad_output, cos, sin, arguments)
    else:
        arguments["expected_weights_version"] = _version_to_pin(binding, weights, queued=False)
        answer = binding.client.backward(hidden_states, grad_output, cos, sin, **arguments)
        _record_result(binding, answer)
    grad_hidden = answer.grad_hidden_states.to(hidden_states.dtype)
    weight_grads = [None] * 6
    if binding.mode == "accumulate":
        binding.pending_tokens += batch * seq_len
        binding.pending_batches += 1
    else:
        for i, name in enumerate(client_module.WEIGHT_NAMES):
            if needs_weight_grads[i]:
                dtype, device = weight_meta[i]
                weight_grads[i] = answer.weight_gradients[name].to(device=device, dtype=dtype)
    return grad_hidden, weight_grads


def _remote_forward(binding: _Binding, hidden_states, cos, sin, weights) -> torch.Tensor:
    """The layer's output computed by the server with the forward's weights (WEIGHTS, as for
    _remote_backward), in hidden_states' dtype. Queued on the trainer's stream where the backward
    would be (Client.submit_forward): the output tensor is returned at once, and a failed call is
    raised by the end of the loss.backward() that follows (Client.wait_submitted)."""
    cos, sin = _tables_for(hidden_states.shape[0], cos, sin)
    arguments = _call_arguments(binding, hidden_states)
    if "input_dtype" in arguments:
        arguments["response_dtype"] = arguments["input_dtype"]  # the model's own dtype
    if _queued_on_stream(binding, "submit_forward"):
        arguments["expected_weights_version"] = _version_to_pin(binding, weights, queued=True)
        pending = binding.client.submit_forward(hidden_states, cos, sin, **arguments)
        if pending.done():
            pending.result()  # answered already (another transport): report it now
        output = pending.output
    else:
        arguments["expected_weights_version"] = _version_to_pin(binding, weights, queued=False)
        output = binding.client.forward(hidden_states, cos, sin, **arguments).output
    return output.to(hidden_states.dtype)


def _tables_for(batch: int, cos, sin):
    """COS, SIN as [B,S,D] views (a [S,D] or [1,S,D] table is broadcast over the batch)."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if cos.shape[0] != batch:
        cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
    return cos, sin


def _call_arguments(binding: _Binding, hidden_states) -> Dict:
    """The keyword arguments of a forward or backward call that the binding fixes."""
    extra = {}
    if binding.layer is not None:
        extra["layer"] = binding.layer
    if binding.sliding_window is not None:
        extra["sliding_window"] = binding.sliding_window
    if binding.input_dtype is not None:
        extra["input_dtype"] = binding.input_dtype
    elif hidden_states.dtype in (torch.bfloat16, torch.float16):
        # The activations travel in the model's own dtype (half the bytes of float32).
        extra["input_dtype"] = str(hidden_states.dtype).replace("torch.", "")
    return dict(precision=binding.precision, scaling=binding.scaling, softcap=binding.softcap,
                eps=binding.eps, wire_dtype=binding.wire_dtype, transport=binding.transport,
                **extra)


def _queued_on_stream(binding: _Binding, method: str) -> bool:
    return binding.stream_ordered and hasattr(binding.client, method)


def _version_to_pin(binding: _Binding, weights, queued: bool):
    """A call's expected_weights_version: WEIGHTS itself (an int), or the server's version of the
    forward's _PinnedWeights, uploaded now or, for a call QUEUED on the stream with sender
    uploads, a callable the client calls once the queued uploads have run."""
    if isinstance(weights, int):
        return weights
    if queued and binding.sender_uploads:
        return lambda ordered: weights.version(synchronize=not ordered)
    return weights.version()


def _submit_on_stream(binding: _Binding, hidden_states, grad_output, cos, sin, arguments):
    """Client.submit_backward: the call queued on the current CUDA stream; its answer's tensors
    are returned at once, and the end of this loss.backward() waits for every queued call (their
    errors are raised there, from backward())."""
    pending = binding.client.submit_backward(
        hidden_states, grad_output, cos, sin,
        on_result=lambda result: _record_result(binding, result), **arguments)
    if pending.done():
        pending.result()  # answered already (another transport): report it now
    else:
        torch.autograd.Variable._execution_engine.queue_callback(binding.client.wait_submitted)
    return pending


def _record_result(binding: _Binding, result) -> None:
    """Keeps RESULT as the binding's last and refuses the answer of a restarted server."""
    binding.last_result = result
    if binding.server_instance_id is None:
        binding.server_instance_id = result.server_instance_id
    elif binding.server_instance_id != result.server_instance_id:
        raise AttngradError(
            grpc.StatusCode.ABORTED,
            f"the server restarted (instance {binding.server_instance_id} -> "
            f"{result.server_instance_id}): its weights and accumulated gradients are gone; "
            "re-upload the weights (sync_weights(force=True)) and redo the step")


def _upload_weights(binding: _Binding, weights: Dict[str, torch.Tensor], synchronize: bool = True,
                    **kwargs) -> int:
    """Client.load_weights of a layer's six parameters with the binding's transport: by reference
    (CUDA IPC or shared memory, in the parameters' own dtype) on the same host, else as float32
    bytes. Returns the server's new weights version. SYNCHRONIZE False (the stream-ordered
    sender, which must launch nothing that waits on the trainer's stream): CUDA IPC only, no
    synchronisation and no host copy."""
    with torch.no_grad():
        transport = binding.transport
        if transport == "bytes":
            weights = {name: w.detach().float().cpu() for name, w in weights.items()}
        else:
            weights = {name: w.detach() for name, w in weights.items()}
        if not synchronize:
            transport = "cuda_ipc"
        return binding.client.load_weights(weights, transport=transport, synchronize=synchronize,
                                           **kwargs)


class _PinnedWeights:
    """The weights a forward computed with, uploaded only when needed, never by the forward.

    The forward records the weights' fingerprint (storage, in-place version counter, dtype,
    shape) and makes no remote call and no GPU synchronisation. With sender uploads
    (_Binding.sender_uploads) it queues the upload of changed weights
    (Client.submit_after_stream): the client's sender thread uploads them as soon as the stream
    has passed this point (the optimizer step's writes are done), while the GPU computes the
    forward. Otherwise the backward uploads them. OWNER has
    fingerprint(), needs_upload(fingerprint), sync_weights(synchronize=...) -> the server's
    version, upload_queued_for (the fingerprint of a queued upload) and upload_group (the
    layers offloaded together, in forward order; or None). The first forward after an optimizer
    step queues the changed weights of every later layer of its group too, so that the later
    layers' calls wait for no upload of their own."""

    def __init__(self, owner, binding: "_Binding", sample):
        self.owner = owner
        self.fingerprint = owner.fingerprint()
        if not binding.sender_uploads:
            return
        _queue_upload(owner, binding, sample, self.fingerprint)
        group = getattr(owner, "upload_group", None) or ()
        for later in group[group.index(owner) + 1:] if owner in group else ():
            _queue_upload(later, later.binding, sample, later.fingerprint())

    def version(self, synchronize: bool = True) -> int:
        """The server's version of exactly the forward's weights (uploaded now if they changed
        since the last upload; SYNCHRONIZE False when the stream's earlier writes are known to
        be done). Weights changed in place between the forward and its backward are refused, as
        autograd refuses a saved tensor changed in place."""
        if self.owner.fingerprint() != self.fingerprint:
            raise RuntimeError(
                "attngrad: one of the attention weights was modified in place (or replaced) "
                "between the forward and its backward; the backward must see the forward's "
                "weights (run optimizer.step() after backward())")
        return self.owner.sync_weights(synchronize=synchronize)


def _queue_upload(owner, binding: "_Binding", sample, fingerprint: Tuple) -> None:
    """Queues OWNER's upload in the client's sender thread (Client.submit_after_stream, in the
    order of SAMPLE's stream) unless its weights are uploaded or queued as FINGERPRINT already."""
    if owner.upload_queued_for == fingerprint or not owner.needs_upload(fingerprint):
        return
    queue = getattr(binding.client, "submit_after_stream", None)
    if queue is not None and queue(sample, lambda: owner.sync_weights(synchronize=False),
                                   layer=binding.layer) is not None:
        owner.upload_queued_for = fingerprint


def _weights_fingerprint(weights: Dict[str, torch.Tensor]) -> Tuple:
    return tuple((w.data_ptr(), w._version, w.dtype, tuple(w.shape)) for w in weights.values())


def _keep_for_backward(ctx, binding: _Binding, weights, hidden_states, cos, sin, parameters):
    """What RemoteAttentionBackward.backward reads: the binding, the forward's weights, the six
    PARAMETERS' dtypes and devices, and the saved inputs."""
    ctx.binding = binding
    ctx.weights = weights
    ctx.weight_meta = [(w.dtype, w.device) for w in parameters]
    ctx.save_for_backward(hidden_states, cos, sin)


class RemoteAttentionBackward(torch.autograd.Function):
    """apply(hidden_states, cos, sin, q_w, k_w, v_w, o_w, q_norm_w, k_norm_w, binding, weights):
    forward = gemma3_attention computed locally without saving activations; backward = the
    service. WEIGHTS: the server's weights version to pin (an int), or the forward's
    _PinnedWeights (uploaded at the backward when they changed)."""

    @staticmethod
    def forward(ctx, hidden_states, cos, sin, q_weight, k_weight, v_weight, o_weight, q_norm_weight,
                k_norm_weight, binding: _Binding, weights):
        _keep_for_backward(ctx, binding, weights, hidden_states, cos, sin,
                           (q_weight, k_weight, v_weight, o_weight, q_norm_weight, k_norm_weight))
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
        grad_hidden, weight_grads = _remote_backward(
            ctx.binding, hidden_states, cos, sin, grad_output, ctx.weights,
            ctx.weight_meta, ctx.needs_input_grad[3:9])
        grad_hidden = grad_hidden if ctx.needs_input_grad[0] else None
        return (grad_hidden, None, None, *weight_grads, None, None)


class RemoteAttention(RemoteAttentionBackward):
    """apply(...) as RemoteAttentionBackward's, with the forward computed by the server too
    (_remote_forward): the trainer runs no attention kernel at all."""

    @staticmethod
    def forward(ctx, hidden_states, cos, sin, q_weight, k_weight, v_weight, o_weight, q_norm_weight,
                k_norm_weight, binding: _Binding, weights):
        _keep_for_backward(ctx, binding, weights, hidden_states, cos, sin,
                           (q_weight, k_weight, v_weight, o_weight, q_norm_weight, k_norm_weight))
        return _remote_forward(binding, hidden_states, cos, sin, weights)


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
      transport: "auto" (default), "cuda_ipc", "shm" or "bytes": how activations, weights and
        (RETURN) weight gradients travel (Client.backward, Client.load_weights). "auto" on a
        server of this host: CUDA tensors over CUDA IPC (the server computes straight from the
        trainer's GPU memory and copies the weights on the GPU), CPU ones through shared memory;
        else bytes. last_result.transport says which carried the latest backward.
      zero_copy: the former switch: True = transport "auto", False = "bytes".
      stream_ordered: True (default): CUDA IPC backward calls are queued on the trainer's CUDA
        stream (Client.submit_backward): backward() goes on launching kernels while the server
        computes, and the stream waits for the answer; the calls' errors are raised at the end of
        loss.backward(). Changed weights are then uploaded by the client's sender thread while
        the forward runs where the calls are GPU-ordered (Client.orders_on_gpu,
        ATTNGRAD_GPU_ORDERED=1), or with ATTNGRAD_SENDER_UPLOADS=1. False: each call is answered
        before backward() goes on.
      server_forward: the forward is computed by the server too (Client.forward, queued on the
        trainer's stream like the backward), not locally. None (default): on where
        $ATTNGRAD_SERVER_FORWARD is "1". The server's precision applies to the forward as to
        the backward.
    forward(hidden_states [B,S,hidden], cos [B,S,D] or [S,D], sin) -> [B,S,hidden].
    """

    def __init__(self, client, *, mode: str = "return", precision: str = "auto",
                 scaling: Optional[float] = None, softcap: Optional[float] = None,
                 eps: Optional[float] = None, wire_dtype: str = "float32", init: str = "random",
                 device=None, dtype=torch.float32, transport: str = "auto",
                 zero_copy: Optional[bool] = None, stream_ordered: bool = True,
                 server_forward: Optional[bool] = None):
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
            eps=info.default_eps if eps is None else eps, wire_dtype=wire_dtype,
            transport=transport if zero_copy is None else ("auto" if zero_copy else "bytes"),
            stream_ordered=stream_ordered, server_forward=server_forward)
        self._uploaded: Optional[Tuple] = None
        self.upload_queued_for: Optional[Tuple] = None  # the fingerprint a queued upload sends
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

    def fingerprint(self) -> Tuple:
        """The weights' identity and in-place version counters (they move with every optimizer
        step)."""
        return _weights_fingerprint(self.weights())

    def needs_upload(self, fingerprint: Tuple) -> bool:
        return fingerprint != self._uploaded or self.weights_version is None

    def sync_weights(self, force: bool = False, synchronize: bool = True) -> int:
        """Uploads the weights when they changed since the last upload; returns the server's
        version. synchronize=False: the writes to them are known to be done."""
        fingerprint = self.fingerprint()
        if force or self.needs_upload(fingerprint):
            expected = 0 if force or self.weights_version is None else self.weights_version
            try:
                self.weights_version = _upload_weights(self._binding, self.weights(),
                                                       synchronize=synchronize,
                                                       expected_weights_version=expected)
            except FailedPreconditionError as error:
                raise FailedPreconditionError(
                    error.code, f"{error.message} (someone else changed this server's weights "
                    "since this module uploaded them; call sync_weights(force=True) to take them "
                    "over)",
                    method="LoadWeights") from None
            self._uploaded = fingerprint
        return self.weights_version

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        w = self.weights()
        function = RemoteAttention if self._binding.server_forward and torch.is_grad_enabled() \
            else RemoteAttentionBackward
        return function.apply(
            hidden_states, cos, sin, w["q_proj"], w["k_proj"], w["v_proj"], w["o_proj"],
            w["q_norm"], w["k_norm"], self._binding,
            _PinnedWeights(self, self._binding, hidden_states))

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
            if binding.server_instance_id and \
                    state.server_instance_id != binding.server_instance_id:
                problems.append(f"the server restarted ({binding.server_instance_id} -> "
                                f"{state.server_instance_id})")
            if problems:
                raise FailedPreconditionError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "the accumulation window does not match this module's backward calls: "
                    + "; ".join(problems) + ". Redo the step (the window was zeroed).",
                    method="FetchGradients")
        with torch.no_grad():
            _add_into_grads(self.weights(), gradients)
        return state

    def attach(self, optimizer: torch.optim.Optimizer):
        """ACCUMULATE mode: fetch the gradients into .grad right before every optimizer.step()
        (a step pre-hook; PyTorch >= 2.0). Returns the hook's handle."""
        if not hasattr(optimizer, "register_step_pre_hook"):
            raise RuntimeError("optimizer step hooks need PyTorch >= 2.0: call "
                               "module.fetch_gradients() before optimizer.step() instead")
        return optimizer.register_step_pre_hook(_step_pre_hook(self.fetch_gradients))


class _FetchStaging:
    """Page-locked host buffers, one per (layer, weight) of parameters on a GPU, that a fetch's
    chunks are decoded straight into (Client.fetch_layers(into=...)) and copied to the GPU from
    without waiting; reused by the next fetch once those copies are done."""

    def __init__(self, parameter_of):
        self._parameter_of = parameter_of  # (layer, name) -> the parameter
        self._buffers: Dict[Tuple[int, str], torch.Tensor] = {}
        self._copied: Optional[torch.cuda.Event] = None

    def into(self, layer: int, name: str, count: int):
        parameter = self._parameter_of(layer, name)
        if not parameter.is_cuda:
            return None
        if self._copied is not None:  # the previous fetch's copies still read the buffers
            self._copied.synchronize()
            self._copied = None
        buffer = self._buffers.get((layer, name))
        if buffer is None or buffer.numel() != count:
            buffer = torch.empty(count, dtype=torch.float32, pin_memory=True)
            self._buffers[(layer, name)] = buffer
        return buffer.numpy()

    def copies_queued(self) -> None:
        """Marks the point on the current stream after which the buffers are free again."""
        if self._buffers and torch.cuda.is_available():
            self._copied = torch.cuda.Event()
            self._copied.record()


def _add_into_grads(parameters: Dict[str, torch.Tensor], gradients) -> None:
    """Adds fetched sums (GRADIENTS[name]: fp32 NumPy arrays the client decoded the stream into)
    into the parameters' .grad, as autograd would: one copy to the parameter's device and dtype,
    no intermediate host copy."""
    for name, parameter in parameters.items():
        value = gradients[name]
        if not isinstance(value, torch.Tensor):  # decoded from the stream
            value = torch.from_numpy(value)
        value = value.to(device=parameter.device, dtype=parameter.dtype, non_blocking=True)
        if parameter.grad is None:
            parameter.grad = value
        else:
            parameter.grad.add_(value)


def _step_pre_hook(fetch):
    """An optimizer step pre-hook that runs FETCH. It returns None: PyTorch takes a pre-hook's
    non-None result as replacement (args, kwargs) of step(), and refuses anything else."""

    def hook(optimizer, args, kwargs) -> None:
        fetch()

    return hook


def fetch_all_gradients(model: nn.Module):
    """Calls fetch_gradients() on every ACCUMULATE-mode RemoteGemma3Attention inside MODEL."""
    return [m.fetch_gradients() for m in model.modules()
            if isinstance(m, RemoteGemma3Attention) and m.mode == "accumulate"]


# ------------------------------------------------------------------------------------------------
# One call for a whole transformers Gemma-3 model


_WEIGHT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def _is_attention(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in _WEIGHT_MODULES) and hasattr(module, "layer_idx")


def attention_modules(model: nn.Module) -> Dict[int, nn.Module]:
    """{layer_idx: attention module} of every Gemma-3 attention in MODEL (a module with q_proj,
    k_proj, v_proj, o_proj, q_norm, k_norm and layer_idx: transformers' Gemma3Attention, found
    under Gemma3ForCausalLM.model.layers[i].self_attn, Gemma3TextModel.layers[i].self_attn, ...)."""
    found: Dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if not _is_attention(module):
            continue
        index = int(module.layer_idx)
        if index in found:
            raise ValueError(f"two attention modules claim layer_idx {index} ({name})")
        found[index] = module
    if not found:
        raise ValueError("no Gemma-3 attention modules (q_proj ... k_norm and layer_idx) in the "
                         "model")
    return dict(sorted(found.items()))


def _layer_scalars(module: nn.Module, index: int) -> Tuple[float, float, float, int]:
    """(scaling, softcap (0 = none), eps, sliding window (0 = full causal)) of the module's
    forward, from the module and its config as transformers' Gemma3Attention defines them."""
    config = getattr(module, "config", None)
    scaling = getattr(module, "scaling", None)
    if scaling is None:
        scaling = float(getattr(config, "query_pre_attn_scalar", module.head_dim)) ** -0.5
    softcap = getattr(module, "attn_logit_softcapping", getattr(config, "attn_logit_softcapping",
                                                                None))
    norm = module.q_norm
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", getattr(config, "rms_norm_eps",
                                                                         1e-6)))
    sliding = getattr(module, "is_sliding", None)
    if sliding is None:
        layer_types = getattr(config, "layer_types", None)
        sliding = bool(layer_types) and layer_types[index] == "sliding_attention"
    window = 0
    if sliding:
        window = int(getattr(module, "sliding_window", None) or getattr(config, "sliding_window", 0)
                     or 0)
    return float(scaling), float(softcap or 0.0), float(eps), window


class _OffloadedLayer:
    """One attention module whose backward runs on the server: its binding, the weights version
    uploaded last, and its original forward (restored by remove())."""

    def __init__(self, module: nn.Module, index: int, binding: _Binding, upload_weights: bool):
        self.module = module
        self.index = index
        self.binding = binding
        self.upload_weights = upload_weights
        self.weights_version: Optional[int] = None
        self._uploaded: Optional[Tuple] = None
        self.upload_queued_for: Optional[Tuple] = None  # the fingerprint a queued upload sends
        self.upload_group: Optional[List["_OffloadedLayer"]] = None  # set by offload()
        self.original_forward = module.forward
        self.had_instance_forward = "forward" in module.__dict__
        self.signature = inspect.signature(self.original_forward)
        self.hidden_name = next(iter(self.signature.parameters))  # hidden_states

    def weights(self) -> Dict[str, torch.Tensor]:
        return {name: getattr(self.module, name).weight for name in _WEIGHT_MODULES}

    def needs_upload(self, fingerprint: Tuple) -> bool:
        return self.upload_weights and (fingerprint != self._uploaded
                                        or self.weights_version is None)

    def sync_weights(self, force: bool = False, synchronize: bool = True) -> int:
        """Uploads the layer's weights when they changed since the last upload (the tensors'
        in-place version counters move with every optimizer step); returns the server's version.
        upload_weights=False: the server's current version (it must already hold these weights).
        synchronize=False: the writes to the weights are known to be done."""
        if not self.upload_weights:
            if self.weights_version is None:
                self.weights_version = self._server_version()
            return self.weights_version
        weights = self.weights()
        fingerprint = _weights_fingerprint(weights)
        if force or self.needs_upload(fingerprint):
            self.weights_version = _upload_weights(self.binding, weights, synchronize=synchronize,
                                                   layer=self.index)
            self._uploaded = fingerprint
        return self.weights_version

    def fingerprint(self) -> Tuple:
        return _weights_fingerprint(self.weights())

    def _server_version(self) -> int:
        for layer in self.binding.client.info().layers:
            if layer.index == self.index:
                return layer.weights_version
        return 0

    def forward(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        arguments = bound.arguments
        hidden_states = arguments[self.hidden_name]
        position_embeddings = arguments.get("position_embeddings")
        if position_embeddings is None:
            position_embeddings = arguments.get("kwargs", {}).get("position_embeddings")
        weights = self.weights()
        wants_grad = torch.is_grad_enabled() and (
            hidden_states.requires_grad or any(w.requires_grad for w in weights.values()))
        if not wants_grad:
            return self.original_forward(*args, **kwargs)
        if position_embeddings is None:
            raise ValueError(f"layer {self.index}: the offloaded attention needs "
                             "position_embeddings (cos, sin), as transformers' Gemma-3 decoder "
                             "layers pass them")
        for name in ("past_key_values", "past_key_value"):
            cache = arguments.get(name, arguments.get("kwargs", {}).get(name))
            length = cache.get_seq_length(self.index) if hasattr(cache, "get_seq_length") else 0
            if length:
                raise ValueError(f"layer {self.index}: a KV cache holding {length} earlier tokens; "
                                 "the offloaded backward covers the tokens of this call only "
                                 "(train with use_cache=False)")
        cos, sin = position_embeddings
        if self._forward_on_server(arguments):
            # transformers' Gemma3Attention returns (output, attention weights); none are made.
            return RemoteAttention.apply(
                hidden_states, cos, sin, weights["q_proj"], weights["k_proj"], weights["v_proj"],
                weights["o_proj"], weights["q_norm"], weights["k_norm"], self.binding,
                _PinnedWeights(self, self.binding, hidden_states)), None
        call = _Call(self, bound)
        output = _OffloadedAttention.apply(
            hidden_states, cos, sin, weights["q_proj"], weights["k_proj"], weights["v_proj"],
            weights["o_proj"], weights["q_norm"], weights["k_norm"], call,
            _PinnedWeights(self, self.binding, hidden_states))
        if call.rest is None:
            return output
        return (output,) + call.rest

    def _forward_on_server(self, arguments) -> bool:
        """Whether this call's forward is the server's (_Binding.server_forward): not where the
        module's own forward does more than the layer's output (a KV cache to fill, attention
        weights asked for, dropout in training)."""
        if not self.binding.server_forward:
            return False
        extra = arguments.get("kwargs", {})
        if any(arguments.get(name, extra.get(name)) is not None
               for name in ("past_key_values", "past_key_value")):
            return False
        if arguments.get("output_attentions", extra.get("output_attentions")):
            return False
        dropout = float(getattr(self.module, "attention_dropout", 0.0) or 0.0)
        return not (self.module.training and dropout > 0.0)


class _Call:
    """One forward call of an offloaded layer: the bound arguments, and what the original forward
    returned besides the attention output (attention weights, ...)."""

    def __init__(self, layer: _OffloadedLayer, bound):
        self.layer = layer
        self.bound = bound
        self.rest: Optional[Tuple] = None

    def run(self, hidden_states):
        bound = inspect.BoundArguments(self.layer.signature, dict(self.bound.arguments))
        bound.arguments[self.layer.hidden_name] = hidden_states
        result = self.layer.original_forward(*bound.args, **bound.kwargs)
        if isinstance(result, tuple):
            self.rest = tuple(result[1:])
            return result[0]
        return result


class _OffloadedAttention(RemoteAttentionBackward):
    """apply(hidden_states, cos, sin, q_w, k_w, v_w, o_w, q_norm_w, k_norm_w, call, weights):
    forward = the module's own forward, unchanged (run without recording a graph, so none of its
    activations are kept); backward = RemoteAttentionBackward's (the service, same saved tensors
    and ctx fields)."""

    @staticmethod
    def forward(ctx, hidden_states, cos, sin, q_weight, k_weight, v_weight, o_weight, q_norm_weight,
                k_norm_weight, call: _Call, weights: _PinnedWeights):
        _keep_for_backward(ctx, call.layer.binding, weights, hidden_states, cos, sin,
                           (q_weight, k_weight, v_weight, o_weight, q_norm_weight, k_norm_weight))
        return call.run(hidden_states)


class OffloadHandle:
    """What offload() returns: the offloaded layers ({layer index: _OffloadedLayer}), the client,
    fetch_gradients() / attach(optimizer) for ACCUMULATE mode, and remove() (also on leaving a
    `with` block) to give every module its own backward back."""

    def __init__(self, client, layers: Dict[int, _OffloadedLayer], mode: str, owns_client: bool):
        self.client = client
        self.layers = layers
        self.mode = mode
        self._owns_client = owns_client
        self._removed = False
        self._fetch_refused = False  # the server cannot write this process's GPU memory
        self._staging = _FetchStaging(
            lambda layer, name: self.layers[layer].weights()[name])

    def last_results(self) -> Dict[int, Optional[client_module.BackwardResult]]:
        """{layer: its latest BackwardResult} (server timings, device, weights version, and the
        transport that carried it)."""
        return {index: layer.binding.last_result for index, layer in self.layers.items()}

    def sync_weights(self, force: bool = False) -> Dict[int, int]:
        """Uploads every layer's changed weights now (the backward does it otherwise)."""
        return {index: layer.sync_weights(force) for index, layer in self.layers.items()}

    def fetch_gradients(self, *, strict: bool = True) -> Dict[int, client_module.AccumulationState]:
        """ACCUMULATE mode: fetches-and-zeroes every layer's accumulated gradients (one call per
        server) and adds them into the parameters' .grad. strict: each layer's window must cover
        exactly the tokens its module sent since the last fetch, against the weights it uploaded
        (else FailedPreconditionError naming the layers, and .grad is left untouched)."""
        if self.mode != "accumulate":
            raise RuntimeError("fetch_gradients is for mode='accumulate'; in 'return' mode the "
                               "gradients are already in .grad after backward()")
        fetched = self._fetch_by_reference()
        if fetched is None:
            fetched = self.client.fetch_layers(list(self.layers), zero_after_fetch=True,
                                               into=self._staging.into)
        problems = []
        for index, layer in self.layers.items():
            binding, state = layer.binding, fetched[index].state
            sent, batches = binding.pending_tokens, binding.pending_batches
            binding.pending_tokens = binding.pending_batches = 0
            if not strict:
                continue
            if state.tokens != sent:
                problems.append(f"layer {index}: the window covers {state.tokens} tokens, the "
                                f"model sent {sent} in {batches} backward calls")
            elif sent and layer.weights_version is not None and \
                    state.weights_version != layer.weights_version:
                problems.append(f"layer {index}: computed against weights version "
                                f"{state.weights_version}, uploaded {layer.weights_version}")
        if problems:
            raise FailedPreconditionError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the accumulation windows do not match the model's backward calls: "
                + "; ".join(problems) + ". Redo the step (the windows were zeroed).",
                method="FetchGradients")
        with torch.no_grad():
            for index, layer in self.layers.items():
                _add_into_grads(layer.weights(), fetched[index])
        self._staging.copies_queued()
        return {index: fetched[index].state for index in self.layers}

    def _fetch_by_reference(self):
        """{layer: Gradients} whose sums the server wrote into new CUDA tensors of this process
        (CUDA IPC: no weight-gradient byte on the connection); None when the transport or the
        parameters' devices do not allow it, or the server cannot open this process's memory
        (then auto warns once and later fetches go as bytes)."""
        transport = next(iter(self.layers.values())).binding.transport
        weights = {index: layer.weights() for index, layer in self.layers.items()}
        if transport not in ("auto", "cuda_ipc") or self._fetch_refused or not all(
                w.is_cuda for layer in weights.values() for w in layer.values()):
            return None
        destinations = {index: {name: torch.empty(w.shape, dtype=torch.float32, device=w.device)
                                for name, w in layer.items()}
                        for index, layer in weights.items()}
        try:
            return self.client.fetch_layers(list(self.layers), zero_after_fetch=True,
                                            destinations=destinations)
        except client_module._CudaIpcRefused as error:
            if transport == "cuda_ipc":
                raise client_module._forced_transport_refused(
                    transport, "open this process's GPU memory", str(error)) from None
            self._fetch_refused = True
            warnings.warn(f"transport='auto': the server cannot write this process's GPU memory "
                          f"({error}); fetched sums come as bytes from now on", RuntimeWarning,
                          stacklevel=3)
            return None

    def attach(self, optimizer: torch.optim.Optimizer):
        """ACCUMULATE mode: fetch_gradients() right before every optimizer.step() (a step
        pre-hook; PyTorch >= 2.0). Returns the hook's handle."""
        if not hasattr(optimizer, "register_step_pre_hook"):
            raise RuntimeError("optimizer step hooks need PyTorch >= 2.0: call "
                               "handle.fetch_gradients() before optimizer.step() instead")
        return optimizer.register_step_pre_hook(_step_pre_hook(self.fetch_gradients))

    def remove(self) -> None:
        """Gives every module its own forward (and local backward) back; closes a client that
        offload() created."""
        if self._removed:
            return
        for layer in self.layers.values():
            if layer.had_instance_forward:
                layer.module.forward = layer.original_forward
            else:
                layer.module.__dict__.pop("forward", None)
            layer.module.__dict__.pop("_attngrad_offload", None)
        self._removed = True
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> "OffloadHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def offload(model: nn.Module, client_or_map, *, mode: str = "return", precision: str = "auto",
            wire_dtype: str = "float32", input_dtype: Optional[str] = None,
            upload_weights: bool = True, layers=None, transport: str = "auto",
            stream_ordered: bool = True, server_forward: Optional[bool] = None,
            **client_kwargs) -> OffloadHandle:
    """Moves the attention backward of every layer of a transformers Gemma-3 model
    (Gemma3ForCausalLM, Gemma3TextModel, or anything whose attention modules carry q_proj ... k_norm
    and layer_idx) to the attngrad server(s), in one call.

    The forward is the module's own, unchanged (same outputs; run without recording a graph, so
    none of the attention's activations are kept), or with server_forward the server's; the
    backward of each attention call is computed
    by the server of its layer (layer = the module's layer_idx) and gives the grad of
    hidden_states and, in mode="return", the gradients of q/k/v/o_proj.weight and
    q_norm/k_norm.weight, added into their .grad by autograd like any layer's. mode="accumulate"
    keeps the weight gradients summed on the servers until handle.fetch_gradients() (or
    handle.attach(optimizer)). Each backward sends the forward's cos/sin tables (so any RoPE variant
    is honoured) and the module's scaling, soft-cap, eps and sliding window (from the module and
    its config); the servers must hold layers of the same shape (checked against their model info).
    Batches must be unpadded causal sequences (the server applies the causal / sliding-window mask,
    not the forward's attention_mask), and the training forward must not extend a KV cache.

    Args:
      client_or_map: an attngrad.Client or ShardedClient, a "host:port", or a layer map
        "0-12=host-a:50051,13-25=host-b:50051" (a dict works too; see attngrad.ShardedClient).
      mode: "return" or "accumulate". precision: the server's ("auto", "fp32", "tf32", "fp16").
      wire_dtype / input_dtype: the wire dtype of the tensors sent (see Client.backward).
      upload_weights: upload each layer's weights at its first backward and after every change
        (optimizer steps) and pin that version in each backward (default). False: the servers
        already hold exactly these weights (e.g. started with --weights=DIR of this checkpoint)
        and nothing changes them (no training of the attention weights).
      layers: the layer indices to offload (default: all).
      transport: "auto" (default), "cuda_ipc", "shm" or "bytes": how activations, weights and
        (RETURN) weight gradients reach a server of this host (see RemoteGemma3Attention); "auto"
        probes once and falls back to bytes, with one warning, for a server elsewhere.
        handle.last_results()[layer].transport says which carried each layer's latest backward.
      stream_ordered: True (default): queue the CUDA IPC backward calls on the trainer's CUDA
        stream instead of waiting for each answer (see RemoteGemma3Attention).
      server_forward: the layers' forward computed by the servers too (see RemoteGemma3Attention;
        None: $ATTNGRAD_SERVER_FORWARD == "1"). A call that needs more than the layer's output
        (a KV cache, output_attentions, attention dropout in training) runs the module's own
        forward all the same; the attention weights are returned as None.
      **client_kwargs: attngrad.Client's arguments when client_or_map is an address or map.
    Returns an OffloadHandle (remove() undoes it)."""
    if mode not in ("return", "accumulate"):
        raise ValueError(f"mode must be 'return' or 'accumulate', got {mode!r}")
    modules = attention_modules(model)
    if layers is not None:
        wanted = {int(i) for i in layers}
        unknown = sorted(wanted - set(modules))
        if unknown:
            raise ValueError(f"layers {unknown} are not in the model (it has {sorted(modules)})")
        modules = {i: m for i, m in modules.items() if i in wanted}
    for index, module in modules.items():
        if "_attngrad_offload" in module.__dict__:
            raise ValueError(f"layer {index} is already offloaded (remove() the first handle)")
    client = sharded_module.connect(client_or_map, **client_kwargs)
    owns_client = client is not client_or_map
    try:
        info = client.info()
        served = {layer.index: layer for layer in info.layers}
        offloaded: Dict[int, _OffloadedLayer] = {}
        for index, module in modules.items():
            layer_info = served.get(index)
            if layer_info is None:
                raise ValueError(f"layer {index} is not served (the server(s) hold layers "
                                 f"{sorted(served)}); start them with --layers covering it")
            local = (module.q_proj.in_features, module.q_proj.out_features // module.head_dim,
                     module.k_proj.out_features // module.head_dim, module.head_dim)
            remote = (layer_info.hidden_size, layer_info.num_heads, layer_info.num_kv_heads,
                      layer_info.head_dim)
            if local != remote:
                raise ValueError(f"layer {index}: the model's attention is (hidden, heads, kv "
                                 f"heads, head_dim) = {local}, the server's {remote}")
            scaling, softcap, eps, window = _layer_scalars(module, index)
            binding = _Binding(client, config=layer_info, mode=mode, precision=precision,
                               scaling=scaling, softcap=softcap, eps=eps, wire_dtype=wire_dtype,
                               layer=index, sliding_window=window, input_dtype=input_dtype,
                               transport=transport, stream_ordered=stream_ordered,
                               server_forward=server_forward)
            offloaded[index] = _OffloadedLayer(module, index, binding, upload_weights)
        if mode == "accumulate":
            for index in offloaded:
                client.zero_gradients(layer=index)
    except BaseException:
        if owns_client:
            client.close()
        raise
    group = list(offloaded.values())  # in layer order: the order of the model's forward
    for index, layer in offloaded.items():
        layer.upload_group = group
        layer.module.forward = layer.forward
        layer.module.__dict__["_attngrad_offload"] = layer
    return OffloadHandle(client, offloaded, mode, owns_client)
