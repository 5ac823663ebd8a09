"""attngrad: Python client of the attngrad gradient service (the backward pass of a Gemma-3-4B
attention layer computed on a GPU server; see SPEC.md).

    import attngrad
    client = attngrad.Client("localhost:50051")
    result = client.backward(hidden_states, grad_output, cos, sin)   # numpy arrays or torch tensors

attngrad.torch (imported on demand; needs PyTorch) has the autograd bridge RemoteAttentionBackward
and the module RemoteGemma3Attention.
"""
from .errors import (AttngradError, DeadlineExceededError, FailedPreconditionError,
                     InvalidArgumentError, ResourceExhaustedError, UnavailableError)
from .client import (WEIGHT_NAMES, AccumulationState, BackwardResult, Client, DeviceInfo, Gradients,
                     LayerInfo, ModelInfo, StageTimings, canonical_weight_name, read_token_file,
                     tls_credentials)

__version__ = "0.1.0"

__all__ = [
    "AccumulationState", "AttngradError", "BackwardResult", "Client", "DeadlineExceededError",
    "DeviceInfo", "FailedPreconditionError", "Gradients", "InvalidArgumentError", "LayerInfo",
    "ModelInfo",
    "ResourceExhaustedError", "StageTimings", "UnavailableError", "WEIGHT_NAMES",
    "canonical_weight_name", "read_token_file", "tls_credentials", "__version__",
]
