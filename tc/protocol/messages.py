"""The messages head and workers exchange, one frozen dataclass per wire type.

Each class names its wire type in ``TYPE`` and declares every payload field with an explicit type and a wire
kind (``wire(KIND)``). The kind does both jobs:

- at construction it checks what our own code passed (TypeError / ValueError: a bug here), normalising lists to
  tuples and ints to floats where the field says so;
- on receipt it checks what the peer sent (ProtocolError naming the message type and field: the peer's fault).

Payloads are strict: every field must be present, no other key may be, and nothing falls back to a default.
Commands are imperatives (ASSIGNMENT aside, which is the head's order), replies are nouns or past tense.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from tc.draft import STEP_ROWS
from tc.protocol.cbor import CBOR_INT_MAX, CBOR_INT_MIN
from tc.protocol.errors import ProtocolError, ProtocolVersionMismatch
from tc.protocol.tensors import WIRE_DTYPES, WireTensor

# 2: ASSIGNMENT lost total_weight_bytes, which no worker could use (the head holds the plan, and shows planned
#    beside loaded bytes from LOAD_COMPLETE)
# 3: batches: RUN_BATCH (many sequences, each with its own cache) replaced RUN_PREFILL and RUN_DECODE, RELEASE
#    drops finished sequences' caches, and ASSIGNMENT says how many sequences a worker holds at once; HELLO
#    carries the worker's measured speeds (tc.worker.bench), which the planner balances layers with
# 4: PING carries a payload that PONG echoes, so the head measures each link's bandwidth as well as its latency;
#    HELLO says the largest frame the worker reads, so the probe fits it
# 5: a RUN_BATCH entry may name `copies`: sequences that start from a copy of its cache once its rows have run
#    (the choices of one request, whose prompt is read once)
# 6: direct hops: a worker listens for the stage before it (HELLO's peer_port), ROUTE tells each worker where its
#    output goes, a RUN_BATCH may be passed from worker to worker (its `route`; PEER_* set up that link), and it
#    and HIDDEN_STATE carry the compute times of the stages that passed it on (`upstream_seconds`); RUN_BATCH
#    carries the sequences released since the step before (`released`), which a worker drops first whichever
#    link the batch came by
# 7: a RUN_BATCH entry that continues a sequence may ask for a larger cache_capacity than its cache was made with,
#    and the worker grows the cache (a finished request's cache taken up by the request that continues its text)
# 8: a RUN_BATCH entry may name a `source`: the sequence whose first position_start positions its cache starts
#    from, its own cut back or another's copied (a request whose prompt shares only the start of a kept cache)
# 9: ASSIGNMENT names the context served (`context_length`), which longrope's rotary frequencies depend on
# 10: HELLO_ACK says how often the head pings (`heartbeat_s`), which a worker's silence limit takes into account;
#     HELLO names the entry a worker without a node id held before (`held_node_id`), which it gets again if free
PROTOCOL_VERSION = 10

DEVICE_TYPES = ("cuda", "mps", "cpu")

# A 32k-token prefill of a 896-wide model in fp32 is 117 MB; 256 MiB leaves room for that and its envelope.
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024

# Codes carried by ERROR. The receiver shows the message; the code lets it act without parsing prose.
ERROR_HELLO_REFUSED = "hello_refused"
ERROR_PROTOCOL = "protocol_error"
ERROR_VERSION_MISMATCH = "version_mismatch"
ERROR_UNEXPECTED_MESSAGE = "unexpected_message"
ERROR_SHUTTING_DOWN = "shutting_down"  # either side, before it closes the connection on purpose
ERROR_COMPUTE_FAILED = "compute_failed"  # worker: its compute failed; it leaves and rejoins
# head, refusing a HELLO: the entry it asks for (or every entry) is held by a connected worker, which may be this
# very worker's last connection, that the head has not yet seen end (a head paused past the worker's head timeout)
ERROR_NODE_TAKEN = "node_taken"


# ---------------------------------------------------------------------------------------------------------------
# Field kinds. check(): our side, raises TypeError/ValueError. from_wire(): the peer's side, raises ProtocolError.
# ---------------------------------------------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (bytes, memoryview)):
        return "byte string"  # the decoder hands byte strings over as memoryviews
    return type(value).__name__


class _Kind:
    """How one field is checked on our side, written to the wire, and checked when read back."""

    def check(self, value: Any, where: str) -> Any:
        """Validate a value our code put in a field; return it normalised."""
        raise NotImplementedError

    def to_wire(self, value: Any) -> Any:
        return value

    def summary(self, value: Any) -> str:
        """How the value shows in a message's repr."""
        return repr(value)

    def from_wire(self, value: Any, where: str) -> Any:
        """Validate a value the peer sent; return the Python value for the field."""
        try:
            return self.check(value, where)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(str(exc)) from exc


class _Int(_Kind):
    """An int that CBOR carries natively, in [minimum, maximum]; never a bool."""

    def __init__(self, minimum: int = CBOR_INT_MIN, maximum: int = CBOR_INT_MAX) -> None:
        self.minimum, self.maximum = minimum, maximum

    def check(self, value: Any, where: str) -> int:
        if type(value) is not int:  # bool is an int subclass; a flag is never a count
            raise TypeError(f"{where} must be an int, got {_type_name(value)}")
        if not self.minimum <= value <= self.maximum:
            top = "2**64 - 1" if self.maximum == CBOR_INT_MAX else str(self.maximum)
            raise ValueError(f"{where} must be in [{self.minimum}, {top}], got {value}")
        return value


class _Float(_Kind):
    """A finite, non-negative number (a duration); an int is accepted and stored as a float."""

    def check(self, value: Any, where: str) -> float:
        if type(value) not in (int, float):
            raise TypeError(f"{where} must be a number, got {_type_name(value)}")
        number = float(value)
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"{where} must be a finite number >= 0, got {value}")
        return number


class _Simple(_Kind):
    def __init__(self, cls: type) -> None:
        self.cls = cls

    def check(self, value: Any, where: str) -> Any:
        if type(value) is not self.cls:
            raise TypeError(f"{where} must be {self.cls.__name__}, got {_type_name(value)}")
        return value


class _Bytes(_Kind):
    def check(self, value: Any, where: str) -> bytes:
        if type(value) is not bytes:
            raise TypeError(f"{where} must be bytes, got {_type_name(value)}")
        return value

    def summary(self, value: bytes) -> str:
        return repr(value) if len(value) <= 32 else f"<{len(value)} bytes>"  # a link probe's payload is ~1 MB

    def from_wire(self, value: Any, where: str) -> bytes:
        # The decoder hands byte strings over as views of the frame; the message must own its bytes.
        if isinstance(value, (bytes, memoryview)):
            return bytes(value)
        raise ProtocolError(f"{where} must be a byte string, got {_type_name(value)}")


class _OneOf(_Kind):
    def __init__(self, choices: tuple[str, ...]) -> None:
        self.choices = choices

    def check(self, value: Any, where: str) -> str:
        if type(value) is not str:
            raise TypeError(f"{where} must be a string, got {_type_name(value)}")
        if value not in self.choices:
            raise ValueError(f"{where} must be one of {list(self.choices)}, got {value!r}")
        return value


class _Optional(_Kind):
    def __init__(self, inner: _Kind) -> None:
        self.inner = inner

    def check(self, value: Any, where: str) -> Any:
        return None if value is None else self.inner.check(value, where)

    def to_wire(self, value: Any) -> Any:
        return None if value is None else self.inner.to_wire(value)

    def from_wire(self, value: Any, where: str) -> Any:
        return None if value is None else self.inner.from_wire(value, where)


class _TupleOf(_Kind):
    def __init__(self, item: _Kind) -> None:
        self.item = item

    def check(self, value: Any, where: str) -> tuple[Any, ...]:
        if not isinstance(value, (tuple, list)):
            raise TypeError(f"{where} must be a tuple, got {_type_name(value)}")
        return tuple(self.item.check(v, f"{where}[{i}]") for i, v in enumerate(value))

    def to_wire(self, value: tuple[Any, ...]) -> list[Any]:
        return [self.item.to_wire(v) for v in value]

    def from_wire(self, value: Any, where: str) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise ProtocolError(f"{where} must be a list, got {_type_name(value)}")
        return tuple(self.item.from_wire(v, f"{where}[{i}]") for i, v in enumerate(value))


def _check_json(value: Any, where: str) -> None:
    # Iterative walk: a config is a handful of levels deep, but a peer's nesting should not cost our stack. Each
    # item's place is a link to its parent's, made text only for an error: a path string made for every item copied
    # a long key once per item below it (a 1 MB frame, before any proof of who sent it, asked for tens of GB).
    stack: list[tuple[Any, tuple | None]] = [(value, None)]
    while stack:
        item, place = stack.pop()
        if type(item) is int and not CBOR_INT_MIN <= item <= CBOR_INT_MAX:
            raise ValueError(f"{_json_path(where, place)} = {item} does not fit a CBOR integer (64 bits and a sign)")
        if item is None or type(item) in (str, int, float, bool):
            continue
        if type(item) is list:
            stack.extend((v, (place, i)) for i, v in enumerate(item))
        elif type(item) is dict:
            for key, v in item.items():
                if type(key) is not str:
                    raise TypeError(f"{_json_path(where, place)} has a non-string key {key!r}; configs are JSON "
                                    "objects")
                stack.append((v, (place, key)))
        else:
            raise TypeError(f"{_json_path(where, place)} holds a {_type_name(item)}; only JSON values (dict, list, "
                            "str, number, bool, None) fit")


def _json_path(where: str, place: tuple | None) -> str:
    """`where` and the steps down to `place` (links of (parent's place, key or index)): where.key[3].other"""
    steps = []
    while place is not None:
        place, step = place
        steps.append(f"[{step}]" if type(step) is int else f".{step}")
    return where + "".join(reversed(steps))


class _JsonMap(_Kind):
    """A JSON object (such as config.json's contents): string keys, JSON values all the way down."""

    def check(self, value: Any, where: str) -> dict[str, Any]:
        if type(value) is not dict:
            raise TypeError(f"{where} must be a dict, got {_type_name(value)}")
        _check_json(value, where)
        return value


class _Tensor(_Kind):
    """A tensor, held in its wire form (tensors.WireTensor): a torch.Tensor given is normalised to that, a view of
    its memory; a received one stays bytes until code that computes asks for `.tensor()`."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def check(self, value: Any, where: str) -> WireTensor:
        if type(value) is not WireTensor:
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{where} must be a torch.Tensor or WireTensor, got {_type_name(value)}")
            value = WireTensor.of(value)  # raises TypeError for a dtype the wire does not carry
        if len(value.shape) != self.rank:
            raise ValueError(f"{where} must have {self.rank} dimensions, got shape {value.shape}")
        return value

    def to_wire(self, value: WireTensor) -> dict[str, Any]:
        return value.to_map()

    def summary(self, value: WireTensor) -> str:
        return repr(value)

    def from_wire(self, value: Any, where: str) -> WireTensor:
        try:
            tensor = WireTensor.from_map(value)
        except ProtocolError as exc:
            raise ProtocolError(f"{where}: {exc}") from exc
        if len(tensor.shape) != self.rank:
            raise ProtocolError(f"{where} must have {self.rank} dimensions, got shape {tensor.shape}")
        return tensor


class _Struct(_Kind):
    def __init__(self, cls: type[WireStruct]) -> None:
        self.cls = cls

    def check(self, value: Any, where: str) -> Any:
        if not isinstance(value, self.cls):
            raise TypeError(f"{where} must be a {self.cls.__name__}, got {_type_name(value)}")
        return value

    def to_wire(self, value: WireStruct) -> dict[str, Any]:
        return value.to_payload()

    def from_wire(self, value: Any, where: str) -> Any:
        return self.cls._from_wire_map(value, where)


COUNT = _Int(minimum=0)
PORT = _Int(minimum=1, maximum=65535)  # a TCP port to connect to
SECONDS = _Float()
STR = _Simple(str)
BYTES = _Bytes()
DTYPE = _OneOf(tuple(WIRE_DTYPES))
HIDDEN = _Tensor(rank=3)  # [batch, seq, hidden]


def wire(kind: _Kind, **kwargs: Any) -> Any:
    """A dataclass field carrying its wire kind; pass ``default=`` for the few fields that have one."""
    return field(metadata={"kind": kind}, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Structs and messages
# ---------------------------------------------------------------------------------------------------------------

_S = TypeVar("_S", bound="WireStruct")


class WireStruct:
    """A frozen dataclass that crosses the wire as a CBOR map of its fields."""

    _wire_fields: ClassVar[tuple[tuple[str, _Kind], ...]] = ()
    _wire_names: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        where = type(self).__name__
        for name, kind in self._wire_fields:
            # Frozen: write the normalised value (list -> tuple, int -> float) past the frozen __setattr__.
            object.__setattr__(self, name, kind.check(getattr(self, name), f"{where}.{name}"))
        self._validate()

    def _validate(self) -> None:
        """Invariants across fields; raise ValueError."""

    def __repr__(self) -> str:
        # Used by classes declared with repr=False (those carrying tensors); the rest keep dataclass's repr.
        fields = ", ".join(f"{name}={kind.summary(getattr(self, name))}" for name, kind in self._wire_fields)
        return f"{type(self).__name__}({fields})"

    def to_payload(self) -> dict[str, Any]:
        """The CBOR-ready map of this value's fields."""
        return {name: kind.to_wire(getattr(self, name)) for name, kind in self._wire_fields}

    @classmethod
    def _from_wire_map(cls: type[_S], payload: Any, where: str) -> _S:
        if type(payload) is not dict:
            raise ProtocolError(f"{where} must be a map, got {_type_name(payload)}")
        if payload.keys() != cls._wire_names:
            names = [name for name, _ in cls._wire_fields]
            unknown = sorted(map(str, payload.keys() - cls._wire_names))
            if unknown:
                raise ProtocolError(
                    f"{where} has unknown field(s) {unknown}; expected exactly {names}. "
                    "Head and workers must run the same tc release"
                )
            missing = [name for name in names if name not in payload]
            raise ProtocolError(f"{where} lacks field(s) {missing}; head and workers must run the same tc release")
        # Each field is checked and normalised as it is read, so the value is built without __init__, whose
        # __post_init__ would check every field a second time: decoding is on the path of every hop.
        value = cls.__new__(cls)
        for name, kind in cls._wire_fields:
            object.__setattr__(value, name, kind.from_wire(payload[name], f"{where}.{name}"))
        try:
            value._validate()
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"{where}: {exc}") from exc
        return value


class Message(WireStruct):
    """A value that travels as an envelope's payload; ``TYPE`` is its wire name."""

    TYPE: ClassVar[str] = ""

    @classmethod
    def from_payload(cls: type[_S], payload: Any) -> _S:
        """Parse a received payload map. Raises ProtocolError naming the message type and field."""
        return cls._from_wire_map(payload, cls.TYPE)  # type: ignore[attr-defined]


MESSAGE_TYPES: dict[str, type[Message]] = {}


def _wire_struct(cls: type[_S]) -> type[_S]:
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    missing_kind = [f.name for f in fields if "kind" not in f.metadata]
    assert not missing_kind, f"{cls.__name__} fields without wire(): {missing_kind}"
    cls._wire_fields = tuple((f.name, f.metadata["kind"]) for f in fields)
    cls._wire_names = frozenset(f.name for f in fields)
    return cls


def _message(cls: type[_S]) -> type[_S]:
    _wire_struct(cls)
    assert issubclass(cls, Message) and cls.TYPE and cls.TYPE not in MESSAGE_TYPES, cls
    MESSAGE_TYPES[cls.TYPE] = cls
    return cls


@_wire_struct
@dataclass(frozen=True)
class DeviceInfo(WireStruct):
    """One compute device a worker can use; memory in bytes, None where the backend does not say (MPS)."""

    id: str = wire(STR)  # "cuda:0", "mps", "cpu"
    type: str = wire(_OneOf(DEVICE_TYPES))
    name: str = wire(STR)
    total_memory: int | None = wire(_Optional(COUNT))
    free_memory: int | None = wire(_Optional(COUNT))


@_wire_struct
@dataclass(frozen=True)
class SpeedFigure(WireStruct):
    """What a layer costs on one of the worker's devices, computing in `dtype` with weights in `quant`
    (tc.speed.Speed: rates in the planner's weight bytes per second, a fixed cost per layer in seconds)."""

    device: str = wire(STR)
    dtype: str = wire(DTYPE)
    quant: str = wire(STR)
    decode_bytes_per_s: float = wire(SECONDS)  # a finite number >= 0, like a duration; > 0 checked below
    prefill_bytes_per_s: float = wire(SECONDS)
    layer_overhead_s: float = wire(SECONDS)

    def _validate(self) -> None:
        if self.decode_bytes_per_s <= 0 or self.prefill_bytes_per_s <= 0:
            raise ValueError(f"SpeedFigure for {self.device} {self.dtype} {self.quant}: rates must be > 0")


# --- lifecycle -------------------------------------------------------------------------------------------------


@_message
@dataclass(frozen=True)
class Hello(Message):
    """Worker -> head, first thing on a new connection: who it is and what it can run."""

    TYPE: ClassVar[str] = "HELLO"
    protocol_version: int = wire(COUNT)
    tc_version: str = wire(STR)
    node_id: str | None = wire(_Optional(STR))  # None: let the head pick a free topology entry
    hostname: str = wire(STR)
    platform: str = wire(STR)
    python_version: str = wire(STR)
    torch_version: str = wire(STR)
    devices: tuple[DeviceInfo, ...] = wire(_TupleOf(_Struct(DeviceInfo)))
    selected_device: str = wire(STR)
    compute_dtypes: tuple[str, ...] = wire(_TupleOf(DTYPE))  # native on selected_device; others fall back
    max_memory_bytes: int | None = wire(_Optional(COUNT))
    auth: bytes | None = wire(_Optional(BYTES), default=None)
    # measured for selected_device in each native compute dtype and every weight mode; empty: not measured
    speeds: tuple[SpeedFigure, ...] = wire(_TupleOf(_Struct(SpeedFigure)), default=())
    # the largest frame this worker reads: the head sizes its link probe within it
    max_frame_bytes: int = wire(COUNT, default=DEFAULT_MAX_FRAME_BYTES)
    # where the worker takes hidden states straight from the stage before it: the port, and the host to reach it
    # by (None: the address the head sees the worker at); no port: it takes them from the head only
    peer_port: int | None = wire(_Optional(PORT), default=None)
    peer_host: str | None = wire(_Optional(STR), default=None)
    # a worker without node_id that rejoins: the entry it held, which it fills again where free (its layers kept)
    held_node_id: str | None = wire(_Optional(STR), default=None)

    def _validate(self) -> None:
        ids = [d.id for d in self.devices]
        if self.selected_device not in ids:
            raise ValueError(f"Hello.selected_device {self.selected_device!r} is not among the devices {ids}")

    @classmethod
    def from_payload(cls, payload: Any) -> Hello:
        """Parse a HELLO; a foreign protocol version raises ProtocolVersionMismatch before anything else."""
        if type(payload) is dict:
            version = payload.get("protocol_version")
            if type(version) is int and version != PROTOCOL_VERSION:
                tc_version = payload.get("tc_version")
                peer_tc_version = tc_version if type(tc_version) is str else None
                raise ProtocolVersionMismatch(version, PROTOCOL_VERSION, peer_tc_version)
        return cls._from_wire_map(payload, cls.TYPE)


@_message
@dataclass(frozen=True)
class HelloAck(Message):
    """Head -> worker: accepted, under this node id."""

    TYPE: ClassVar[str] = "HELLO_ACK"
    node_id: str = wire(STR)
    challenge: bytes | None = wire(_Optional(BYTES), default=None)
    # how often the head pings: a worker counts the head gone after several intervals of silence, however long
    # its own --head-timeout-s (a topology's heartbeat_s may be minutes)
    heartbeat_s: float | None = wire(_Optional(SECONDS), default=None)


@_message
@dataclass(frozen=True)
class Assignment(Message):
    """Head -> worker: load layers [layer_start, layer_end_exclusive) of model_id in this weight mode."""

    TYPE: ClassVar[str] = "ASSIGNMENT"
    model_id: str = wire(STR)  # a HuggingFace repo id, or a directory that must exist on the worker too
    model_source: str = wire(_OneOf(("hub", "local")))  # said outright, never guessed from the id's shape
    revision: str | None = wire(_Optional(STR))  # for a repo id: branch, tag or commit (None: main)
    device: str = wire(STR)  # the worker's device to load onto, from its topology entry
    architecture: str = wire(STR)  # config.json's model_type; a worker refuses one it does not run
    quant: str = wire(STR)
    group_size: int = wire(COUNT)
    compute_dtype: str = wire(DTYPE)
    layer_start: int = wire(COUNT)
    layer_end_exclusive: int = wire(COUNT)
    config: dict[str, Any] = wire(_JsonMap())  # config.json's contents
    tensor_count: int = wire(COUNT)  # tensors in the layer range; a checkpoint with more has weights tc would skip
    threads: int | None = wire(_Optional(COUNT), default=None)  # torch threads, from the entry (None: worker's own)
    max_sequences: int = wire(_Int(1), default=1)  # KV caches the worker holds at once: the head's max_batch
    # the positions a sequence may use, the topology's context_length (None: the model's own), which some rotary
    # embeddings (longrope) are computed for
    context_length: int | None = wire(_Optional(_Int(1)), default=None)

    def _validate(self) -> None:
        if self.layer_end_exclusive <= self.layer_start:
            raise ValueError(
                f"Assignment layer range [{self.layer_start}, {self.layer_end_exclusive}) is empty"
            )


@_message
@dataclass(frozen=True)
class LoadProgress(Message):
    """Worker -> head, optional, while loading: ``done`` of ``total`` units of ``stage`` finished."""

    TYPE: ClassVar[str] = "LOAD_PROGRESS"
    stage: str = wire(STR)  # e.g. "download", "layers"
    done: int = wire(COUNT)
    total: int = wire(COUNT)


@_message
@dataclass(frozen=True)
class LoadComplete(Message):
    """Worker -> head: the assigned layers are loaded and ready."""

    TYPE: ClassVar[str] = "LOAD_COMPLETE"
    load_seconds: float = wire(SECONDS)
    weight_bytes: int = wire(COUNT)
    device: str = wire(STR)
    compute_dtype: str = wire(DTYPE)


@_message
@dataclass(frozen=True)
class LoadFailed(Message):
    """Worker -> head: the assignment could not be loaded; ``reason`` is shown to the operator."""

    TYPE: ClassVar[str] = "LOAD_FAILED"
    reason: str = wire(STR)


@_message
@dataclass(frozen=True)
class Ping(Message):
    """Head -> worker: answer with a PONG of the same nonce and payload. An empty payload is a heartbeat; a large
    one (the size of a prefill's hidden states) measures the link's bandwidth."""

    TYPE: ClassVar[str] = "PING"
    nonce: int = wire(COUNT)
    payload: bytes = wire(BYTES, default=b"")


@_message
@dataclass(frozen=True)
class Pong(Message):
    TYPE: ClassVar[str] = "PONG"
    nonce: int = wire(COUNT)
    payload: bytes = wire(BYTES, default=b"")  # the PING's, echoed


@_message
@dataclass(frozen=True)
class Error(Message):
    """Either side: a refusal or failure outside inference; ``code`` is one of the ERROR_* constants."""

    TYPE: ClassVar[str] = "ERROR"
    code: str = wire(STR)
    message: str = wire(STR)


# --- inference -------------------------------------------------------------------------------------------------
# Tensor-carrying messages compare by identity (eq=False): == on tensors is elementwise, not a truth value. They
# also use WireStruct's repr (repr=False here), which shows a tensor's dtype and shape instead of its values.


@_message
@dataclass(frozen=True)
class ClearCache(Message):
    """Head -> worker: drop every sequence's KV cache. No reply."""

    TYPE: ClassVar[str] = "CLEAR_CACHE"


@_message
@dataclass(frozen=True)
class Release(Message):
    """Head -> worker: these sequences ended; drop their KV caches (unknown ones are ignored). No reply."""

    TYPE: ClassVar[str] = "RELEASE"
    sequences: tuple[int, ...] = wire(_TupleOf(COUNT))


@_message
@dataclass(frozen=True)
class Route(Message):
    """Head -> worker: how a RUN_BATCH of route `route` travels on from this worker.

    With `next_host`, the worker sends its output straight to the next stage's peer listener, proving it was told
    to with `next_key`; without, it replies to the head. `inbound_key` is what the stage before it must prove
    (None: this stage takes hidden states from the head only). A newer route replaces an older one.
    """

    TYPE: ClassVar[str] = "ROUTE"
    route: int = wire(_Int(1))
    next_host: str | None = wire(_Optional(STR))
    next_port: int | None = wire(_Optional(PORT))
    next_key: bytes | None = wire(_Optional(BYTES))
    inbound_key: bytes | None = wire(_Optional(BYTES))

    def _validate(self) -> None:
        if (self.next_host is None) != (self.next_port is None) or (self.next_host is None) != (self.next_key is None):
            raise ValueError("Route: next_host, next_port and next_key are given together or not at all")


@_message
@dataclass(frozen=True)
class PeerChallenge(Message):
    """Worker -> worker, first on a peer connection, from the one that listens: prove you know the route's key."""

    TYPE: ClassVar[str] = "PEER_CHALLENGE"
    nonce: bytes = wire(BYTES)


@_message
@dataclass(frozen=True)
class PeerHello(Message):
    """Worker -> worker, from the stage before: which route this link carries, the proof for its key, and a nonce
    of its own for the listener to prove the same over."""

    TYPE: ClassVar[str] = "PEER_HELLO"
    protocol_version: int = wire(COUNT)
    route: int = wire(_Int(1))
    proof: bytes = wire(BYTES)
    nonce: bytes = wire(BYTES)


@_message
@dataclass(frozen=True)
class PeerAck(Message):
    """Worker -> worker: the proof holds, and here is the listener's own (over the connector's nonce), and the
    largest frame it reads; RUN_BATCH of the route may follow."""

    TYPE: ClassVar[str] = "PEER_ACK"
    route: int = wire(_Int(1))
    proof: bytes = wire(BYTES)
    max_frame_bytes: int = wire(_Int(1))


@_wire_struct
@dataclass(frozen=True)
class BatchEntry(WireStruct):
    """One sequence's rows in a RUN_BATCH: positions [position_start, position_start + length).

    position_start 0 starts the sequence: the worker makes it a fresh cache of cache_capacity positions (prompt +
    max_tokens). Otherwise its cache must hold exactly position_start positions, and grows to cache_capacity where
    that is more (the head hands a finished request's cache to one that continues its text: its prompt is that
    request's prompt and completion and more, and its capacity its own). With a `source`, the cache starts from
    the first position_start positions of that sequence's cache, which must hold at least that many: its own
    cut back to them, or another's copied into a new cache (that one left as it is); the head does so for a
    request whose prompt shares only the start of a finished request's text. Once the entry's rows have run,
    the worker copies the sequence's cache into a new cache for each id in `copies` (replacing any it holds).
    """

    sequence: int = wire(COUNT)  # the head's id for the sequence, the key of its cache
    position_start: int = wire(COUNT)
    length: int = wire(_Int(1))
    cache_capacity: int = wire(_Int(1))
    copies: tuple[int, ...] = wire(_TupleOf(COUNT), default=())
    source: int | None = wire(_Optional(COUNT), default=None)

    def _validate(self) -> None:
        if self.position_start + self.length > self.cache_capacity:
            raise ValueError(f"sequence {self.sequence}: positions up to {self.position_start + self.length} do not "
                             f"fit its cache_capacity {self.cache_capacity}")
        if self.source is not None and self.position_start == 0:
            raise ValueError(f"sequence {self.sequence}: a source's positions start it, so position_start must be "
                             "more than 0")
        if self.sequence in self.copies or len(set(self.copies)) != len(self.copies):
            raise ValueError(f"sequence {self.sequence}: copies {list(self.copies)} must be other sequences, each "
                             "once")


@_message
@dataclass(frozen=True, eq=False, repr=False)
class RunBatch(Message):
    """Head -> worker: run the stage over a ragged batch, each entry against its own sequence's cache.

    hidden_state holds the entries' rows one after another: a prompt chunk is an entry of its length, a decode
    step an entry of length 1.
    """

    TYPE: ClassVar[str] = "RUN_BATCH"
    entries: tuple[BatchEntry, ...] = wire(_TupleOf(_Struct(BatchEntry)))
    hidden_state: WireTensor = wire(HIDDEN)  # [1, sum of the entries' lengths, hidden]
    # 0: reply to the head. Otherwise the ROUTE it travels by: each worker passes its output to the next one that
    # route names, and the last (or one that cannot pass it on) replies to the head
    route: int = wire(COUNT, default=0)
    # the compute times of the stages that passed this batch on, in order (empty from the head)
    upstream_seconds: tuple[float, ...] = wire(_TupleOf(SECONDS), default=())
    # sequences that ended before this step: dropped before the batch runs. RELEASE says so at once; this covers a
    # batch passed on by a worker overtaking the RELEASE the head sent before it
    released: tuple[int, ...] = wire(_TupleOf(COUNT), default=())

    def _validate(self) -> None:
        if not self.entries:
            raise ValueError("RunBatch has no entries")
        sequences = [e.sequence for e in self.entries]
        if len(set(sequences)) != len(sequences):
            raise ValueError(f"RunBatch names a sequence twice: {sequences}")
        copies = [c for e in self.entries for c in e.copies]
        if len(set(copies)) != len(copies) or set(copies) & set(sequences):
            raise ValueError(f"RunBatch copies {copies} must name sequences not otherwise in the batch, each once")
        if set(self.released) & (set(sequences) | set(copies)):
            raise ValueError(f"RunBatch releases {list(self.released)}, and runs or copies some of them")
        # A cache copied from holds the positions copied until the batch runs (every stage copies first): it may
        # run an entry of its own that adds positions, but not one that starts it anew, and is not copied into or
        # released. The same position_start as the copy's is what each stage checks.
        sources = {e.source for e in self.entries if e.source is not None and e.source != e.sequence}
        remade = {e.sequence for e in self.entries if e.source is not None or e.position_start == 0}
        if sources & (remade | set(copies) | set(self.released)):
            raise ValueError(f"RunBatch copies the caches of {sorted(sources)}, and starts anew, copies into or "
                             "releases some of them")
        rows = sum(e.length for e in self.entries)
        shape = self.hidden_state.shape  # of rank 3: the field's kind checked that
        if shape[0] != 1 or shape[1] != rows:
            raise ValueError(f"RunBatch hidden_state has shape {list(shape)}; its entries need [1, {rows}, hidden]")

    def passed_on(self, hidden_state: WireTensor, compute_seconds: float) -> RunBatch:
        """This batch as the next stage gets it: this stage's output for its rows, and this stage's compute time
        after the times of those before it.

        Only those two are checked: the other fields are this batch's, checked when it was made or read, and
        checking them again cost ~100 us of a hop on caches a stage's weights had just swept."""
        hidden_state = HIDDEN.check(hidden_state, "RunBatch.hidden_state")
        seconds = SECONDS.check(compute_seconds, "compute_seconds")
        if tuple(hidden_state.shape[:2]) != tuple(self.hidden_state.shape[:2]):
            raise ValueError(f"the output's shape {list(hidden_state.shape)} does not hold the batch's rows "
                             f"{list(self.hidden_state.shape[:2])}")
        passed = RunBatch.__new__(RunBatch)
        passed.__dict__.update(vars(self), hidden_state=hidden_state,
                               upstream_seconds=self.upstream_seconds + (seconds,))
        return passed

    @property
    def is_decode(self) -> bool:
        """Every entry is one position, or a few that continue its cache (a greedy sequence's draft, checked in the
        same step: tc/draft.py): a decode step, for step deadlines and metrics. Its cost is a step's reading of the
        weights, not that of a prompt's positions, which a prefill's bound scales with."""
        return all(e.length == 1 or (e.position_start > 0 and e.length <= STEP_ROWS) for e in self.entries)


@_message
@dataclass(frozen=True, eq=False, repr=False)
class HiddenState(Message):
    """Worker -> head: the stage's output for a RUN_BATCH, its rows in the same order (the last stage's, for one
    passed on from worker to worker)."""

    TYPE: ClassVar[str] = "HIDDEN_STATE"
    hidden_state: WireTensor = wire(HIDDEN)  # [1, seq, hidden]
    compute_seconds: float = wire(SECONDS)
    upstream_seconds: tuple[float, ...] = wire(_TupleOf(SECONDS), default=())  # the RUN_BATCH's, passed back


@_message
@dataclass(frozen=True)
class InferenceError(Message):
    """Worker -> head: the stage failed on a request; the request fails, the worker stays up."""

    TYPE: ClassVar[str] = "INFERENCE_ERROR"
    message: str = wire(STR)
