"""The topology file: which model, which weight mode, which machines, in pipeline order.

Theory of operation: `load_topology` reads the YAML text (the only I/O besides checking that a local model
directory exists) and hands the parsed tree to `parse_topology`, which walks it key by key and builds frozen
values. Every key is checked where it is read; the first problem raises `TopologyError`, whose text is one line
naming the file, the key path (`nodes[1].device`) and the fix. Unknown keys are errors, never ignored, so a typo
cannot silently fall back to a default.

What needs the model's layer count (a pin past the last layer, layers no node covers) is checked later by
`tc.planner.make_plan`.
"""
from __future__ import annotations

import difflib
import ipaddress
import math
import re
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from tc.draft import MAX_LIMIT as MAX_DRAFT_TOKENS
from tc.model.quant import DEFAULT_GROUP_SIZE, WEIGHT_MODES
from tc.speed import SPEED_KEYS, Speed

TOPOLOGY_VERSION = 1
QUANT_MODES = WEIGHT_MODES
DTYPES = ("fp16", "bf16", "fp32")
DEVICE_KINDS = ("auto", "cpu", "cuda", "mps")
# Only CUDA numbers its devices; "cpu:0" or "mps:1" would only hide a typo.
# Each pattern is matched against the whole text (fullmatch: `$` would also match before a final newline), in
# ASCII only (`\d` and `\w` take any script's digits and letters).
# A device's number as torch writes it, no leading zero: "cuda:01" names what torch refuses, and no worker offers it
DEVICE_PATTERN = re.compile(r"(auto|cpu|mps|cuda)(?::(0|[1-9][0-9]{0,3}))?")
NODE_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")
REPO_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")
_HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?")  # one dot-separated part of a host name
_PORT_PATTERN = re.compile(r"[0-9]{1,5}")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# An origin as a browser sends it in Origin: scheme://host[:port], nothing after (RFC 6454)
_ORIGIN_PATTERN = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<host>\[[0-9A-Fa-f:.]+\]|[^/?#:@\[\]\s]+)"
                             r"(?::(?P<port>[0-9]{1,5}))?")
_DEFAULT_PORTS = {"http": 80, "https": 443}
_ORIGIN_EXAMPLE = '["http://localhost:5173"]'

DEFAULT_MAX_QUEUE = 16
DEFAULT_HEARTBEAT_S = 5.0
HEARTBEAT_MISSES = 3  # default silence limit, in heartbeat intervals
DEFAULT_MAX_FRAME_MB = 256.0  # a 32k-token fp32 prefill of a 896-wide model is 117 MB
DEFAULT_RESUME_GRACE_S = 15.0
DEFAULT_PREFILL_CHUNK = 256  # prompt positions per step while other sequences decode
DEFAULT_STEP_TIMEOUT_S = 30.0  # the floor of a step's bound (tc.head.step_deadline)
DEFAULT_STEP_TIMEOUT_FACTOR = 10.0
MIN_JOIN_TOKEN_CHARS = 16
MIN_API_KEY_CHARS = 16
# The most (and least) each key takes: past these a value only overflows or breaks what uses it (a body limit of 0
# bytes, a heartbeat that never comes or comes every nanosecond, a thread per queued request by the million).
MAX_COUNT = 1 << 20  # prefill_chunk, and any count without a bound of its own
MAX_THREADS = 1024
MAX_QUEUE = 4096  # each waiting request holds one of the API's threads
MAX_BATCH = 1024
MAX_MICRO_BATCHES = 64
MAX_GROUP_SIZE = 1 << 16
MIN_CONTEXT = 2  # a one-token prompt and one token generated
MAX_CONTEXT = 1 << 24  # past what any model holds; the head checks the model's own figure
MAX_SECONDS = 86_400.0
HEARTBEAT_RANGE_S = (0.05, 3600.0)
SIZE_RANGE_MB = (1 / 1024, float(1 << 16))  # max_frame_mb and max_body_mb: 1 KiB to 64 GiB
MAX_MEMORY_GB = float(1 << 20)
MAX_STEP_FACTOR = 1000.0
MAX_GBPS = 1e6
MAX_LAYER_MS = 1e6
MIB = 1 << 20
GIB = 1 << 30  # max_memory_gb counts GiB: what nvidia-smi and Activity Monitor mean by "GB"

TOP_KEYS = ("version", "model", "name", "revision", "quant", "group_size", "dtype", "context_length", "hf_cache_dir",
            "chat_template", "reasoning_content", "head", "nodes")
HEAD_KEYS = ("api", "listen", "threads", "max_queue", "max_batch", "prefill_chunk", "micro_batches", "direct_hops",
             "prefix_cache", "draft_tokens", "heartbeat_s", "heartbeat_timeout_s", "resume", "resume_grace_s",
             "join_token", "max_frame_mb", "max_body_mb", "step_timeout_s", "step_timeout_factor", "speed", "plan_from",
             "cors_origins", "api_keys")
PLAN_SOURCES = ("topology", "workers")
NODE_KEYS = ("id", "device", "dtype", "max_memory_gb", "layers", "threads", "spare", "speed")
_DEVICE_HINT = "use auto, cpu, cuda, cuda:N or mps"


class TopologyError(ValueError):
    """The topology file is unreadable or says something tc cannot run.

    `key_path` names the offending key (`nodes[1].device`), empty when the problem is the file as a whole;
    `source` names the file. `str()` is one line: "SOURCE: KEY_PATH: MESSAGE".
    """

    def __init__(self, key_path: str, message: str, source: str = "topology") -> None:
        super().__init__(key_path, message, source)
        self.key_path = key_path
        self.message = " ".join(message.split())  # one line, whatever a YAML message carried
        self.source = source

    def __str__(self) -> str:
        where = f"{self.key_path}: " if self.key_path else ""
        return f"{self.source}: {where}{self.message}"


class DeviceError(ValueError):
    """A device string is not one tc knows."""


class AddressError(ValueError):
    """A HOST:PORT string is malformed or its port is out of range."""


@dataclass(frozen=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class HeadSettings:
    api: HostPort
    listen: HostPort
    threads: int | None
    max_queue: int
    heartbeat_s: float
    heartbeat_timeout_s: float | None = None  # None: HEARTBEAT_MISSES intervals
    resume: bool = True  # replay a request on a refilled entry instead of failing it
    resume_grace_s: float = DEFAULT_RESUME_GRACE_S
    join_token: str | None = field(default=None, repr=False)  # a secret: never in logs or reprs
    max_frame_mb: float = DEFAULT_MAX_FRAME_MB
    max_body_mb: float | None = None  # None: from the model's context (tc.head.api.body_limit)
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S  # a step's bound: this floor + factor x its slowest recent
    step_timeout_factor: float = DEFAULT_STEP_TIMEOUT_FACTOR
    max_batch: int | None = None  # sequences generating at once; None: as many as memory allows, up to 8
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    micro_batches: int = 1  # groups a step's batch is cut into, so that stages work at the same time
    direct_hops: bool = True  # workers pass hidden states straight to the next worker, not back through the head
    prefix_cache: bool = True  # a finished request's caches kept for the request that continues its text
    draft_tokens: int = MAX_DRAFT_TOKENS  # tokens a greedy request may guess ahead in one step (tc/draft.py); 0: none
    speed: Speed | None = None  # the head machine's own (its lm_head share of a token), from `worker --bench`
    plan_from: str = "topology"  # "workers": plan once from the planned set's own measurements in HELLO
    cors_origins: tuple[str, ...] = ()  # browser origins whose pages may read the API's replies; ("*",): any
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # secrets: never in logs or reprs; (): an open API

    @property
    def silence_limit_s(self) -> float:
        """How long a worker may stay silent before it counts as lost."""
        if self.heartbeat_timeout_s is not None:
            return self.heartbeat_timeout_s
        return HEARTBEAT_MISSES * self.heartbeat_s

    @property
    def max_frame_bytes(self) -> int:
        return int(self.max_frame_mb * MIB)

    @property
    def max_body_bytes(self) -> int | None:
        return None if self.max_body_mb is None else int(self.max_body_mb * MIB)


@dataclass(frozen=True)
class NodeEntry:
    id: str
    device: str
    dtype: str | None  # None: the topology's dtype
    max_memory_gb: float | None
    layers: tuple[int, int] | None  # pinned half-open [start, end)
    threads: int | None
    spare: bool = False  # outside the layer split: stands by to fill any lost entry
    speed: Speed | None = None  # an operator's copy of the machine's `worker --bench` figures


@dataclass(frozen=True)
class Topology:
    version: int
    model: str  # a HuggingFace repo id, or (model_is_local) an absolute directory path
    model_is_local: bool
    name: str  # what clients call the model: `name:`, else the repo id, else the directory's name
    revision: str | None
    quant: str
    group_size: int
    dtype: str
    hf_cache_dir: Path | None
    head: HeadSettings
    nodes: tuple[NodeEntry, ...]
    chat_template: Path | None = None  # a Jinja file that replaces the model's own chat template (head only)
    context_length: int | None = None  # positions a sequence may use; None: the model's (head.main.with_context)
    # chat replies give a thinking model's thinking in reasoning_content, apart from the answer; None: auto, where
    # the vocabulary has <think> and </think> and the chat template writes them (head/reasoning.py)
    reasoning_content: bool | None = None

    def with_ports(self, api_port: int | None = None, listen_port: int | None = None) -> Topology:
        """A copy with the head's API and/or listen port replaced (0 lets the OS pick, for tests)."""
        api, listen = self.head.api, self.head.listen
        if api_port is not None:
            api = HostPort(api.host, _check_port(api_port, allow_zero=True))
        if listen_port is not None:
            listen = HostPort(listen.host, _check_port(listen_port, allow_zero=True))
        if listen.port != 0 and _same_port(api, listen):
            raise TopologyError("head.listen", f"port {listen.port} is also head.api's port (after --api-port / "
                                "--listen-port); give them different ports")
        return replace(self, head=replace(self.head, api=api, listen=listen))

    def node(self, node_id: str) -> NodeEntry:
        """The entry with this id. Raises KeyError naming the ids there are."""
        for entry in self.nodes:
            if entry.id == node_id:
                return entry
        raise KeyError(f"no node {node_id!r} in the topology; its nodes are {', '.join(self.node_ids)}")

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(entry.id for entry in self.nodes)

    @property
    def pipeline_nodes(self) -> tuple[NodeEntry, ...]:
        """The entries the layers are split over, in pipeline order (every entry but the spares)."""
        return tuple(entry for entry in self.nodes if not entry.spare)

    @property
    def spare_nodes(self) -> tuple[NodeEntry, ...]:
        return tuple(entry for entry in self.nodes if entry.spare)

    def without_spares(self) -> Topology:
        """A copy listing only the pipeline entries: what the planner splits the layers over."""
        return replace(self, nodes=self.pipeline_nodes)

    def to_dict(self) -> dict[str, Any]:
        """The topology as a YAML-ready tree that `parse_topology` reads back to an equal value."""
        nodes: list[dict[str, Any]] = []
        for entry in self.nodes:
            item: dict[str, Any] = {"id": entry.id, "device": entry.device}
            if entry.dtype is not None:
                item["dtype"] = entry.dtype
            if entry.max_memory_gb is not None:
                item["max_memory_gb"] = entry.max_memory_gb
            if entry.layers is not None:
                item["layers"] = f"{entry.layers[0]}-{entry.layers[1] - 1}"
            if entry.threads is not None:
                item["threads"] = entry.threads
            if entry.spare:
                item["spare"] = True
            if entry.speed is not None:
                item["speed"] = entry.speed.as_topology(rounded=False)
            nodes.append(item)
        head: dict[str, Any] = {
            "api": str(self.head.api),
            "listen": str(self.head.listen),
            "max_queue": self.head.max_queue,
            "heartbeat_s": self.head.heartbeat_s,
        }
        if self.head.threads is not None:
            head["threads"] = self.head.threads
        if self.head.max_batch is not None:
            head["max_batch"] = self.head.max_batch
        if self.head.prefill_chunk != DEFAULT_PREFILL_CHUNK:
            head["prefill_chunk"] = self.head.prefill_chunk
        if self.head.micro_batches != 1:
            head["micro_batches"] = self.head.micro_batches
        if not self.head.direct_hops:
            head["direct_hops"] = False
        if not self.head.prefix_cache:
            head["prefix_cache"] = False
        if self.head.draft_tokens != MAX_DRAFT_TOKENS:
            head["draft_tokens"] = self.head.draft_tokens
        if self.head.heartbeat_timeout_s is not None:
            head["heartbeat_timeout_s"] = self.head.heartbeat_timeout_s
        if not self.head.resume:
            head["resume"] = False
        if self.head.resume_grace_s != DEFAULT_RESUME_GRACE_S:
            head["resume_grace_s"] = self.head.resume_grace_s
        if self.head.join_token is not None:
            head["join_token"] = self.head.join_token
        if self.head.max_frame_mb != DEFAULT_MAX_FRAME_MB:
            head["max_frame_mb"] = self.head.max_frame_mb
        if self.head.max_body_mb is not None:
            head["max_body_mb"] = self.head.max_body_mb
        if self.head.step_timeout_s != DEFAULT_STEP_TIMEOUT_S:
            head["step_timeout_s"] = self.head.step_timeout_s
        if self.head.step_timeout_factor != DEFAULT_STEP_TIMEOUT_FACTOR:
            head["step_timeout_factor"] = self.head.step_timeout_factor
        if self.head.speed is not None:
            head["speed"] = self.head.speed.as_topology(rounded=False)
        if self.head.plan_from != "topology":
            head["plan_from"] = self.head.plan_from
        if self.head.cors_origins:
            head["cors_origins"] = list(self.head.cors_origins)
        if self.head.api_keys:
            head["api_keys"] = list(self.head.api_keys)
        data: dict[str, Any] = {
            "version": self.version,
            "model": self.model,
            "quant": self.quant,
            "group_size": self.group_size,
            "dtype": self.dtype,
            "head": head,
            "nodes": nodes,
        }
        if self.revision is not None:
            data["revision"] = self.revision
        if self.name != _default_name(self.model, self.model_is_local):
            data["name"] = self.name
        if self.hf_cache_dir is not None:
            data["hf_cache_dir"] = str(self.hf_cache_dir)
        if self.chat_template is not None:
            data["chat_template"] = str(self.chat_template)
        if self.context_length is not None:
            data["context_length"] = self.context_length
        if self.reasoning_content is not None:
            data["reasoning_content"] = self.reasoning_content
        return data


def _default_name(model: str, is_local: bool) -> str:
    return Path(model).name if is_local else model


def parse_device(text: str) -> tuple[str, int | None]:
    """Split a device string into (kind, index): "cuda:1" -> ("cuda", 1), "mps" -> ("mps", None).

    Raises DeviceError for anything but auto, cpu, cuda, cuda:N or mps.
    """
    match = DEVICE_PATTERN.fullmatch(text) if isinstance(text, str) else None
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise DeviceError(f"{text!r} is not a device; {_DEVICE_HINT}")
    index = match.group(2)
    return match.group(1), (int(index) if index is not None else None)


def parse_host_port(text: str, example: str = "0.0.0.0:8000") -> HostPort:
    """Parse "host:port" (IPv6 as "[::1]:7001"), port 1-65535. Raises AddressError saying what to write, with
    `example` as the address to write (the worker's --join gives the head's listen address)."""
    if not isinstance(text, str):
        raise AddressError(f"expected \"host:port\" like {example}, got {_describe(text)}")
    scheme, sep, _ = text.partition("://")
    if sep and scheme and "[" not in scheme:  # a URL pasted in: its colon would read as an IPv6 host's
        raise AddressError(f"{text!r} is a URL; write host:port alone, without {scheme}://, like {example}")
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text or text.endswith("]"):  # "[::1]": the last colon is the address's own
        raise AddressError(f"{text!r} has no port; write host:port like {example}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        valid_host = _is_ip(host, ipaddress.IPv6Address)
    else:
        if ":" in host:
            alone = _is_ip(text, ipaddress.IPv6Address)  # "::1": an address alone, or its host and a port?
            if _is_ip(host, ipaddress.IPv6Address) and _PORT_PATTERN.fullmatch(port_text):
                either = f", or for the address {text} itself [{text}]:PORT" if alone else ""
                raise AddressError(f"{text!r}: put an IPv6 host in brackets, then the port: [{host}]:{port_text}"
                                   f"{either}")
            if alone:
                raise AddressError(f"{text!r} is an IPv6 address with no port; write it in brackets, then the port: "
                                   f"[{text}]:PORT")
            # "10.0.0.5:7001:7001", "head:8000:7001": a port too many
            raise AddressError(f"{text!r} holds more than one ':'; write one host and one port, like {example}")
        valid_host = _is_host_name(host)
    if not valid_host:
        raise AddressError(f"{text!r} has no valid host; write host:port like {example} or localhost:7001")
    if not _PORT_PATTERN.fullmatch(port_text):
        raise AddressError(f"{text!r}: port {port_text!r} is not a number; write host:port like {example}")
    return HostPort(host, _check_port(int(port_text), allow_zero=False))


def _same_port(api: HostPort, listen: HostPort) -> bool:
    """Whether the two addresses would listen on one port: the same port on a wildcard, or on hosts that share an
    address (a name is the addresses it resolves to: localhost and 127.0.0.1 are one)."""
    if api.port != listen.port:
        return False
    if api.host in WILDCARD_HOSTS or listen.host in WILDCARD_HOSTS:
        return True
    return bool(_host_addresses(api.host) & _host_addresses(listen.host))


def _host_addresses(host: str) -> set[str]:
    """The addresses `host` stands for: itself where it is one, else what it resolves to (none where it does not,
    and binding it then fails with its own error, naming the key)."""
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        return {str(ipaddress.ip_address(found[4][0].split("%")[0])) for found in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError, ValueError):
        return set()


def _is_ip(text: str, kind: type) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


def _is_host_name(host: str) -> bool:
    """An IPv4 address (four numbers 0-255), or a host name: dot-separated parts of letters, digits, '_' and '-'
    (not at either end of a part)."""
    if re.fullmatch(r"[0-9.]+", host):
        return _is_ip(host, ipaddress.IPv4Address)
    return 0 < len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in host.split("."))


def _is_origin_host(host: str) -> bool:
    if host.startswith("["):
        return _is_ip(host[1:-1], ipaddress.IPv6Address)
    return _is_host_name(host)


def _check_port(port: int, allow_zero: bool) -> int:
    low = 0 if allow_zero else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
        raise AddressError(f"port {port!r} is out of range; use {low}-65535")
    return port


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key; SafeLoader reports it itself
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"the key {key!r} is given twice; keep one", key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


# Numbers without YAML 1.1's base 60 and octal (PyYAML's): a plain `1:10` (a layer range written with a colon)
# was the base-60 number 70, and `0755` the octal 493. Such text, and any whole number written with a leading zero,
# stays text now, which a key then refuses with its form (`threads: 07`) or takes as text (`id: 01`)
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_UniqueKeyLoader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0b[01_]+|0x[0-9a-fA-F_]+)$"), list("-+0123456789"))
_UniqueKeyLoader.add_implicit_resolver(
    _FLOAT, re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
                    |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))


def load_topology(path: Path) -> Topology:
    """Read and check a topology file. Raises TopologyError naming the file, the key and the fix."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TopologyError("", f"cannot read the file: {exc.strerror or exc}; check the path", source) from exc
    except UnicodeDecodeError as exc:
        raise TopologyError("", f"not UTF-8 text ({exc.reason}); save it as UTF-8", source) from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        raise TopologyError("", _yaml_error_text(exc), source) from exc
    except yaml.YAMLError as exc:
        raise TopologyError("", f"YAML error: {exc}", source) from exc
    except RecursionError as exc:  # the YAML reader recurses once per level of nesting
        raise TopologyError("", "lists or mappings nested hundreds of levels deep; a topology is a few levels",
                            source) from exc
    return parse_topology(data, path.parent, source=source)


def _yaml_error_text(exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = exc.problem or exc.context or "invalid YAML"
    hint = "fix the YAML there"
    if "\t" in problem or "'\\t'" in problem:
        hint = "indent with spaces, not tabs"
    elif "twice" in problem:
        hint = "remove the repeated key"
    return f"{where}{problem}; {hint}"


def parse_topology(data: object, base_dir: Path, *, source: str = "topology") -> Topology:
    """Build a Topology from the parsed YAML tree. `base_dir` anchors a relative local model path.

    Raises TopologyError (key path + fix) on the first problem found.
    """
    return _Parser(Path(base_dir), source).topology(data)


def _describe(value: object) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"a boolean ({'true' if value else 'false'}; YAML reads yes/no/on/off as booleans)"
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return f"{type(value).__name__} {value!r}"


def _shown(value: object) -> str:
    """A number as an error quotes it: a whole number of hundreds of digits cut short."""
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} digits)"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if not (_is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(value)  # type: ignore[arg-type]
    except OverflowError:  # an integer past any float
        return False


class _Parser:
    """Walks the YAML tree; each method checks one key and raises TopologyError at its key path."""

    def __init__(self, base_dir: Path, source: str) -> None:
        self.base_dir = base_dir
        self.source = source

    def fail(self, key_path: str, message: str) -> TopologyError:
        return TopologyError(key_path, message, self.source)

    def mapping(self, value: object, path: str, allowed: tuple[str, ...], what: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"expected {what}, got {_describe(value)}")
        for key in value:
            if not isinstance(key, str):
                raise self.fail(path, f"key {key!r} is not a name; keys are: {', '.join(allowed)}")
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
                guess = f"did you mean {close[0]!r}? " if close else ""
                shown = key if NODE_ID_PATTERN.fullmatch(key) else repr(key)  # a newline or a space: quoted
                key_path = f"{path}.{shown}" if path else shown
                raise self.fail(key_path, f"unknown key; {guess}allowed keys here: {', '.join(allowed)}")
        return value

    def required(self, section: Mapping[str, Any], key: str, path: str, example: str) -> Any:
        if key not in section or section[key] is None:
            raise self.fail(_join(path, key), f"missing; add it, e.g. {key}: {example}")
        return section[key]

    def integer(self, value: object, path: str, minimum: int, hint: str = "", maximum: int = MAX_COUNT) -> int:
        if not _is_int(value):
            raise self.fail(path, f"expected a whole number >= {minimum}, got {_describe(value)}{hint}")
        if value < minimum:  # type: ignore[operator]
            raise self.fail(path, f"{_shown(value)} is too small; use a whole number >= {minimum}{hint}")
        if value > maximum:  # type: ignore[operator]
            raise self.fail(path, f"{_shown(value)} is more than this key takes; use at most {maximum}{hint}")
        return value  # type: ignore[return-value]

    def positive_number(self, value: object, path: str, unit: str, maximum: float, minimum: float = 0.0) -> float:
        """A number of `unit` in (0, maximum], or in [minimum, maximum] for a `minimum` above 0: every key has a
        most that makes sense, past which the value would overflow or break what uses it."""
        if not _is_number(value):
            raise self.fail(path, f"expected a positive number of {unit}, got {_describe(value)}")
        if value <= 0:  # type: ignore[operator]
            raise self.fail(path, f"{value} is not positive; give a number of {unit} > 0")
        if value < minimum:  # type: ignore[operator]
            raise self.fail(path, f"{value} is too small; give at least {minimum:g} {unit}")
        if value > maximum:  # type: ignore[operator]
            raise self.fail(path, f"{_shown(value)} is more than this key takes; give at most {maximum:g} {unit}")
        return float(value)  # type: ignore[arg-type]

    def string(self, value: object, path: str) -> str:
        if not isinstance(value, str) or not value.strip():
            quote = f'; quote it: "{value}"' if _is_number(value) else ""
            raise self.fail(path, f"expected text, got {_describe(value)}{quote}")
        return value

    def choice(self, value: object, path: str, allowed: tuple[str, ...], what: str) -> str:
        if not isinstance(value, str) or value not in allowed:
            shown = repr(value) if isinstance(value, str) else _describe(value)
            raise self.fail(path, f"{shown} is not a {what}; use {' | '.join(allowed)}")
        return value

    def address(self, value: object, path: str) -> HostPort:
        try:
            return parse_host_port(value)  # type: ignore[arg-type]
        except AddressError as exc:
            raise self.fail(path, str(exc)) from exc

    def topology(self, data: object) -> Topology:
        if data is None:
            raise self.fail("", "the file is empty; start from topology.example.yaml")
        top = self.mapping(data, "", TOP_KEYS, "a mapping of model, quant, dtype, head and nodes")
        version = top.get("version", TOPOLOGY_VERSION)
        if not _is_int(version) or version != TOPOLOGY_VERSION:
            shown = version if _is_int(version) else _describe(version)
            raise self.fail(
                "version", f"{shown} is not a topology format this tc reads; write version: {TOPOLOGY_VERSION}"
            )
        model, is_local = self.model(self.required(top, "model", "", "Qwen/Qwen2.5-0.5B-Instruct"))
        revision = None if top.get("revision") is None else self.revision(top["revision"], "revision")
        if revision is not None and is_local:  # nothing would read it: say so rather than serve another version
            raise self.fail("revision", f"{revision!r} names a version of a HuggingFace repo, and model is a local "
                            f"directory ({model}), which has none: remove revision, or give model as a repo id")
        name = _default_name(model, is_local) if top.get("name") is None else self.string(top["name"], "name")
        quant = self.choice(self.required(top, "quant", "", "int8"), "quant", QUANT_MODES, "weight mode")
        group_size = top.get("group_size", DEFAULT_GROUP_SIZE)
        group_size = self.integer(group_size, "group_size", 2, "; the int4 group size, e.g. 128", MAX_GROUP_SIZE)
        if group_size % 2:
            raise self.fail("group_size", f"{group_size} is odd; int4 packs two values a byte: use e.g. 128")
        dtype = self.choice(self.required(top, "dtype", "", "bf16"), "dtype", DTYPES, "compute dtype")
        cache = top.get("hf_cache_dir")
        hf_cache_dir = None if cache is None else self.local_path(self.string(cache, "hf_cache_dir"), "hf_cache_dir")
        chat_template = self.optional(top, "chat_template", "", self.template_file)
        context_length = self.optional(top, "context_length", "", lambda value, path: self.integer(
            value, path, MIN_CONTEXT, "; the positions a sequence may use, prompt and completion, e.g. 8192",
            MAX_CONTEXT))
        reasoning_content = self.auto_boolean(top.get("reasoning_content", "auto"), "reasoning_content")
        head = self.head(self.required(top, "head", "", "{api: 0.0.0.0:8000, listen: 0.0.0.0:7001}"))
        nodes = self.nodes(self.required(top, "nodes", "", "[{id: gpu-box, device: cuda:0}]"))
        return Topology(
            version=version, model=model, model_is_local=is_local, name=name, revision=revision, quant=quant,
            group_size=group_size, dtype=dtype, hf_cache_dir=hf_cache_dir, head=head, nodes=nodes,
            chat_template=chat_template, context_length=context_length, reasoning_content=reasoning_content,
        )

    def revision(self, value: object, path: str) -> str:
        # what git allows in a ref name (a branch, a tag) or a commit hash: a newline or a space would only fail
        # at the download, after the head has started
        text = self.string(value, path)
        if re.search(r"[\x00-\x20\x7f~^:?*\[\\]", text) or ".." in text or "@{" in text:
            raise self.fail(path, f"{text[:80]!r} is not a git revision: give a branch, tag or commit hash (no "
                            "spaces, control characters, ~^:?*[\\ or '..'), e.g. main")
        return text

    def local_path(self, text: str, key: str) -> Path:
        try:
            path = Path(text).expanduser()
            return path if path.is_absolute() else (self.base_dir / path).resolve()
        except (OSError, RuntimeError, ValueError) as exc:  # ~nosuchuser, a NUL byte, a name too long
            raise self.unusable_path(key, text, exc) from exc

    def is_dir(self, path: Path, key: str) -> bool:
        return self.exists(path, key, Path.is_dir)

    def is_file(self, path: Path, key: str) -> bool:
        return self.exists(path, key, Path.is_file)

    def exists(self, path: Path, key: str, test: Callable[[Path], bool]) -> bool:
        try:
            return test(path)
        except (OSError, ValueError) as exc:  # a name too long for the file system
            raise self.unusable_path(key, str(path), exc) from exc

    def unusable_path(self, key: str, text: str, exc: Exception) -> TopologyError:
        return self.fail(key, f"{text[:80]!r} is not a usable path ({exc}); give a path on this machine")

    def template_file(self, value: object, path: str) -> Path:
        # read by the head when it loads the tokenizer; checked here so a wrong path fails before anything loads
        file = self.local_path(self.string(value, path), path)
        if not self.is_file(file, path):
            raise self.fail(path, f"{value}: no such file; give the path of a Jinja chat template file (relative "
                            "paths are relative to this file), or remove the key to use the model's own template")
        return file

    def model(self, value: object) -> tuple[str, bool]:
        text = self.string(value, "model")
        example = "Qwen/Qwen2.5-0.5B-Instruct"
        looks_local = text.startswith(("/", ".", "~")) or self.is_dir(self.base_dir / text, "model")
        if not looks_local:
            if not REPO_ID_PATTERN.fullmatch(text) or ".." in text:
                raise self.fail(
                    "model",
                    f"{text!r} is neither a HuggingFace repo id (org/name) nor a directory next to the file; "
                    f"give a repo id like {example} or a local path like ./models/qwen",
                )
            in_cwd = Path.cwd() / text
            if self.is_file(in_cwd / "config.json", "model"):  # a model there, not next to the file
                # read as a repo id, it would be looked for on the Hub (a minute of retries offline)
                raise self.fail(
                    "model",
                    f"{text!r} is a directory of the current one ({in_cwd}), not of this file's "
                    f"({self.base_dir.resolve()}), so it reads as a HuggingFace repo id; a local model's relative "
                    f"path is relative to the topology file: write the absolute path {in_cwd}",
                )
            return text, False
        path = self.local_path(text, "model")
        if self.is_file(path, "model"):
            where = "" if str(path) == text else f" ({path})"
            raise self.fail("model", f"{text} is a file{where}; give the directory that holds config.json and the "
                            "*.safetensors files")
        if not self.is_dir(path, "model"):
            raise self.fail(
                "model",
                f"{text}: no such directory ({path}: relative paths are relative to the topology file); give an "
                f"existing local model directory or a HuggingFace repo id like {example}",
            )
        if not self.is_file(path / "config.json", "model"):
            raise self.fail(
                "model", f"{text}: has no config.json; point model at the directory holding config.json and "
                "the *.safetensors files",
            )
        return str(path), True

    def head(self, value: object) -> HeadSettings:
        head = self.mapping(value, "head", HEAD_KEYS, "a mapping with api and listen")
        api = self.address(self.required(head, "api", "head", "0.0.0.0:8000"), "head.api")
        listen = self.address(self.required(head, "listen", "head", "0.0.0.0:7001"), "head.listen")
        if _same_port(api, listen):
            raise self.fail("head.listen", f"port {listen.port} is also head.api's port; give them different ports")
        threads = self.optional(head, "threads", "head", lambda v, p: self.integer(v, p, 1, maximum=MAX_THREADS))
        max_queue = self.integer(head.get("max_queue", DEFAULT_MAX_QUEUE), "head.max_queue", 1, maximum=MAX_QUEUE)
        max_batch = self.optional(head, "max_batch", "head", lambda v, p: self.integer(v, p, 1, maximum=MAX_BATCH))
        prefill_chunk = self.integer(head.get("prefill_chunk", DEFAULT_PREFILL_CHUNK), "head.prefill_chunk", 1)
        micro_batches = self.integer(head.get("micro_batches", 1), "head.micro_batches", 1,
                                     maximum=MAX_MICRO_BATCHES)
        direct_hops = self.boolean(head.get("direct_hops", True), "head.direct_hops")
        prefix_cache = self.boolean(head.get("prefix_cache", True), "head.prefix_cache")
        draft_tokens = self.integer(head.get("draft_tokens", MAX_DRAFT_TOKENS), "head.draft_tokens", 0,
                                    " (0: every step makes one token)", maximum=MAX_DRAFT_TOKENS)
        heartbeat = head.get("heartbeat_s", DEFAULT_HEARTBEAT_S)
        low, high = HEARTBEAT_RANGE_S
        heartbeat_s = self.positive_number(heartbeat, "head.heartbeat_s", "seconds", high, low)
        timeout = self.optional(head, "heartbeat_timeout_s", "head",
                                lambda v, p: self.positive_number(v, p, "seconds", MAX_SECONDS))
        if timeout is not None and timeout <= heartbeat_s:
            raise self.fail("head.heartbeat_timeout_s", f"{timeout:g} s is not longer than heartbeat_s "
                            f"({heartbeat_s:g} s), so a healthy worker would count as lost between two pings; "
                            f"give at least {2 * heartbeat_s:g}")
        resume = self.boolean(head.get("resume", True), "head.resume")
        grace = head.get("resume_grace_s", DEFAULT_RESUME_GRACE_S)
        resume_grace_s = self.positive_number(grace, "head.resume_grace_s", "seconds", MAX_SECONDS)
        # as with api_keys: written without its value (YAML null) must not let anyone join
        join_token = self.join_token(head["join_token"], "head.join_token") if "join_token" in head else None
        low, high = SIZE_RANGE_MB
        max_frame_mb = self.positive_number(head.get("max_frame_mb", DEFAULT_MAX_FRAME_MB), "head.max_frame_mb",
                                            "MiB", high, low)
        max_body_mb = head.get("max_body_mb")
        if max_body_mb is not None:
            max_body_mb = self.positive_number(max_body_mb, "head.max_body_mb", "MiB", high, low)
        step_timeout_s = self.positive_number(head.get("step_timeout_s", DEFAULT_STEP_TIMEOUT_S),
                                              "head.step_timeout_s", "seconds", MAX_SECONDS)
        step_factor = self.step_factor(head.get("step_timeout_factor", DEFAULT_STEP_TIMEOUT_FACTOR),
                                       "head.step_timeout_factor")
        speed = self.optional(head, "speed", "head", self.speed)
        plan_from = self.choice(head.get("plan_from", "topology"), "head.plan_from", PLAN_SOURCES, "plan source")
        cors_origins = self.optional(head, "cors_origins", "head", self.cors_origins) or ()
        # written but empty (a YAML "api_keys:" whose keys are commented out) must not leave the API open
        api_keys = self.api_keys(head["api_keys"], "head.api_keys") if "api_keys" in head else ()
        return HeadSettings(api=api, listen=listen, threads=threads, max_queue=max_queue, heartbeat_s=heartbeat_s,
                            heartbeat_timeout_s=timeout, resume=resume, resume_grace_s=resume_grace_s,
                            join_token=join_token, max_frame_mb=max_frame_mb, max_body_mb=max_body_mb,
                            step_timeout_s=step_timeout_s, step_timeout_factor=step_factor, max_batch=max_batch,
                            prefill_chunk=prefill_chunk, micro_batches=micro_batches, direct_hops=direct_hops,
                            speed=speed, plan_from=plan_from, prefix_cache=prefix_cache, draft_tokens=draft_tokens,
                            cors_origins=cors_origins, api_keys=api_keys)

    def cors_origins(self, value: object, path: str) -> tuple[str, ...]:
        """The origins a browser may call the API from. Each is compared as text with the Origin header a browser
        sends, so one written otherwise (a path, a trailing slash, capitals, a default port) would never match:
        refused here, with the form that would."""
        if not isinstance(value, list):
            shown = f"[{value!r}]" if isinstance(value, str) else _ORIGIN_EXAMPLE
            raise self.fail(path, f"expected a list of origins, got {_describe(value)}; write e.g. cors_origins: "
                            f"{shown}")
        origins = tuple(self.origin(item, f"{path}[{i}]") for i, item in enumerate(value))
        if "*" in origins and len(origins) > 1:
            raise self.fail(path, '"*" allows every origin, so the others add nothing; give ["*"] alone, or only '
                            "the origins")
        if len(set(origins)) < len(origins):
            repeated = next(origin for origin in origins if origins.count(origin) > 1)
            raise self.fail(path, f"{repeated!r} is listed twice; keep one")
        return origins

    def origin(self, value: object, path: str) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"expected an origin like \"http://localhost:5173\", got {_describe(value)}")
        if value == "*":
            return value
        if value == "null":  # what a page opened from a file, or any sandboxed frame, sends
            raise self.fail(path, "'null' is the origin of every page opened from a file and of any sandboxed "
                            "frame, so it would let any of them in; serve the page over HTTP (python -m "
                            "http.server) and list that origin, or use [\"*\"]")
        match = _ORIGIN_PATTERN.fullmatch(value)
        if match is None or not _is_origin_host(match["host"]) or int(match["port"] or 1) > 65535:
            scheme, sep, rest = value.partition("://")
            host = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
            if sep and host and rest != host and _ORIGIN_PATTERN.fullmatch(f"{scheme}://{host}"):
                raise self.fail(path, f"{value[:80]!r} is a URL, not an origin: browsers send scheme://host:port "
                                f"only; write {scheme}://{host}")
            raise self.fail(path, f"{value[:80]!r} is not an origin; write scheme://host or scheme://host:port, "
                            'like "http://localhost:5173", or "*" for any')
        scheme = match["scheme"].lower()
        written = f"{scheme}://{match['host'].lower()}"
        if match["port"] is not None and int(match["port"]) != _DEFAULT_PORTS.get(scheme):
            written += f":{int(match['port'])}"
        if written != value:
            raise self.fail(path, f"{value[:80]!r} is not how a browser writes this origin (lower case, no default "
                            f"port); write {written}")
        return value

    def speed(self, value: object, path: str) -> Speed:
        example = "{decode_gbps: 12.5, prefill_gbps: 150, layer_ms: 0.3}"
        hint = f"copy the line `tc.pyz worker --bench` prints on that machine, e.g. speed: {example}"
        section = self.mapping(value, path, SPEED_KEYS, f"a mapping of {', '.join(SPEED_KEYS)}; {hint}")
        missing = [key for key in SPEED_KEYS if section.get(key) is None]
        if missing:
            raise self.fail(path, f"lacks {', '.join(missing)}; {hint}")
        decode = self.positive_number(section["decode_gbps"], f"{path}.decode_gbps", "GB/s", MAX_GBPS)
        prefill = self.positive_number(section["prefill_gbps"], f"{path}.prefill_gbps", "GB/s", MAX_GBPS)
        layer_ms = section["layer_ms"]
        if not _is_number(layer_ms) or not 0 <= layer_ms <= MAX_LAYER_MS:
            raise self.fail(f"{path}.layer_ms", f"expected a number of milliseconds >= 0 (at most {MAX_LAYER_MS:g}), "
                            f"got {_describe(layer_ms)}")
        return Speed.from_topology(decode, prefill, float(layer_ms))

    def step_factor(self, value: object, path: str) -> float:
        if not _is_number(value):
            raise self.fail(path, f"expected a number >= 1 (a multiple of the slowest recent step), got "
                            f"{_describe(value)}")
        if value < 1:  # type: ignore[operator]
            raise self.fail(path, f"{value} is below 1, so a worker could be dropped for a step no slower than its "
                            f"recent ones; give 1 or more (default {DEFAULT_STEP_TIMEOUT_FACTOR:g})")
        if value > MAX_STEP_FACTOR:  # type: ignore[operator]
            raise self.fail(path, f"{_shown(value)} is more than this key takes; give at most {MAX_STEP_FACTOR:g}")
        return float(value)  # type: ignore[arg-type]

    def boolean(self, value: object, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"expected true or false, got {_describe(value)}")
        return value

    def auto_boolean(self, value: object, path: str) -> bool | None:
        """true, false, or auto (None: decided from the model when it loads)."""
        if value == "auto" or value is None:
            return None
        if not isinstance(value, bool):
            shown = repr(value) if isinstance(value, str) else _describe(value)
            raise self.fail(path, f"{shown} is not auto, true or false; write {path.rsplit('.', 1)[-1]}: auto to "
                            "decide from the model, or true or false")
        return value

    def join_token(self, value: object, path: str) -> str:
        # The text itself is never echoed back: an error message may end up in a log.
        if value is None:
            raise self.fail(path, "the key is written without a token; give the token, or leave join_token out for "
                            "a cluster that any worker may join")
        if not isinstance(value, str):
            raise self.fail(path, f"expected text, got {type(value).__name__}; quote the token")
        if value != value.strip() or len(value) < MIN_JOIN_TOKEN_CHARS:
            raise self.fail(path, f"the token must be at least {MIN_JOIN_TOKEN_CHARS} characters with no spaces "
                            "at either end; make one with: python -c 'import secrets; print(secrets.token_hex(32))'")
        return value

    def api_keys(self, value: object, path: str) -> tuple[str, ...]:
        """The keys a client may send as `Authorization: Bearer <key>`. As with the join token, a key itself is
        never echoed back: an error message may end up in a log."""
        if not isinstance(value, list) or not value:
            # named by its type alone: a key written as a bare number must not be echoed either
            got = ("nothing" if value is None else "an empty list" if value == [] else "one text"
                   if isinstance(value, str) else type(value).__name__)
            raise self.fail(path, f"expected a list of one or more keys, got {got}; write api_keys: [\"<key>\"], or "
                            "leave api_keys out for an API without keys")
        return tuple(self.api_key(item, f"{path}[{i}]") for i, item in enumerate(value))

    def api_key(self, value: object, path: str) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"expected text, got {type(value).__name__}; quote the key")
        # a header value: printable ASCII without spaces, as OpenAI's keys and secrets.token_urlsafe's are
        if len(value) < MIN_API_KEY_CHARS or not all("!" <= c <= "~" for c in value):
            raise self.fail(path, f"a key must be at least {MIN_API_KEY_CHARS} printable ASCII characters without "
                            "spaces; make one with: python -c 'import secrets; print(\"sk-\" + "
                            "secrets.token_urlsafe(32))'")
        return value

    def optional(self, section: Mapping[str, Any], key: str, path: str, check: Callable[[Any, str], Any]) -> Any:
        value = section.get(key)
        return None if value is None else check(value, _join(path, key))

    def nodes(self, value: object) -> tuple[NodeEntry, ...]:
        if not isinstance(value, list):
            raise self.fail("nodes", f"expected a list of nodes in pipeline order, got {_describe(value)}")
        if not value:
            raise self.fail("nodes", "the list is empty; list at least one node, e.g. - {id: box, device: auto}")
        entries: list[NodeEntry] = []
        first_index: dict[str, int] = {}
        for index, item in enumerate(value):
            entry = self.node(item, f"nodes[{index}]")
            if entry.id in first_index:
                raise self.fail(
                    f"nodes[{index}].id",
                    f"{entry.id!r} is already the id of nodes[{first_index[entry.id]}]; give each node its own id",
                )
            first_index[entry.id] = index
            entries.append(entry)
        if all(entry.spare for entry in entries):
            raise self.fail("nodes", "every node is a spare; at least one node must hold layers (drop spare: true "
                            "from one)")
        self.check_pin_order(entries)  # spares hold no pins, so they never take part
        return tuple(entries)

    def node(self, value: object, path: str) -> NodeEntry:
        node = self.mapping(value, path, NODE_KEYS, "a mapping with id and device")
        node_id = self.string(self.required(node, "id", path, "gpu-box"), f"{path}.id")
        if not NODE_ID_PATTERN.fullmatch(node_id):
            raise self.fail(
                f"{path}.id", f"{node_id!r} has characters other than letters, digits, '_', '.', '-'; rename it, "
                "e.g. gpu-box",
            )
        device = node.get("device", "auto")
        try:
            parse_device(device)
        except DeviceError as exc:
            raise self.fail(f"{path}.device", str(exc)) from exc
        spare = self.boolean(node.get("spare", False), f"{path}.spare")
        layers = self.optional(node, "layers", path, self.pin)
        if spare and layers is not None:
            raise self.fail(f"{path}.layers", "a spare holds no layers of its own (it takes over a lost node's); "
                            "remove layers or spare: true")
        return NodeEntry(
            id=node_id,
            device=device,
            dtype=self.optional(node, "dtype", path, lambda v, p: self.choice(v, p, DTYPES, "compute dtype")),
            max_memory_gb=self.optional(node, "max_memory_gb", path,
                                        lambda v, p: self.positive_number(v, p, "GiB", MAX_MEMORY_GB)),
            layers=layers,
            threads=self.optional(node, "threads", path, lambda v, p: self.integer(v, p, 1, maximum=MAX_THREADS)),
            spare=spare,
            speed=self.optional(node, "speed", path, self.speed),
        )

    def pin(self, value: object, path: str) -> tuple[int, int]:
        hint = 'write "a-b" (inclusive, counting from 0) like 14-23, or one layer like 7'
        if _is_int(value):
            if value < 0:  # type: ignore[operator]
                raise self.fail(path, f"{_shown(value)} is negative; layers count from 0; {hint}")
            if value > MAX_COUNT:  # type: ignore[operator]
                raise self.fail(path, f"{_shown(value)} is past any model's layers; {hint}")
            return value, value + 1  # type: ignore[operator,return-value]
        if not isinstance(value, str):
            raise self.fail(path, f"expected a layer range, got {_describe(value)}; {hint}")
        match = re.fullmatch(r" *([0-9]{1,6}) *(?:- *([0-9]{1,6}) *)?", value)
        if match is None:
            raise self.fail(path, f"{value!r} is not a layer range; {hint}")
        start = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else start
        if last < start:
            raise self.fail(path, f"{value!r} ends before it starts; {hint}")
        return start, last + 1

    def check_pin_order(self, entries: list[NodeEntry]) -> None:
        """Pins may not overlap and must follow node order, since layers flow through nodes in file order."""
        pinned: list[tuple[int, NodeEntry, tuple[int, int]]] = []
        for index, entry in enumerate(entries):
            if entry.layers is None:
                continue
            start, end = entry.layers
            for prev_index, prev, (prev_start, prev_end) in pinned:
                if start < prev_end and end > prev_start:
                    raise self.fail(
                        f"nodes[{index}].layers",
                        f"{_span(entry.layers)} overlaps nodes[{prev_index}] ({prev.id}) layers "
                        f"{_span((prev_start, prev_end))}; give each layer to one node",
                    )
            if pinned and start < pinned[-1][2][1]:
                prev_index, prev, prev_layers = pinned[-1]
                raise self.fail(
                    f"nodes[{index}].layers",
                    f"{_span(entry.layers)} comes before nodes[{prev_index}] ({prev.id}) layers "
                    f"{_span(prev_layers)}, but layers run through the nodes in list order; "
                    "reorder the nodes or their pins",
                )
            pinned.append((index, entry, entry.layers))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _span(layers: tuple[int, int]) -> str:
    """Half-open [a, b) shown the way the file writes it: inclusive "a-(b-1)"."""
    start, end = layers
    return f"{start}" if end == start + 1 else f"{start}-{end - 1}"
