"""attngrad.ShardedClient: one model whose decoder layers are spread over several attngrad servers
(each started with --layers=A-B), addressed through a layer map.

    client = attngrad.ShardedClient("0-12=host-a:50051,13-25=host-b:50051")
    client.info().layers                         # every layer of both servers, checked to agree
    client.backward(h, g, cos, sin, layer=14)    # goes to host-b
    client.fetch_layers(range(26))               # one FetchGradients call per server

A map is a string "FIRST-LAST=host:port,..." (one layer: "7=host:port"), a mapping {(first, last):
target, "first-last": target, ...} whose targets are addresses or attngrad.Client objects, or a
plain "host:port" (one server, every layer). Every layer-addressed call (backward, backward_many,
fetch_gradients, fetch_layers, zero_gradients, load_weights) goes to the server of its layer; the
servers need no coordination (each layer's weights, versions and windows live on one of them).

The string form follows the grammar of the C++ parser (proto/include/attngrad/wire/layer_range.h):
layers are ASCII digits below 2**31 and ASCII whitespace around the pieces is ignored;
tests/fixtures/layer_maps.json holds the examples both parsers are tested on.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc

from . import client as client_module
from . import errors

__all__ = ["LayerRange", "ShardedClient", "parse_layer_map", "connect"]


@dataclasses.dataclass(frozen=True)
class LayerRange:
    """Decoder layers first..last (inclusive) served at target; first None: every layer."""
    first: Optional[int]
    last: Optional[int]
    target: Any  # "host:port" or an attngrad.Client

    def contains(self, layer: int) -> bool:
        return self.first is None or self.first <= layer <= self.last

    def __str__(self) -> str:
        target = getattr(self.target, "target", self.target)
        if self.first is None:
            return str(target)
        span = str(self.first) if self.first == self.last else f"{self.first}-{self.last}"
        return f"{span}={target}"


_ASCII_WHITESPACE = " \t\n\r\f\v"
_LAYER_LIMIT = 2**31  # layers are C ints on the server and in the C++ client


def _parse_layer(text: str) -> Optional[int]:
    """The layer number TEXT spells (ASCII digits only: no sign, no "_", no other digits); None
    for anything else."""
    text = text.strip(_ASCII_WHITESPACE)
    if not text or any(not "0" <= character <= "9" for character in text):
        return None
    value = int(text)
    return value if value < _LAYER_LIMIT else None


def _parse_span(text: str, whole: str) -> Tuple[int, int]:
    pieces = str(text).strip(_ASCII_WHITESPACE).split("-", 1)
    first, last = _parse_layer(pieces[0]), _parse_layer(pieces[-1])
    if first is None or last is None:
        raise ValueError(f"layer map {whole!r}: {text!r} is not a layer range FIRST-LAST "
                         "(e.g. \"0-12=host-a:50051\")")
    if last < first:
        raise ValueError(f"layer map {whole!r}: {text!r} must be FIRST-LAST with "
                         "0 <= FIRST <= LAST")
    return first, last


def parse_layer_spans(text: str) -> List[Tuple[int, int]]:
    """[(first, last)] of "0-12,13-25": a layer map's spans without addresses, as the deployment's
    ATTNGRAD_LAYER_RANGES lists them; ValueError naming the bad piece."""
    return [_parse_span(piece, text) for piece in str(text).split(",")]


def parse_layer_map(layer_map) -> List[LayerRange]:
    """The ranges of LAYER_MAP (see the module's docstring), sorted by first layer; ValueError
    naming the bad piece for a malformed or overlapping map."""
    if isinstance(layer_map, client_module.Client):
        return [LayerRange(None, None, layer_map)]
    ranges: List[LayerRange] = []
    if isinstance(layer_map, str):
        whole = layer_map.strip(_ASCII_WHITESPACE)
        if not whole:
            raise ValueError("layer map: empty")
        if "=" not in whole:
            if "," in whole:
                raise ValueError(f"layer map {whole!r}: several servers need layer ranges, e.g. "
                                 "\"0-12=host-a:50051,13-25=host-b:50051\"")
            return [LayerRange(None, None, whole)]
        for piece in whole.split(","):
            span, _, target = piece.partition("=")
            target = target.strip(_ASCII_WHITESPACE)
            if not target:
                raise ValueError(f"layer map {whole!r}: {piece.strip(_ASCII_WHITESPACE)!r} has no "
                                 "address (expected FIRST-LAST=host:port)")
            first, last = _parse_span(span, whole)
            ranges.append(LayerRange(first, last, target))
    elif isinstance(layer_map, Mapping):
        whole = repr(dict(layer_map))
        for key, target in layer_map.items():
            if isinstance(key, tuple):
                first, last = int(key[0]), int(key[-1])
                if first < 0 or last < first:
                    raise ValueError(f"layer map: {key} must be (first, last), 0 <= first <= last")
            elif isinstance(key, int):
                first = last = key
            else:
                first, last = _parse_span(key, whole)
            ranges.append(LayerRange(first, last, target))
        if not ranges:
            raise ValueError("layer map: empty")
    else:
        raise TypeError(f"a layer map is a str, a mapping or an attngrad.Client, got "
                        f"{type(layer_map).__name__}")
    ranges.sort(key=lambda r: r.first)
    for before, after in zip(ranges, ranges[1:]):
        if after.first <= before.last:
            raise ValueError(f"layer map: {before} and {after} overlap")
    return ranges


def _smallest_limit(a: int, b: int) -> int:
    """The tighter of two limits where <= 0 means none."""
    limits = [x for x in (a, b) if x > 0]
    return min(limits) if limits else 0


def _shape(info) -> Tuple[int, int, int, int]:
    return (info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim)


def merge_model_info(ranges: Sequence[LayerRange],
                     infos: Sequence[client_module.ModelInfo]) -> client_module.ModelInfo:
    """The servers' infos merged: the first's fields, the layers each server serves for its range
    (sorted), every server's devices, the smallest limits, server_instance_id joined by ','.
    FailedPreconditionError when they serve different models or a server lacks a mapped layer."""
    first = infos[0]

    def disagree(what, here, there, target):
        return errors.FailedPreconditionError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the layer map's servers serve different models: {ranges[0]} has {what} {here}, "
            f"{target} has {there}", method="GetModelInfo")

    layers, devices, instances = [], [], []
    max_message, max_tokens = first.max_message_bytes, first.max_batch_tokens
    for layer_range, info in zip(ranges, infos):
        if info.model_name != first.model_name:
            raise disagree("model", repr(first.model_name), repr(info.model_name), layer_range)
        if info.num_hidden_layers != first.num_hidden_layers:
            raise disagree("decoder layers", first.num_hidden_layers, info.num_hidden_layers,
                           layer_range)
        if _shape(info) != _shape(first):
            raise disagree("layer shape (hidden, heads, kv heads, head_dim)", _shape(first),
                           _shape(info), layer_range)
        held = {layer.index for layer in info.layers}
        if layer_range.first is not None:
            missing = [i for i in range(layer_range.first, layer_range.last + 1) if i not in held]
            if missing:
                raise errors.FailedPreconditionError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the layer map sends layers {layer_range} but that server holds layers "
                    f"{sorted(held)} (missing {missing[:8]}; start it with "
                    f"--layers={layer_range.first}-{layer_range.last})", method="GetModelInfo")
        layers += [layer for layer in info.layers if layer_range.contains(layer.index)]
        devices += list(info.devices)
        instances.append(info.server_instance_id)
        max_message = _smallest_limit(max_message, info.max_message_bytes)
        max_tokens = _smallest_limit(max_tokens, info.max_batch_tokens)
    return dataclasses.replace(
        first, layers=tuple(sorted(layers, key=lambda layer: layer.index)), devices=tuple(devices),
        server_instance_id=",".join(instances), max_message_bytes=max_message,
        max_batch_tokens=max_tokens)


class ShardedClient:
    """Several attngrad servers holding the layers of one model, behind one client.

    Args:
      layer_map: see the module's docstring.
      **client_kwargs: attngrad.Client's arguments (credentials, token, timeout, channels, ...)
        for the servers given as addresses.
    """

    def __init__(self, layer_map, **client_kwargs):
        self.ranges = parse_layer_map(layer_map)
        if len(self.ranges) > 1 and any(r.first is None for r in self.ranges):
            raise ValueError("layer map: with several servers every one needs a layer range")
        self._owned: List[client_module.Client] = []
        self.clients: List[client_module.Client] = []
        try:
            for layer_range in self.ranges:
                target = layer_range.target
                if isinstance(target, client_module.Client):
                    self.clients.append(target)
                else:
                    created = client_module.Client(str(target), **client_kwargs)
                    self._owned.append(created)
                    self.clients.append(created)
        except BaseException:
            self.close()
            raise
        self._info: Optional[client_module.ModelInfo] = None

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the clients this object created (not those it was given)."""
        for created in self._owned:
            created.close()

    def __enter__(self) -> "ShardedClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def target(self) -> str:
        return ",".join(str(r) for r in self.ranges)

    # -- routing ---------------------------------------------------------------------------------

    def _index(self, layer: Optional[int]) -> int:
        if layer is None:
            if len(self.clients) == 1:
                return 0
            raise ValueError(f"the layer map {self.target} has several servers: pass layer=")
        for index, layer_range in enumerate(self.ranges):
            if layer_range.contains(int(layer)):
                return index
        raise errors.InvalidArgumentError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"layer {layer} is not in the layer map {self.target}", method="route")

    def client_for(self, layer: Optional[int]) -> client_module.Client:
        """The Client of the server of LAYER (None: the only server)."""
        return self.clients[self._index(layer)]

    # -- info and health -------------------------------------------------------------------------

    def info(self, *, timeout: Optional[float] = None) -> client_module.ModelInfo:
        """Every server's info, merged and checked (see merge_model_info)."""
        infos = [c.info(timeout=timeout) for c in self.clients]
        self._info = merge_model_info(self.ranges, infos)
        return self._info

    def health(self, service: str = "", *, timeout: Optional[float] = None) -> str:
        """"SERVING" when every server is; else the first server's other status."""
        for c in self.clients:
            status = c.health(service, timeout=timeout)
            if status != "SERVING":
                return status
        return "SERVING"

    def wait_until_serving(self, timeout: float = 30.0) -> client_module.ModelInfo:
        for c in self.clients:
            c.wait_until_serving(timeout)
        return self.info()

    # -- layer-addressed calls -------------------------------------------------------------------

    def backward(self, hidden_states, grad_output, cos=None, sin=None, **kwargs):
        """Client.backward on the server of kwargs['layer']."""
        return self.client_for(kwargs.get("layer")).backward(hidden_states, grad_output, cos, sin,
                                                             **kwargs)

    def submit_backward(self, hidden_states, grad_output, cos=None, sin=None, **kwargs):
        """Client.submit_backward on the server of kwargs['layer']."""
        return self.client_for(kwargs.get("layer")).submit_backward(
            hidden_states, grad_output, cos, sin, **kwargs)

    def forward(self, hidden_states, cos=None, sin=None, **kwargs):
        """Client.forward on the server of kwargs['layer']."""
        return self.client_for(kwargs.get("layer")).forward(hidden_states, cos, sin, **kwargs)

    def submit_forward(self, hidden_states, cos=None, sin=None, **kwargs):
        """Client.submit_forward on the server of kwargs['layer']."""
        return self.client_for(kwargs.get("layer")).submit_forward(hidden_states, cos, sin,
                                                                   **kwargs)

    def submit_after_stream(self, tensor, task, *, timeout=None, layer=None):
        """Client.submit_after_stream on the server of LAYER."""
        return self.client_for(layer).submit_after_stream(tensor, task, timeout=timeout,
                                                          layer=layer)

    def orders_on_gpu(self, device: Optional[int] = None, *, layer: Optional[int] = None) -> bool:
        """Client.orders_on_gpu on the server of LAYER (None: on any server)."""
        if layer is None:
            return any(client.orders_on_gpu(device) for client in self.clients)
        return self.client_for(layer).orders_on_gpu(device, layer=layer)

    def wait_submitted(self) -> None:
        """Client.wait_submitted on every server's client; raises the first error."""
        errors_seen = []
        for client in self.clients:
            try:
                client.wait_submitted()
            except Exception as error:  # noqa: BLE001 - every client is waited for first
                errors_seen.append(error)
        if errors_seen:
            raise errors_seen[0]

    def backward_many(self, batches: Iterable[Mapping[str, Any]], *,
                      timeout: Optional[float] = None) -> Iterator[client_module.BackwardResult]:
        """Client.backward_many over every server at once (one stream per server, each fed from
        its own thread); results in input order."""
        if len(self.clients) == 1:
            return self.clients[0].backward_many(batches, timeout=timeout)
        return self._backward_many(batches, timeout)

    def _backward_many(self, batches, timeout):
        servers = self.clients

        def run_server(index, server_batches):
            return servers[index].backward_many(server_batches, timeout=timeout)

        return client_module.ordered_fan_out(
            (dict(kwargs) for kwargs in batches),
            lambda _, kwargs: self._index(kwargs.get("layer")),
            run_server, limit=max(c.max_in_flight for c in servers) * len(servers))

    def fetch_gradients(self, *, layer: Optional[int] = None, **kwargs) -> client_module.Gradients:
        return self.client_for(layer).fetch_gradients(layer=layer, **kwargs)

    def fetch_layers(self, layers: Sequence[int], **kwargs) -> Dict[int, client_module.Gradients]:
        """One FetchGradients call per server for its layers: {layer: Gradients}."""
        by_server: Dict[int, List[int]] = {}
        for layer in layers:
            by_server.setdefault(self._index(int(layer)), []).append(int(layer))
        fetched: Dict[int, client_module.Gradients] = {}
        destinations = kwargs.pop("destinations", None) or {}
        for index, server_layers in by_server.items():
            mine = {layer: destinations[layer] for layer in server_layers if layer in destinations}
            fetched.update(self.clients[index].fetch_layers(server_layers, destinations=mine,
                                                            **kwargs))
        return {int(layer): fetched[int(layer)] for layer in layers}

    def zero_gradients(self, *, layer: Optional[int] = None, **kwargs):
        return self.client_for(layer).zero_gradients(layer=layer, **kwargs)

    def load_weights(self, weights, *, layer: Optional[int] = None, **kwargs) -> int:
        return self.client_for(layer).load_weights(weights, layer=layer, **kwargs)


def connect(target_or_map, **client_kwargs) -> Union[client_module.Client, ShardedClient]:
    """An attngrad.Client for a plain "host:port" (or a Client, returned as is); a ShardedClient
    for a layer map."""
    if isinstance(target_or_map, (client_module.Client, ShardedClient)):
        return target_or_map
    ranges = parse_layer_map(target_or_map)
    if len(ranges) == 1 and ranges[0].first is None:
        return client_module.Client(str(ranges[0].target), **client_kwargs)
    return ShardedClient(target_or_map, **client_kwargs)
