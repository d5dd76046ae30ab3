"""The topology file: every rule as a table row, good files, YAML errors, and the example file."""
from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tc.topology import (
    HEAD_KEYS,
    NODE_KEYS,
    TOP_KEYS,
    AddressError,
    DeviceError,
    HostPort,
    Topology,
    TopologyError,
    load_topology,
    parse_device,
    parse_host_port,
    parse_topology,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DELETE = object()


def good() -> dict[str, Any]:
    """A valid three-node topology tree; each bad row changes one thing in it."""
    return {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "quant": "int8",
        "dtype": "bf16",
        "head": {"api": "0.0.0.0:8000", "listen": "0.0.0.0:7001"},
        "nodes": [
            {"id": "gpu-box", "device": "cuda:0"},
            {"id": "macbook", "device": "mps", "max_memory_gb": 12, "layers": "14-19"},
            {"id": "cpu-box", "device": "cpu"},
        ],
    }


def changed(*edits: tuple[str, Any]) -> dict[str, Any]:
    """good() with each dotted path ("nodes.1.device") set to a value, or removed with DELETE."""
    data = good()
    for path, value in edits:
        *parents, last = path.split(".")
        target: Any = data
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        key: Any = int(last) if isinstance(target, list) else last
        if value is DELETE:
            del target[key]
        else:
            target[key] = value
    return data


BAD = [
    # (row id, data, expected key path, phrase in the message)
    ("empty file", None, "", "the file is empty"),
    ("top is a list", [1, 2], "", "expected a mapping"),
    ("non-string key", {**good(), 1: 2}, "", "is not a name"),
    ("unknown top key", {**good(), "modle": "x"}, "modle", "did you mean 'model'?"),
    ("unknown far key", {**good(), "zzz": 1}, "zzz", "allowed keys here: version, model"),
    ("unknown head key", changed(("head.port", 8000)), "head.port", "allowed keys here: api, listen"),
    ("unknown node key", changed(("nodes.0.max_mem_gb", 4)), "nodes[0].max_mem_gb", "did you mean 'max_memory_gb'?"),
    ("version 2", changed(("version", 2)), "version", "write version: 1"),
    ("version text", changed(("version", "1")), "version", "str '1' is not a topology format"),
    ("version bool", changed(("version", True)), "version", "a boolean"),
    ("model missing", changed(("model", DELETE)), "model", "missing; add it"),
    ("model null", changed(("model", None)), "model", "missing; add it"),
    ("model number", changed(("model", 123)), "model", "expected text"),
    ("model not a repo id", changed(("model", "qwen-small")), "model", "neither a HuggingFace repo id"),
    ("model two slashes", changed(("model", "a/b/c")), "model", "neither a HuggingFace repo id"),
    ("model local missing", changed(("model", "./models/x")), "model",
     "./models/x: no such directory ("),
    ("model local missing says where it looked", changed(("model", "./models/x")), "model",
     "models/x: relative paths are relative to the topology file); give an existing local model directory or a "
     "HuggingFace repo id like Qwen/Qwen2.5-0.5B-Instruct"),
    ("model a file", changed(("model", "./no-config/model.safetensors")), "model",
     "no-config/model.safetensors is a file ("),
    ("model absolute missing", changed(("model", "/nonexistent/tc-model")), "model", "no such directory"),
    ("model dir lacks config", changed(("model", "./no-config")), "model", "has no config.json"),
    ("revision number", changed(("revision", 1234)), "revision", 'quote it: "1234"'),
    ("revision and a newline", changed(("revision", "main\n")), "revision", "is not a git revision"),
    ("revision with a space", changed(("revision", "my branch")), "revision", "is not a git revision"),
    ("revision climbing", changed(("revision", "a..b")), "revision", "is not a git revision"),
    ("quant missing", changed(("quant", DELETE)), "quant", "missing; add it, e.g. quant: int8"),
    ("quant unknown", changed(("quant", "int3")), "quant", "'int3' is not a weight mode; use fp16 | int8 | int4"),
    ("quant bool", changed(("quant", False)), "quant", "a boolean"),
    ("group_size zero", changed(("group_size", 0)), "group_size", "too small"),
    ("group_size negative", changed(("group_size", -128)), "group_size", "too small"),
    ("group_size odd", changed(("group_size", 63)), "group_size", "is odd"),
    ("group_size float", changed(("group_size", 128.0)), "group_size", "expected a whole number"),
    ("group_size bool", changed(("group_size", True)), "group_size", "a boolean"),
    ("dtype missing", changed(("dtype", DELETE)), "dtype", "missing"),
    ("dtype unknown", changed(("dtype", "float16")), "dtype",
     "'float16' is not a compute dtype; use fp16 | bf16 | fp32"),
    ("hf_cache_dir number", changed(("hf_cache_dir", 5)), "hf_cache_dir", "expected text"),
    ("chat_template number", changed(("chat_template", 5)), "chat_template", "expected text"),
    ("chat_template missing file", changed(("chat_template", "./absent.jinja")), "chat_template",
     "./absent.jinja: no such file; give the path of a Jinja chat template file"),
    ("chat_template a directory", changed(("chat_template", "./no-config")), "chat_template", "no such file"),
    ("reasoning_content a word", changed(("reasoning_content", "split")), "reasoning_content",
     "'split' is not auto, true or false; write reasoning_content: auto"),
    ("reasoning_content a number", changed(("reasoning_content", 1)), "reasoning_content", "is not auto, true"),
    ("head missing", changed(("head", DELETE)), "head", "missing"),
    ("head a list", changed(("head", ["0.0.0.0:8000"])), "head", "expected a mapping with api and listen"),
    ("api missing", changed(("head.api", DELETE)), "head.api", "missing; add it, e.g. api: 0.0.0.0:8000"),
    ("api port only", changed(("head.api", "8000")), "head.api", "has no port"),
    ("api int", changed(("head.api", 8000)), "head.api", 'expected "host:port"'),
    ("api port zero", changed(("head.api", "0.0.0.0:0")), "head.api", "port 0 is out of range; use 1-65535"),
    ("api port too big", changed(("head.api", "0.0.0.0:65536")), "head.api", "out of range"),
    ("api port text", changed(("head.api", "localhost:http")), "head.api", "is not a number"),
    ("api no host", changed(("head.api", ":8000")), "head.api", "no valid host"),
    ("api bad host", changed(("head.api", "my host:8000")), "head.api", "no valid host"),
    ("api bare ipv6", changed(("head.api", "::1:8000")), "head.api", "in brackets"),
    ("api a URL", changed(("head.api", "http://0.0.0.0:8000")), "head.api", "is a URL; write host:port alone"),
    ("listen missing", changed(("head.listen", DELETE)), "head.listen", "missing"),
    ("listen same port", changed(("head.listen", "127.0.0.1:8000")), "head.listen", "different ports"),
    # a name may be the other's address: the head bound its API there, then found its own port in use
    ("listen same port by name", changed(("head.api", "localhost:8000"), ("head.listen", "127.0.0.1:8000")),
     "head.listen", "different ports"),
    ("listen same port, one address twice", changed(("head.api", "[::1]:8000"), ("head.listen", "[0:0::1]:8000")),
     "head.listen", "different ports"),
    ("head threads zero", changed(("head.threads", 0)), "head.threads", "too small"),
    ("head threads yes", changed(("head.threads", True)), "head.threads", "YAML reads yes/no/on/off as booleans"),
    ("max_queue zero", changed(("head.max_queue", 0)), "head.max_queue", "too small"),
    ("max_queue text", changed(("head.max_queue", "16")), "head.max_queue", "expected a whole number"),
    ("heartbeat zero", changed(("head.heartbeat_s", 0)), "head.heartbeat_s", "not positive"),
    ("heartbeat negative", changed(("head.heartbeat_s", -1.5)), "head.heartbeat_s", "not positive"),
    ("heartbeat inf", changed(("head.heartbeat_s", float("inf"))), "head.heartbeat_s", "expected a positive number"),
    ("heartbeat bool", changed(("head.heartbeat_s", True)), "head.heartbeat_s", "a boolean"),
    ("step timeout zero", changed(("head.step_timeout_s", 0)), "head.step_timeout_s", "not positive"),
    ("step timeout text", changed(("head.step_timeout_s", "30s")), "head.step_timeout_s",
     "expected a positive number of seconds"),
    ("step factor below 1", changed(("head.step_timeout_factor", 0.5)), "head.step_timeout_factor",
     "below 1, so a worker could be dropped"),
    ("step factor text", changed(("head.step_timeout_factor", "10x")), "head.step_timeout_factor",
     "expected a number >= 1"),
    ("nodes missing", changed(("nodes", DELETE)), "nodes", "missing"),
    ("nodes empty", changed(("nodes", [])), "nodes", "the list is empty"),
    ("nodes a mapping", changed(("nodes", {"id": "a"})), "nodes", "expected a list of nodes"),
    ("node a string", changed(("nodes.0", "gpu-box")), "nodes[0]", "expected a mapping with id and device"),
    ("node id missing", changed(("nodes.1.id", DELETE)), "nodes[1].id", "missing"),
    ("node id number", changed(("nodes.0.id", 7)), "nodes[0].id", 'quote it: "7"'),
    ("node id space", changed(("nodes.0.id", "gpu box")), "nodes[0].id", "characters other than"),
    ("node id duplicate", changed(("nodes.2.id", "gpu-box")), "nodes[2].id", "already the id of nodes[0]"),
    ("device gpu", changed(("nodes.1.device", "gpu")), "nodes[1].device",
     "'gpu' is not a device; use auto, cpu, cuda, cuda:N or mps"),
    ("device cpu:0", changed(("nodes.2.device", "cpu:0")), "nodes[2].device", "is not a device"),
    ("device mps:1", changed(("nodes.1.device", "mps:1")), "nodes[1].device", "is not a device"),
    ("device cuda:", changed(("nodes.0.device", "cuda:")), "nodes[0].device", "is not a device"),
    ("device cuda:-1", changed(("nodes.0.device", "cuda:-1")), "nodes[0].device", "is not a device"),
    ("device cuda:01", changed(("nodes.0.device", "cuda:01")), "nodes[0].device", "is not a device"),
    ("device upper", changed(("nodes.0.device", "CUDA")), "nodes[0].device", "is not a device"),
    ("device int", changed(("nodes.0.device", 0)), "nodes[0].device", "is not a device"),
    ("node dtype", changed(("nodes.0.dtype", "half")), "nodes[0].dtype", "use fp16 | bf16 | fp32"),
    ("memory zero", changed(("nodes.1.max_memory_gb", 0)), "nodes[1].max_memory_gb", "not positive"),
    ("memory negative", changed(("nodes.1.max_memory_gb", -2)), "nodes[1].max_memory_gb", "not positive"),
    ("memory with unit", changed(("nodes.1.max_memory_gb", "12GB")), "nodes[1].max_memory_gb",
     "expected a positive number of GiB"),
    ("memory bool", changed(("nodes.1.max_memory_gb", True)), "nodes[1].max_memory_gb", "a boolean"),
    ("pin open end", changed(("nodes.1.layers", "14-")), "nodes[1].layers", "is not a layer range"),
    ("pin words", changed(("nodes.1.layers", "a-b")), "nodes[1].layers", "is not a layer range"),
    ("pin reversed", changed(("nodes.1.layers", "19-14")), "nodes[1].layers", "ends before it starts"),
    ("pin negative", changed(("nodes.1.layers", -1)), "nodes[1].layers", "negative"),
    ("pin bool", changed(("nodes.1.layers", True)), "nodes[1].layers", "a boolean"),
    ("pin float", changed(("nodes.1.layers", 1.5)), "nodes[1].layers", "expected a layer range"),
    ("pin list", changed(("nodes.1.layers", [14, 19])), "nodes[1].layers", "expected a layer range"),
    ("pin empty text", changed(("nodes.1.layers", "")), "nodes[1].layers", "is not a layer range"),
    ("node threads zero", changed(("nodes.2.threads", 0)), "nodes[2].threads", "too small"),
    ("node threads bool", changed(("nodes.2.threads", False)), "nodes[2].threads", "a boolean"),
    ("pins overlap", changed(("nodes.0.layers", "0-14")), "nodes[1].layers",
     "14-19 overlaps nodes[0] (gpu-box) layers 0-14"),
    ("pins out of order", changed(("nodes.2.layers", "0-3")), "nodes[2].layers",
     "0-3 comes before nodes[1] (macbook) layers 14-19"),
    ("pin overlaps an earlier one", changed(("nodes.0.layers", "0-3"), ("nodes.2.layers", "2")),
     "nodes[2].layers", "2 overlaps nodes[0] (gpu-box) layers 0-3"),
    ("pin overlaps a non-adjacent one", changed(("nodes.0.layers", "10-13"), ("nodes.1.layers", "20-23"),
                                                ("nodes.2.layers", "5-11")),
     "nodes[2].layers", "overlaps nodes[0] (gpu-box) layers 10-13"),
    ("same single pin twice", changed(("nodes.0.layers", 7), ("nodes.1.layers", "7")), "nodes[1].layers",
     "overlaps"),
    ("unknown key of two lines", changed(("head.na\nme", 1)), "head.'na\\nme'", "unknown key"),
    # text that a pattern once matched short of its end, or in other scripts' digits and letters
    ("node id and a newline", changed(("nodes.0.id", "gpu-box\n")), "nodes[0].id", "characters other than"),
    ("device and a newline", changed(("nodes.0.device", "cpu\n")), "nodes[0].device", "is not a device"),
    ("device in Arabic digits", changed(("nodes.0.device", "cuda:\u0663")), "nodes[0].device", "is not a device"),
    ("repo id and a newline", changed(("model", "Qwen/x\n")), "model", "neither a HuggingFace repo id"),
    ("repo id climbing out", changed(("model", "Qwen/..")), "model", "neither a HuggingFace repo id"),
    ("repo id beyond ASCII", changed(("model", "Qw\u00e9n/m")), "model", "neither a HuggingFace repo id"),
    ("api port in wide digits", changed(("head.api", "0.0.0.0:\uff18\uff10\uff10\uff10")), "head.api",
     "is not a number"),
    ("api port a superscript", changed(("head.api", "127.0.0.1:\u00b2")), "head.api", "is not a number"),
    ("api port of 5000 digits", changed(("head.api", "0.0.0.0:" + "9" * 5000)), "head.api", "is not a number"),
    ("api host past IPv4", changed(("head.api", "999.999.999.999:8000")), "head.api", "no valid host"),
    ("api host of dots", changed(("head.api", "...:8000")), "head.api", "no valid host"),
    ("api host a dash", changed(("head.api", "-:8000")), "head.api", "no valid host"),
    ("api host and a newline", changed(("head.api", "localhost\n:8000")), "head.api", "no valid host"),
    ("api host not IPv6", changed(("head.api", "[:::::]:8000")), "head.api", "no valid host"),
    ("pin of 5000 digits", changed(("nodes.1.layers", "0-" + "9" * 5000)), "nodes[1].layers", "not a layer range"),
    ("pin in Arabic digits", changed(("nodes.1.layers", "\u0661\u0664-\u0661\u0669")), "nodes[1].layers",
     "not a layer range"),
    ("pin past any model", changed(("nodes.1.layers", 10**30)), "nodes[1].layers", "past any model's layers"),
    # numbers past what a key takes: they overflowed, or broke what used them, once the head ran
    ("memory past a float", changed(("nodes.1.max_memory_gb", 10**400)), "nodes[1].max_memory_gb",
     "expected a positive number"),
    ("memory near the float limit", changed(("nodes.1.max_memory_gb", 1e308)), "nodes[1].max_memory_gb",
     "at most"),
    ("head threads past a C long", changed(("head.threads", 10**30)), "head.threads", "at most 1024"),
    ("node threads huge", changed(("nodes.2.threads", 100_000)), "nodes[2].threads", "at most 1024"),
    ("max_queue a thread each", changed(("head.max_queue", 10**30)), "head.max_queue", "at most 4096"),
    ("max_batch huge", changed(("head.max_batch", 100_000)), "head.max_batch", "at most 1024"),
    ("group_size huge", changed(("group_size", 10**30)), "group_size", "at most"),
    ("heartbeat every nanosecond", changed(("head.heartbeat_s", 1e-9)), "head.heartbeat_s", "at least 0.05"),
    ("heartbeat never", changed(("head.heartbeat_s", 1e308)), "head.heartbeat_s", "at most 3600"),
    ("body limit of no bytes", changed(("head.max_body_mb", 1e-300)), "head.max_body_mb", "at least"),
    ("frame limit past a float", changed(("head.max_frame_mb", 1e308)), "head.max_frame_mb", "at most"),
    ("step factor huge", changed(("head.step_timeout_factor", 10**400)), "head.step_timeout_factor",
     "expected a number >= 1"),
    ("grace of centuries", changed(("head.resume_grace_s", 1e12)), "head.resume_grace_s", "at most"),
    # browser origins, compared as text with the Origin header: a form no browser sends would never match
    ("origins one text", changed(("head.cors_origins", "*")), "head.cors_origins", "expected a list of origins"),
    ("origins a mapping", changed(("head.cors_origins", {"http://a": True})), "head.cors_origins",
     "expected a list of origins"),
    ("origin a number", changed(("head.cors_origins", [8000])), "head.cors_origins[0]", "expected an origin"),
    ("origin without scheme", changed(("head.cors_origins", ["localhost:5173"])), "head.cors_origins[0]",
     "is not an origin; write scheme://host"),
    ("origin with a slash", changed(("head.cors_origins", ["http://localhost:5173/"])), "head.cors_origins[0]",
     "is a URL, not an origin: browsers send scheme://host:port only; write http://localhost:5173"),
    ("origin with a path", changed(("head.cors_origins", ["https://chat.example.com/app"])),
     "head.cors_origins[0]", "write https://chat.example.com"),
    ("origin in capitals", changed(("head.cors_origins", ["HTTP://LocalHost:5173"])), "head.cors_origins[0]",
     "write http://localhost:5173"),
    ("origin with its default port", changed(("head.cors_origins", ["https://chat.example.com:443"])),
     "head.cors_origins[0]", "(lower case, no default port); write https://chat.example.com"),
    ("origin port past 65535", changed(("head.cors_origins", ["http://a:70000"])), "head.cors_origins[0]",
     "is not an origin"),
    ("origin null", changed(("head.cors_origins", ["http://a", "null"])), "head.cors_origins[1]",
     "serve the page over HTTP"),
    ("origins star among others", changed(("head.cors_origins", ["*", "http://a"])), "head.cors_origins",
     '"*" allows every origin'),
    ("origin twice", changed(("head.cors_origins", ["http://a", "http://a"])), "head.cors_origins",
     "listed twice"),
    # API keys, which an error never echoes
    ("api keys one text", changed(("head.api_keys", "sk-0123456789abcdef01")), "head.api_keys",
     "expected a list of one or more keys, got one text; write api_keys: [\"<key>\"]"),
    ("api keys empty", changed(("head.api_keys", [])), "head.api_keys", "got an empty list"),
    # "api_keys:" with its keys commented out: null, which must not leave the API open
    ("api keys null", changed(("head.api_keys", None)), "head.api_keys", "got nothing"),
    ("api keys a mapping", changed(("head.api_keys", {"k": 1})), "head.api_keys", "expected a list"),
    ("api key a number", changed(("head.api_keys", [1234567890123456789])), "head.api_keys[0]", "quote the key"),
    ("api key short", changed(("head.api_keys", ["sk-0123456789abcdef", "sk-short"])), "head.api_keys[1]",
     "at least 16 printable ASCII characters without spaces; make one with"),
    ("api key with a space", changed(("head.api_keys", ["sk-0123456789 abcdef"])), "head.api_keys[0]",
     "without spaces"),
    ("api key not ASCII", changed(("head.api_keys", ["sk-caf\u00e9-0123456789abc"])), "head.api_keys[0]",
     "printable ASCII"),
    # the join token, which an error never echoes either
    # "join_token:" with its token commented out: null, which must not let any worker join
    ("join token null", changed(("head.join_token", None)), "head.join_token",
     "written without a token; give the token, or leave join_token out"),
    ("join token a number", changed(("head.join_token", 12345678901234567890)), "head.join_token",
     "expected text, got int; quote the token"),
    ("join token short", changed(("head.join_token", "0123456789abcde")), "head.join_token",
     "at least 16 characters with no spaces at either end; make one with"),
    ("join token with a space", changed(("head.join_token", " 0123456789abcdef")), "head.join_token",
     "no spaces at either end"),
    # paths the file system refuses
    ("model path of a NUL", changed(("model", "./a\0b")), "model", "not a usable path"),
    ("model path too long", changed(("model", "a" * 5000)), "model", "not a usable path"),
    ("model path of no such user", changed(("model", "~no-such-user-here/m")), "model", "not a usable path"),
    ("cache path of a NUL", changed(("hf_cache_dir", "a\0b")), "hf_cache_dir", "not a usable path"),
    ("template path too long", changed(("chat_template", "x" * 5000)), "chat_template", "not a usable path"),
]


@pytest.fixture
def base_dir(tmp_path: Path) -> Path:
    (tmp_path / "no-config").mkdir()
    (tmp_path / "no-config" / "model.safetensors").write_bytes(b"")
    return tmp_path


@pytest.mark.parametrize(("data", "key_path", "phrase"), [row[1:] for row in BAD], ids=[row[0] for row in BAD])
def test_bad_topology_names_key_and_fix(data: object, key_path: str, phrase: str, base_dir: Path) -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(copy.deepcopy(data), base_dir, source="topology.yaml")
    err = info.value
    assert err.key_path == key_path
    assert phrase in err.message
    text = str(err)
    assert "\n" not in text
    assert text.startswith(f"topology.yaml: {key_path}: " if key_path else "topology.yaml: ")


def test_a_model_directory_of_the_current_one_and_not_of_the_file_s_is_named_with_the_fix(
        base_dir: Path, tmp_path_factory, monkeypatch) -> None:
    """model: models/x, written from where the operator stands rather than from the topology file: read as it is
    written it is a repo id, which a head would look for on the Hub (a minute of retries offline). Said at once,
    with the absolute path to write; a directory that is the file's own is taken as before."""
    elsewhere = tmp_path_factory.mktemp("cwd")
    make_model_dir(elsewhere / "models" / "x")
    monkeypatch.chdir(elsewhere)
    with pytest.raises(TopologyError) as info:
        parse_topology(changed(("model", "models/x")), base_dir, source="topology.yaml")
    assert info.value.key_path == "model"
    assert f"a directory of the current one ({elsewhere / 'models' / 'x'}), not of this file's ({base_dir})" \
        in info.value.message and info.value.message.endswith(f"write the absolute path {elsewhere / 'models/x'}")
    monkeypatch.chdir(base_dir)  # the file's own directory: the repo id it reads as is what it always was
    assert parse_topology(changed(("model", "models/x")), base_dir, source="topology.yaml").model == "models/x"
    (elsewhere / "out" / "run").mkdir(parents=True)  # a directory of that name, but no model: a repo id still
    monkeypatch.chdir(elsewhere)
    assert parse_topology(changed(("model", "out/run")), base_dir, source="topology.yaml").model == "out/run"


def test_error_text_is_file_key_and_fix(base_dir: Path) -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(changed(("nodes.1.device", "gpu")), base_dir, source="topology.yaml")
    assert str(info.value) == (
        "topology.yaml: nodes[1].device: 'gpu' is not a device; use auto, cpu, cuda, cuda:N or mps"
    )


def test_good_tree_values_and_defaults(base_dir: Path) -> None:
    topo = parse_topology(good(), base_dir)
    assert topo.version == 1
    assert topo.model == "Qwen/Qwen2.5-0.5B-Instruct" and not topo.model_is_local
    assert (topo.revision, topo.quant, topo.group_size, topo.dtype, topo.hf_cache_dir) == (
        None, "int8", 128, "bf16", None
    )
    assert topo.head.api == HostPort("0.0.0.0", 8000)
    assert topo.head.listen == HostPort("0.0.0.0", 7001)
    assert (topo.head.threads, topo.head.max_queue, topo.head.heartbeat_s) == (None, 16, 5.0)
    assert (topo.head.step_timeout_s, topo.head.step_timeout_factor) == (30.0, 10.0)
    assert topo.node_ids == ("gpu-box", "macbook", "cpu-box")
    mac = topo.node("macbook")
    assert (mac.device, mac.dtype, mac.max_memory_gb, mac.layers, mac.threads) == ("mps", None, 12.0, (14, 20), None)


def test_chat_template_is_a_file_relative_to_the_topology(base_dir: Path) -> None:
    (base_dir / "templates").mkdir()
    (base_dir / "templates" / "chatml.jinja").write_text("{{ messages[0].content }}", encoding="utf-8")
    topo = parse_topology(changed(("chat_template", "templates/chatml.jinja")), base_dir)
    assert topo.chat_template == base_dir / "templates" / "chatml.jinja"
    assert parse_topology(topo.to_dict(), Path("/")) == topo
    assert parse_topology(good(), base_dir).chat_template is None
    assert "chat_template" not in parse_topology(good(), base_dir).to_dict()


@pytest.mark.parametrize(("value", "parsed"), [("auto", None), (True, True), (False, False)])
def test_reasoning_content_is_auto_unless_forced(base_dir: Path, value: object, parsed: bool | None) -> None:
    topo = parse_topology(changed(("reasoning_content", value)), base_dir)
    assert topo.reasoning_content is parsed
    assert parse_topology(topo.to_dict(), base_dir) == topo
    assert parse_topology(good(), base_dir).reasoning_content is None
    assert "reasoning_content" not in parse_topology(good(), base_dir).to_dict()


def test_device_defaults_to_auto(base_dir: Path) -> None:
    topo = parse_topology(changed(("nodes.0.device", DELETE)), base_dir)
    assert topo.nodes[0].device == "auto"


def test_every_optional_key_set(base_dir: Path) -> None:
    data = changed(
        ("version", 1), ("revision", "v1.0"), ("group_size", 64), ("hf_cache_dir", "cache"),
        ("head.threads", 3), ("head.max_queue", 4), ("head.heartbeat_s", 0.5), ("head.step_timeout_s", 2),
        ("head.step_timeout_factor", 4), ("nodes.0.dtype", "fp16"), ("nodes.0.max_memory_gb", 7.5),
        ("nodes.0.threads", 6), ("nodes.0.layers", 3),
    )
    topo = parse_topology(data, base_dir)
    assert topo.revision == "v1.0" and topo.group_size == 64
    assert topo.hf_cache_dir == (base_dir / "cache").resolve()
    assert (topo.head.threads, topo.head.max_queue, topo.head.heartbeat_s) == (3, 4, 0.5)
    assert (topo.head.step_timeout_s, topo.head.step_timeout_factor) == (2.0, 4.0)
    assert topo.nodes[0] == type(topo.nodes[0])("gpu-box", "cuda:0", "fp16", 7.5, (3, 4), 6)


@pytest.mark.parametrize("origins", [["http://localhost:5173", "https://chat.example.com", "http://[::1]:8080",
                                      "chrome-extension://abcdefghijklmnop"], ["*"]])
def test_cors_origins_are_kept_as_written_and_round_trip(origins: list[str], base_dir: Path) -> None:
    topo = parse_topology(changed(("head.cors_origins", origins)), base_dir)
    assert topo.head.cors_origins == tuple(origins)
    assert parse_topology(topo.to_dict(), Path("/")) == topo


def test_api_keys_round_trip_and_stay_out_of_reprs_and_errors(base_dir: Path) -> None:
    keys = ["sk-0123456789abcdef01", "another-key_!~#0123456789"]
    topo = parse_topology(changed(("head.api_keys", keys)), base_dir)
    assert topo.head.api_keys == tuple(keys)
    assert parse_topology(topo.to_dict(), Path("/")) == topo
    assert not any(key in repr(topo) for key in keys)
    assert parse_topology(changed(), base_dir).head.api_keys == ()  # absent: an open API
    assert "api_keys" not in parse_topology(changed(), base_dir).to_dict()["head"]
    for bad in (["sk-0123456789 abcdef"], ["sk-short"], "sk-0123456789abcdef01", 12345678901234567890):
        with pytest.raises(TopologyError) as info:
            parse_topology(changed(("head.api_keys", bad)), base_dir)
        assert str(bad[0] if isinstance(bad, list) else bad) not in str(info.value)


def test_join_token_round_trips_and_stays_out_of_reprs_and_errors(base_dir: Path) -> None:
    token = "3f9c2d0e8b7a41f6a5c4e3d2b1a09f8e"
    topo = parse_topology(changed(("head.join_token", token)), base_dir)
    assert topo.head.join_token == token
    assert parse_topology(topo.to_dict(), Path("/")) == topo
    assert token not in repr(topo)
    assert parse_topology(changed(), base_dir).head.join_token is None  # absent: any worker may join
    assert "join_token" not in parse_topology(changed(), base_dir).to_dict()["head"]
    for bad in ("0123456789 abcdef ", "short-token", 12345678901234567890):
        with pytest.raises(TopologyError) as info:
            parse_topology(changed(("head.join_token", bad)), base_dir)
        assert str(bad).strip() not in str(info.value)


@pytest.mark.parametrize("edits", [(), (("head.cors_origins", None),), (("head.cors_origins", []),)],
                         ids=["absent", "null", "empty"])
def test_no_cors_origins_is_the_default(edits: tuple, base_dir: Path) -> None:
    topo = parse_topology(changed(*edits), base_dir)
    assert topo.head.cors_origins == ()
    assert "cors_origins" not in topo.to_dict()["head"]


@pytest.mark.parametrize(
    ("pin", "expected"),
    [(0, (0, 1)), (7, (7, 8)), ("7", (7, 8)), ("14-23", (14, 24)), (" 3 - 5 ", (3, 6)), ("0-0", (0, 1))],
)
def test_pin_forms_are_inclusive_and_stored_half_open(pin: object, expected: tuple[int, int], base_dir: Path) -> None:
    data = changed(("nodes.1.layers", DELETE), ("nodes.0.layers", pin))
    assert parse_topology(data, base_dir).nodes[0].layers == expected


def test_adjacent_pins_in_order_are_fine(base_dir: Path) -> None:
    data = changed(("nodes.0.layers", "0-13"), ("nodes.1.layers", "14-19"), ("nodes.2.layers", "20-23"))
    assert [n.layers for n in parse_topology(data, base_dir).nodes] == [(0, 14), (14, 20), (20, 24)]


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", "mps"])
def test_valid_devices(device: str, base_dir: Path) -> None:
    assert parse_topology(changed(("nodes.0.device", device)), base_dir).nodes[0].device == device


@pytest.mark.parametrize(
    ("text", "expected"),
    [("auto", ("auto", None)), ("cpu", ("cpu", None)), ("mps", ("mps", None)), ("cuda", ("cuda", None)),
     ("cuda:0", ("cuda", 0)), ("cuda:3", ("cuda", 3))],
)
def test_parse_device(text: str, expected: tuple[str, int | None]) -> None:
    assert parse_device(text) == expected


@pytest.mark.parametrize("text", ["gpu", "cpu:0", "mps:0", "cuda:", "cuda:x", "cuda:0:1", " cuda", "", "xla"])
def test_parse_device_refuses(text: str) -> None:
    with pytest.raises(DeviceError, match="use auto, cpu, cuda, cuda:N or mps"):
        parse_device(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0.0.0.0:8000", HostPort("0.0.0.0", 8000)), ("localhost:1", HostPort("localhost", 1)),
     ("head.lan:65535", HostPort("head.lan", 65535)), ("[::]:7001", HostPort("::", 7001)),
     ("[::1]:80", HostPort("::1", 80))],
)
def test_parse_host_port(text: str, expected: HostPort) -> None:
    assert parse_host_port(text) == expected
    assert str(expected) == text  # str() writes it back the way it reads


@pytest.mark.parametrize("text", ["8000", "host:", "host:0", "host:99999", "[::1]8000", "a b:1", "[zz]:1", "h:-1"])
def test_parse_host_port_refuses(text: str) -> None:
    with pytest.raises(AddressError):
        parse_host_port(text)


def test_ipv6_head_addresses(base_dir: Path) -> None:
    topo = parse_topology(changed(("head.api", "[::]:8000"), ("head.listen", "[::]:7001")), base_dir)
    assert topo.head.api == HostPort("::", 8000)


def make_model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}", encoding="utf-8")
    return path


@pytest.mark.parametrize("spelling", ["./models/qwen", "models/qwen", "ABS"])
def test_local_model_paths_resolve_against_the_file(spelling: str, tmp_path: Path) -> None:
    model_dir = make_model_dir(tmp_path / "models" / "qwen")
    text = str(model_dir) if spelling == "ABS" else spelling
    topo = parse_topology(changed(("model", text)), tmp_path)
    assert topo.model_is_local
    assert topo.model == str(model_dir.resolve())


def test_local_model_under_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    model_dir = make_model_dir(tmp_path / "qwen")
    topo = parse_topology(changed(("model", "~/qwen")), tmp_path / "elsewhere")
    assert topo.model_is_local and Path(topo.model) == model_dir


def test_repo_id_that_is_not_a_directory_stays_remote(tmp_path: Path) -> None:
    topo = parse_topology(changed(("model", "org/model.v2-1_x")), tmp_path)
    assert topo.model == "org/model.v2-1_x" and not topo.model_is_local


def test_round_trip_through_yaml(tmp_path: Path) -> None:
    make_model_dir(tmp_path / "m")
    data = changed(
        ("model", "./m"), ("hf_cache_dir", "hf"), ("head.threads", 2),
        ("head.api", "[::1]:8000"), ("head.step_timeout_s", 5), ("head.step_timeout_factor", 3),
        ("nodes.0.dtype", "fp32"), ("nodes.0.threads", 4), ("nodes.2.layers", 20),
        ("nodes.1.speed", {"decode_gbps": 61.37, "prefill_gbps": 4812.5, "layer_ms": 0.0913}),
        ("head.speed", {"decode_gbps": 12, "prefill_gbps": 150.25, "layer_ms": 0}),
    )
    topo = parse_topology(data, tmp_path)
    assert topo.nodes[1].speed.decode_bytes_per_s == pytest.approx(61.37e9) and topo.head.speed is not None
    assert parse_topology(topo.to_dict(), Path("/")) == topo
    path = tmp_path / "sub" / "again.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(topo.to_dict(), sort_keys=False), encoding="utf-8")
    assert load_topology(path) == topo
    of_repo = parse_topology(changed(("revision", "abc")), tmp_path)  # a repo id's revision goes round too
    assert of_repo.revision == "abc" and parse_topology(of_repo.to_dict(), Path("/")) == of_repo


def test_a_revision_of_a_local_model_is_refused_not_ignored(tmp_path: Path) -> None:
    """A local directory has no revisions: a revision beside it would be read by nothing, and the head would serve
    what the directory holds while the file says another version."""
    make_model_dir(tmp_path / "m")
    with pytest.raises(TopologyError) as info:
        parse_topology(changed(("model", "./m"), ("revision", "v2.0")), tmp_path)
    assert info.value.key_path == "revision"
    assert info.value.message == (f"'v2.0' names a version of a HuggingFace repo, and model is a local directory "
                                  f"({tmp_path / 'm'}), which has none: remove revision, or give model as a repo id")


SPEED = {"decode_gbps": 12.5, "prefill_gbps": 150, "layer_ms": 0.3}


@pytest.mark.parametrize("speed, where, words", [
    ({**SPEED, "layer_ms": DELETE}, "nodes[0].speed", "lacks layer_ms"),
    ({**SPEED, "decode_gbps": 0}, "nodes[0].speed.decode_gbps", "not positive"),
    ({**SPEED, "layer_ms": -1}, "nodes[0].speed.layer_ms", ">= 0"),
    ({**SPEED, "decode_gbs": 1}, "nodes[0].speed.decode_gbs", "did you mean 'decode_gbps'"),
    (12.5, "nodes[0].speed", "worker --bench"),
])
def test_a_bad_speed_names_its_key(speed: Any, where: str, words: str) -> None:
    if isinstance(speed, dict):
        speed = {k: v for k, v in speed.items() if v is not DELETE}
    with pytest.raises(TopologyError) as info:
        parse_topology(changed(("nodes.0.speed", speed)), Path("/"))
    assert info.value.key_path == where and words in str(info.value)


def test_speeds_reach_the_planner(base_dir: Path) -> None:
    from tc.planner import node_specs

    topo = parse_topology(changed(("nodes.0.speed", SPEED)), base_dir)
    specs = node_specs(topo)
    assert specs[0].speed is not None and specs[0].speed.layer_overhead_s == pytest.approx(0.3e-3)
    assert specs[2].speed is None


def test_with_ports(base_dir: Path) -> None:
    topo = parse_topology(good(), base_dir)
    moved = topo.with_ports(api_port=0, listen_port=9001)
    assert moved.head.api == HostPort("0.0.0.0", 0)
    assert moved.head.listen == HostPort("0.0.0.0", 9001)
    assert moved.nodes == topo.nodes and topo.head.api.port == 8000
    assert topo.with_ports(listen_port=7100).head.api.port == 8000
    with pytest.raises(AddressError):
        topo.with_ports(api_port=70000)
    with pytest.raises(TopologyError, match="also head.api's port") as info:
        topo.with_ports(listen_port=8000)  # what --listen-port equal to the API's port asked for
    assert info.value.key_path == "head.listen"
    # two addresses written out, each of its own interface, may share a port
    apart = good()
    apart["head"] = {"api": "127.0.0.1:8000", "listen": "127.0.0.2:8000"}
    assert parse_topology(apart, base_dir).head.listen == HostPort("127.0.0.2", 8000)
    apart["head"] = {"api": "localhost:8000", "listen": "127.0.0.2:8000"}  # a name, of another address
    assert parse_topology(apart, base_dir).head.api == HostPort("localhost", 8000)


@pytest.mark.parametrize("port", ["70000", "-1", "http", "\uff18\uff10\uff10\uff10"])
def test_the_command_line_takes_only_ports(port: str, capsys) -> None:
    from tc.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["head", "topology.yaml", "--api-port", port])
    assert info.value.code == 2 and "is not a port; use 0-65535" in capsys.readouterr().err
    assert build_parser().parse_args(["head", "topology.yaml", "--listen-port", "0"]).listen_port == 0


@pytest.mark.parametrize("argv, refused", [
    (["worker", "--join", "h:7001", "--threads", "-1"], "argument --threads: '-1' is not a whole number from 1"),
    (["worker", "--join", "h:7001", "--threads", "2000"], "from 1 to 1024"),
    (["generate", "--model", "m", "--prompt", "p", "--threads", "0"], "argument --threads: '0'"),
    (["worker", "--join", "h:7001", "--retry-max-s", "-1"], "argument --retry-max-s: '-1' is not a number"),
    (["worker", "--join", "h:7001", "--retry-max-s", "0"], "argument --retry-max-s"),
    (["worker", "--join", "h:7001", "--retry-max-s", "nan"], "argument --retry-max-s"),
    (["worker", "--join", "h:7001", "--retry-max-s", "inf"], "argument --retry-max-s"),
    (["worker", "--join", "h:7001", "--max-memory-gb", "inf"], "argument --max-memory-gb: 'inf'"),
    (["worker", "--join", "h:7001", "--max-memory-gb", "nan"], "argument --max-memory-gb: 'nan'"),
    (["worker", "--join", "h:7001", "--max-memory-gb", "1e30"], "argument --max-memory-gb: '1e30' GiB is more"),
    (["worker", "--join", "h:7001", "--max-frame-mb", "1e-9"], "argument --max-frame-mb: '1e-9'"),
    (["worker", "--join", "h:7001", "--head-timeout-s", "inf"], "argument --head-timeout-s: 'inf'"),
    (["worker", "--join", "::1"], "'::1' is an IPv6 address with no port; write it in brackets, then the port: "
                                  "[::1]:PORT"),
    (["worker", "--join", "fe80::1:7001"], "put an IPv6 host in brackets, then the port: [fe80::1]:7001, or for "
                                           "the address fe80::1:7001 itself [fe80::1:7001]:PORT"),
    (["worker", "--join", "::1:7001"], "put an IPv6 host in brackets, then the port: [::1]:7001"),
    (["worker", "--join", "fe80::1:abcd"], "'fe80::1:abcd' is an IPv6 address with no port"),
    (["worker", "--join", "10.0.0.5:7001:7001"], "holds more than one ':'; write one host and one port, like "
                                                 "HEAD_HOST:7001"),
    (["worker", "--join", "[::1]"], "has no port"),
    (["worker", "--join", "10.0.0.5"], "has no port; write host:port like HEAD_HOST:7001, the head's head.listen"),
    (["worker", "--join", "http://10.0.0.5:7001"], "is a URL; write host:port alone, without http://, like HEAD"),
    (["worker", "--join", "tcp://[::1]:7001"], "is a URL"),
    (["worker", "--join", "h:0"], "--join"),
])
def test_flags_that_stand_for_topology_keys_take_their_ranges(argv: list[str], refused: str, capsys) -> None:
    """Each worker and generate flag with a topology twin refuses what the key refuses (NaN, inf, 0, negatives,
    past the key's most), in argparse's one line: these were tracebacks (--threads -1, --max-memory-gb inf or
    1e30, --max-frame-mb 1e-9) or a worker retrying in a busy loop (--retry-max-s -1)."""
    from tc.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2 and refused in capsys.readouterr().err


def test_join_takes_an_ipv6_host_in_brackets_as_the_topology_writes_it() -> None:
    from tc.cli import build_parser

    assert build_parser().parse_args(["worker", "--join", "[::1]:7001"]).join == ("::1", 7001)
    assert build_parser().parse_args(["worker", "--join", "head.lan:7001"]).join == ("head.lan", 7001)
    args = build_parser().parse_args(["worker", "--join", "h:1", "--threads", "3", "--retry-max-s", "0.5",
                                      "--max-memory-gb", "0.5", "--max-frame-mb", "64"])
    assert (args.threads, args.retry_max_s, args.max_memory_gb, args.max_frame_mb) == (3, 0.5, 0.5, 64.0)


def test_every_argument_of_every_command_says_what_it_is_for() -> None:
    """`tc plan -h` showed its topology argument, and `tc generate -h` most of its flags, with no word of help."""
    import argparse

    from tc.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in [("tc", parser), *commands.items()]:
        for action in command._actions:
            if action.dest != "command":
                what = f"{name} {action.option_strings or action.dest}"
                assert action.help and action.help is not argparse.SUPPRESS, what


def test_an_address_the_head_cannot_listen_on_names_its_key() -> None:
    """A port in use (or an address not of this machine) is a one-line error at the key, not a traceback."""
    import socket

    from tc.head.main import _listening

    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = HostPort("127.0.0.1", taken.getsockname()[1])
        with pytest.raises(TopologyError) as info, _listening("head.listen", address):
            socket.create_server((address.host, address.port))
    assert info.value.key_path == "head.listen" and f"cannot listen on {address}" in info.value.message
    assert "another process holds that port (a head already running?)" in info.value.message
    # an address of another machine (README's example head, 192.168.1.50, copied) has no port to free
    elsewhere = HostPort("192.0.2.1", 7001)  # TEST-NET-1: never an address of this machine
    with pytest.raises(TopologyError) as info, _listening("head.api", elsewhere):
        socket.create_server((elsewhere.host, elsewhere.port))
    assert "the host must be an address of this machine, or 0.0.0.0" in info.value.message
    assert "free that port" not in info.value.message and "holds that port" not in info.value.message


@pytest.mark.parametrize("key", ["head.api", "head.listen"])
def test_a_port_in_use_stops_the_head_before_it_loads_anything(tmp_path: Path, key: str, caplog) -> None:
    """The head checks both its ports before it fetches and loads its tensors, so an operator who left another
    head running hears of it at once, not minutes into a large model's load."""
    import socket

    from cluster import free_port, write_topology
    from tc.head.main import start_head
    from tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "model", seed=7)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        other = f"127.0.0.1:{free_port()}"
        head = {"api": busy, "listen": other} if key == "head.api" else {"api": other, "listen": busy}
        topology = load_topology(write_topology(tmp_path / "t.yaml", model, [{"id": "w", "device": "cpu"}],
                                                head=head))
        caplog.set_level(logging.INFO)
        with pytest.raises(TopologyError) as info:
            start_head(topology)
    assert info.value.key_path == key and f"cannot listen on {busy}" in info.value.message
    assert "head tensors loaded" not in caplog.text and "batch:" in caplog.text


def test_the_head_names_its_file_for_a_port_found_in_use(tmp_path: Path) -> None:
    """`tc head FILE` with a port in use says FILE: head.listen: ..., as every other topology error does (it said
    "topology:", and the operator of several heads could not tell which file)."""
    import socket
    import subprocess
    import sys

    from cluster import ROOT, free_port, write_topology
    from tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "model", seed=7)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        path = write_topology(tmp_path / "t.yaml", model, [{"id": "w", "device": "cpu"}],
                              head={"api": f"127.0.0.1:{free_port()}", "listen": busy})
        done = subprocess.run([sys.executable, "-m", "tc", "head", str(path)], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"{path}: head.listen: cannot listen on {busy}" in done.stderr, done.stderr


def test_a_head_frame_limit_under_one_step_stops_the_head_at_start(tmp_path: Path) -> None:
    """head.max_frame_mb under one decode step of a full batch was taken, and the head dropped its workers at the
    first such step; it stops the head at start now, with the least that serves."""
    from cluster import write_topology
    from tc.head.main import start_head
    from tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", seed=1, hidden_size=256, intermediate_size=512)
    path = write_topology(tmp_path / "t.yaml", model, [{"id": "a", "device": "cpu"}],
                          head={"max_frame_mb": 0.005, "max_batch": 8})
    with pytest.raises(TopologyError) as info:
        start_head(load_topology(path).with_ports(api_port=0, listen_port=0))
    assert info.value.key_path == "head.max_frame_mb"
    assert "under the" in info.value.message and "(8 sequences of hidden size 256); give at least" in \
        info.value.message
    path = write_topology(tmp_path / "t.yaml", model, [{"id": "a", "device": "cpu"}],
                          head={"max_frame_mb": 0.05, "max_batch": 8})
    start_head(load_topology(path).with_ports(api_port=0, listen_port=0)).stop()


def test_a_file_nested_past_any_topology_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="nested hundreds of levels deep"):
        load_topology(write(tmp_path, "nodes: " + "[" * 3000 + "]" * 3000 + "\n"))


def test_unknown_node_lookup_names_the_ids(base_dir: Path) -> None:
    with pytest.raises(KeyError, match="gpu-box, macbook, cpu-box"):
        parse_topology(good(), base_dir).node("nope")


# --- files: YAML errors carry a line -------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "topology.yaml"
    path.write_text(text, encoding="utf-8")
    return path


MINIMAL = """\
model: Qwen/Qwen2.5-0.5B-Instruct   # HF repo id, or a local directory
quant: int8                         # fp16 | int8 | int4
dtype: bf16                         # compute dtype: fp16 | bf16 | fp32
head:
  api: 0.0.0.0:8000                 # OpenAI-compatible HTTP API
  listen: 0.0.0.0:7001              # where workers join
nodes:                              # in pipeline order
  - id: gpu-box
    device: cuda:0                  # auto | cuda | cuda:N | mps | cpu
  - id: macbook
    device: mps
    max_memory_gb: 12               # MPS reports no memory: the file may say it
    layers: 14-23                   # optional pin; otherwise the planner splits by capacity
"""


def test_design_sketch_loads(tmp_path: Path) -> None:
    topo = load_topology(write(tmp_path, MINIMAL))
    assert [(n.id, n.device, n.layers) for n in topo.nodes] == [
        ("gpu-box", "cuda:0", None), ("macbook", "mps", (14, 24)),
    ]
    assert topo.nodes[1].max_memory_gb == 12.0


def test_numbers_are_read_as_yaml_1_2_reads_them(tmp_path: Path) -> None:
    """YAML 1.1 (PyYAML's) read a plain 12:23 as the base-60 number 743 and 0755 as the octal 493: a layer range
    written with a colon pinned one wrong layer, or a node's id changed. Both stay text now: the range is refused
    with the form to write, the id kept as written; plain numbers read as before."""
    with pytest.raises(TopologyError) as info:
        load_topology(write(tmp_path, MINIMAL.replace("14-23", "12:23")))
    assert info.value.key_path == "nodes[1].layers" and "'12:23' is not a layer range" in info.value.message
    topo = load_topology(write(tmp_path, MINIMAL.replace("id: gpu-box", "id: 0755")))
    assert topo.node_ids == ("0755", "macbook")
    for written, read in [("0x10", 16), ("1.5", 1.5), (".5", 0.5), ("+7", 7), ("1_000", 1000)]:
        assert load_topology(write(tmp_path, MINIMAL.replace("max_memory_gb: 12 ", f"max_memory_gb: {written} "))
                             ).nodes[1].max_memory_gb == read
    with pytest.raises(TopologyError) as info:
        load_topology(write(tmp_path, MINIMAL.replace("    layers: 14-23", "    threads: 010")))
    assert info.value.key_path == "nodes[1].threads" and "'010'" in info.value.message


@pytest.mark.parametrize(
    ("text", "line", "phrase"),
    [
        ("model: a/b\nquant: int8\n  dtype: bf16\n", 3, "line 3"),
        ("model: a/b\nhead:\n  api: [0.0.0.0:8000\n", 4, "line 4"),
        ("model: a/b\nhead:\n\tapi: x\n", 3, "tabs"),
        ("model: a/b\nquant: int8\nmodel: c/d\n", 3, "given twice"),
        ("nodes:\n  - id: a\n    layers: 1\n    layers: 2\n", 4, "'layers' is given twice"),
    ],
    ids=["bad indent", "unclosed bracket", "tab", "duplicate top key", "duplicate node key"],
)
def test_yaml_errors_show_the_line(tmp_path: Path, text: str, line: int, phrase: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert f"line {line}" in message and phrase in message
    assert "\n" not in message


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL.replace("device: mps", "device: gpu"))
    with pytest.raises(TopologyError, match=re.escape(f"{path}: nodes[1].device: 'gpu' is not a device")):
        load_topology(path)


def test_yes_is_a_boolean_not_a_number(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL.replace("  - id: gpu-box\n", "  - id: gpu-box\n    threads: yes\n"))
    with pytest.raises(TopologyError, match=r"nodes\[0\]\.threads: .*boolean"):
        load_topology(path)


def test_local_model_relative_to_the_file_not_the_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "conf"
    make_model_dir(conf / "models" / "q")
    path = conf / "topology.yaml"
    path.write_text(MINIMAL.replace("Qwen/Qwen2.5-0.5B-Instruct", "./models/q"), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    topo = load_topology(path)
    assert topo.model_is_local and topo.model == str((conf / "models" / "q").resolve())


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="cannot read the file"):
        load_topology(tmp_path / "absent.yaml")


def test_empty_file(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="the file is empty"):
        load_topology(write(tmp_path, "# nothing yet\n"))


# --- the example file -----------------------------------------------------------------------------------


def test_example_file_loads() -> None:
    topo = load_topology(REPO_ROOT / "topology.example.yaml")
    assert isinstance(topo, Topology)
    assert topo.model == "Qwen/Qwen2.5-0.5B-Instruct" and not topo.model_is_local
    assert [parse_device(n.device)[0] for n in topo.nodes] == ["cuda", "mps", "cpu"]


@pytest.mark.parametrize("key", sorted(set(TOP_KEYS + HEAD_KEYS + NODE_KEYS)))
def test_example_file_documents_every_key(key: str) -> None:
    text = (REPO_ROOT / "topology.example.yaml").read_text(encoding="utf-8")
    # Each key appears as a live or commented-out "key:" line.
    assert re.search(rf"^\s*#?\s*(- )?{key}:", text, re.MULTILINE), key
