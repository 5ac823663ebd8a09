"""attngrad: Python client of the attngrad gradient service (the backward pass of a Gemma-3-4B
attention layer computed on a GPU server; see SPEC.md).

    import attngrad
    client = attngrad.Client("localhost:50051")
    result = client.backward(hidden_states, grad_output, cos, sin)   # numpy arrays or torch tensors

A model spread over several servers: attngrad.ShardedClient("0-12=host-a:50051,13-25=host-b:50051")
routes every layer-addressed call to the server of its layer (attngrad.connect(target_or_map) picks
Client or ShardedClient).

attngrad.torch (imported on demand; needs PyTorch) has the autograd bridge RemoteAttentionBackward,
the module RemoteGemma3Attention and offload(model, client_or_map) for a transformers Gemma-3 model.
"""
from .errors import (AttngradError, DeadlineExceededError, FailedPreconditionError,
                     InvalidArgumentError, ResourceExhaustedError, UnavailableError)
from .client import (WEIGHT_NAMES, AccumulationState, BackwardResult, Client, DeviceInfo, Gradients,
                     LayerInfo, ModelInfo, StageTimings, canonical_weight_name, read_token_file,
                     tls_credentials)
from .host_regions import SealedMemory
from .sharded import LayerRange, ShardedClient, connect, parse_layer_map

__version__ = "0.1.0"

__all__ = [
    "AccumulationState", "AttngradError", "BackwardResult", "Client", "DeadlineExceededError",
    "DeviceInfo", "FailedPreconditionError", "Gradients", "InvalidArgumentError", "LayerInfo",
    "LayerRange", "ModelInfo", "ShardedClient", "connect", "parse_layer_map",
    "ResourceExhaustedError", "SealedMemory", "StageTimings", "UnavailableError", "WEIGHT_NAMES",
    "canonical_weight_name", "read_token_file", "tls_credentials", "__version__",
]
