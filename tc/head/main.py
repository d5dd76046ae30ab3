"""The head process: plan from the topology, load the head's tensors, accept workers, serve the API."""
from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import logging
import os
import platform
import signal
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch

from ..bench import default_bench_dir, measure_all
from ..forecast import Forecast, HeadCost, explain, forecast, hop_bytes_per_position
from ..generation import Generator
from ..model import quant
from ..model.config import ModelConfig
from ..model.qwen2 import HeadModel, resolve_compute_dtype
from ..model.tokenizer import TextTokenizer, check_vocab
from ..model.weights import (LM_HEAD, WeightIndex, expected_shapes, head_names_to_fetch, head_tensor_names,
                             is_quantized, layer_prefix, layer_shapes, own_lm_head)
from ..model_source import ModelSource
from ..openmp import on_own_thread
from ..batch_memory import BatchPlan, plan_batch, stage_need
from ..planner import GIB, Plan, format_bytes, layer_weight_bytes, make_plan, node_specs
from ..signals import on_signals
from ..protocol.messages import Hello
from ..speed import LinkSpeed, Speed
from ..topology import HostPort, Topology, TopologyError, load_topology
from .addresses import bind_address
from .admission import device_for, over_memory_cap, sequences_to_hold, speed_for, worker_memory
from .api import body_limit, create_app, create_loading_app
from .reasoning import ReasoningUnavailable, reasoning_tokens
from .sampling_defaults import describe as describe_sampling, read_sampling_defaults
from .http_server import HttpServer, start_http_server
from .loading import HeadLoading
from .metrics import Metrics
from .pipeline import RemotePipeline
from .service import GenerationService
from .workers import WorkerRegistry

log = logging.getLogger(__name__)

SHUTDOWN_DRAIN_S = 3.0  # longest wait, on shutdown, for requests in flight to end (they fail fast: no workers)


def model_source(topology: Topology) -> ModelSource:
    return ModelSource(topology.model, topology.model_is_local, topology.revision, topology.hf_cache_dir)


def layer_bytes_of(topology: Topology, config: ModelConfig) -> list[int]:
    """Each layer's weight bytes in the topology's weight mode, from config.json's shapes."""
    per_layer = [[(layer_prefix(i) + name, shape, 2) for name, shape in layer_shapes(config, i).items()]
                 for i in range(config.num_hidden_layers)]
    return layer_weight_bytes(per_layer, topology.quant, topology.group_size, quantized=is_quantized)


def build_plan(topology: Topology, config: ModelConfig) -> Plan:
    """The static plan: layer sizes follow from config.json's shapes (checked against the headers on load);
    node speeds, where the topology gives them, split their runs by time."""
    return make_plan(config.num_hidden_layers, layer_bytes_of(topology, config),
                     node_specs(topology.without_spares()))


def plan_from_workers(topology: Topology, config: ModelConfig, hellos: dict[str, Hello],
                      links: dict[str, LinkSpeed | None] | None = None) -> Plan:
    """The plan from the planned set's HELLOs: each node's speed as its worker measured it for the node's device,
    dtype and the topology's weight mode (else the topology's nodes[].speed), its memory as the topology caps it,
    else as the worker offers it (its --max-memory-gb, else what its device reports free: a plan that gave a
    worker more than that would only run its load out of memory), and its link as the head measured it. Raises
    PlanError."""
    specs = []
    for spec, entry in zip(node_specs(topology.without_spares()), topology.pipeline_nodes):
        hello = hellos[entry.id]
        device = device_for(entry.device, hello)
        figure = speed_for(hello, device, spec.dtype, topology.quant)
        speed = spec.speed if figure is None else Speed(figure.decode_bytes_per_s, figure.prefill_bytes_per_s,
                                                        figure.layer_overhead_s)
        memory, memory_from, sizes_batch = spec.memory_bytes, spec.memory_from, True
        if memory is None:
            memory = worker_memory(hello, device)
            # a device's free figure places the weights; the batch stays the topology's, as a plan from it keeps
            sizes_batch = hello.max_memory_bytes is not None
            memory_from = "its --max-memory-gb" if sizes_batch else f"what {device} on {hello.hostname} reports free"
        specs.append(replace(spec, speed=speed, memory_bytes=memory, memory_from=memory_from,
                             memory_sizes_batch=sizes_batch, link=(links or {}).get(entry.id)))
    return make_plan(config.num_hidden_layers, layer_bytes_of(topology, config), specs)


def head_weight_bytes(topology: Topology, config: ModelConfig) -> int:
    """Weight bytes the head reads for each token: the final norm and lm_head (the embedding's one row is
    nothing beside it), lm_head in the head's weight mode (int8 under int4)."""
    shapes = expected_shapes(config)
    lm_head = shapes.get(LM_HEAD, shapes["model.embed_tokens.weight"])  # tied: the embedding serves
    per_token = [(LM_HEAD, lm_head, 2), ("model.norm.weight", shapes["model.norm.weight"], 2)]
    return layer_weight_bytes([per_token], quant.head_weight_mode(topology.quant), topology.group_size)[0]


def head_speed(topology: Topology) -> Speed:
    """The head machine's speed: the topology's head.speed, else measured here (cached, like a worker's)."""
    if topology.head.speed is not None:
        return topology.head.speed
    if topology.head.threads:  # measured as the head will run: with its own threads
        torch.set_num_threads(topology.head.threads)
    mode = quant.head_weight_mode(topology.quant)
    (figure,) = measure_all("cpu", platform.machine() or "cpu", (topology.dtype,), default_bench_dir(),
                            modes=(mode,))
    return figure.speed


def plan_forecast(topology: Topology, config: ModelConfig, plan: Plan, speed: Speed | None) -> Forecast:
    head = None if speed is None else HeadCost(head_weight_bytes(topology, config), speed)
    return forecast(plan, hop_bytes_per_position(config.hidden_size, topology.dtype), head,
                    direct_hops=topology.head.direct_hops, quant=topology.quant, plan_from=topology.head.plan_from)


def load_config_and_plan(topology: Topology) -> tuple[ModelSource, ModelConfig, Plan]:
    """The model's config (through its family's registry entry: an architecture tc does not run is refused here,
    before anything starts) and the plan. Raises ConfigError, WeightsError, PlanError."""
    source = model_source(topology)
    config_dir = source.config_dir()
    config = with_context(ModelConfig.from_file(config_dir / "config.json"), topology.context_length)
    if topology.model_is_local:  # headers are on this disk: check them before promising a plan
        index = WeightIndex.open(config_dir)
        index.validate(config)
        own_lm_head(config, index)  # a tied model's own lm_head, where it holds one: its shape
    return source, config, build_plan(topology, config)


def with_context(config: ModelConfig, context_length: int | None) -> ModelConfig:
    """`config` serving the topology's context_length (None: the model's own). Raises TopologyError for more
    positions than the model holds: its rotary embedding was not made for them."""
    if context_length is None:
        return config
    if context_length > config.model_context:
        raise TopologyError("context_length", f"{context_length} is more than this model holds "
                            f"({config.model_context} positions, from its config.json); use at most that, or leave "
                            "context_length out")
    return replace(config, context_limit=context_length)


def splits_reasoning(tokenizer: TextTokenizer, setting: bool | None) -> bool:
    """Whether chat replies give the thinking apart from the answer, under the topology's reasoning_content (None:
    decided from the model), logged with why. Raises TopologyError for true on a model without think tokens."""
    try:
        think, why = reasoning_tokens(tokenizer, setting)
    except ReasoningUnavailable as exc:
        raise TopologyError("reasoning_content", str(exc)) from exc
    log.info("chat replies %s: %s", "give the thinking in reasoning_content" if think is not None
             else "keep any thinking in content", why)
    return think is not None


def describe_spares(topology: Topology, plan: Plan, config: ModelConfig, max_batch: int) -> list[str]:
    """One line per spare entry: which nodes it could take over, as its max_memory_gb allows: their layers' weights
    and the KV caches a takeover counts (admission.sequences_to_hold: the batch's where head.max_batch is set,
    else one sequence's; batch_memory.stage_need)."""
    lines = []
    sequences = sequences_to_hold(topology.head.max_batch, max_batch)
    for entry in topology.spare_nodes:
        fits = [s.node_id for s in plan.stages
                if not over_memory_cap(entry, stage_need(config, s, sequences, entry.device))]
        if len(fits) == len(plan.stages):
            lines.append(f"spare {entry.id}: stands by for any node")
            continue
        limit = entry.max_memory_gb
        cap = f"its max_memory_gb {limit:g} ({format_bytes(int(limit * GIB))})"
        others = [s.node_id for s in plan.stages if s.node_id not in fits]
        caches = f"with the KV caches of {sequences} sequence(s) at full context"
        lines.append(f"spare {entry.id}: stands by for {', '.join(fits)} only; the layers of {', '.join(others)}, "
                     f"{caches}, need more than {cap}" if fits else
                     f"spare {entry.id}: can take over no node: every node's layers, {caches}, need more than "
                     f"{cap}; raise it, or lower head.max_batch")
    return lines


def run_plan(args: argparse.Namespace) -> int:
    topology = load_topology(args.topology)
    _, config, plan = load_config_and_plan(topology)
    print(f"model {topology.model} ({config.model_type}): {config.num_hidden_layers} layers, context "
          f"{config.context_length} positions, weights {topology.quant}")
    print(explain(plan, plan_forecast(topology, config, plan, head_speed(topology))) if args.explain
          else plan.table())
    batch = plan_batch(plan, config, topology.head.max_batch)
    print(f"batch: {batch.describe()}")
    for line in describe_spares(topology, plan, config, batch.max_batch):
        print(line)
    cpu_fp16 = [entry.id for entry in topology.nodes
                if entry.device == "cpu" and (entry.dtype or topology.dtype) == "fp16"]
    if cpu_fp16:
        # the table gives the dtype asked for; the worker warns at its load, which is late to learn it
        verb = "computes" if len(cpu_fp16) == 1 else "compute"
        print(f"note: {', '.join(cpu_fp16)} (cpu, fp16) {verb} in fp32: CPUs have no fast fp16, and their KV caches "
              "above are counted in fp32; dtype: bf16 is the fast choice on a CPU")
    if topology.head.plan_from == "workers":
        print(f"head.plan_from: workers: the head makes its plan once all {len(plan.stages)} workers have joined, "
              "from their own speeds and memory and their links; the split above is from this file alone")
    return 0


@dataclass
class Head:
    topology: Topology
    registry: WorkerRegistry
    service: GenerationService
    http: HttpServer
    listen_port: int

    def stop(self) -> None:
        # Workers first (each is told): a generation in flight then ends at once with a clear error, and the
        # requests waiting behind it get a 503 as their turn comes. The HTTP server then answers every request it
        # accepted, those not yet handed to the app with a 503 shutting_down, before it closes.
        self.registry.stop()
        self.http.stop(SHUTDOWN_DRAIN_S)


@contextlib.contextmanager
def _listening(key: str, address: HostPort) -> Iterator[None]:
    """Turns a failure to listen at the topology's `key` (a port in use, an address not of this machine) into a
    TopologyError that names the key."""
    try:
        yield
    except (OSError, ValueError) as exc:  # Waitress raises ValueError for a host it cannot resolve
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        code = exc.errno if isinstance(exc, OSError) else None
        if code == errno.EADDRINUSE:
            fix = "another process holds that port (a head already running?): stop it or give another port"
        elif code in (errno.EACCES, errno.EPERM):
            fix = "ports below 1024 need root on most systems: give a port from 1024 up"
        else:  # an address of another machine, or a host name that does not resolve: no port to free
            fix = "the host must be an address of this machine, or 0.0.0.0 for every interface"
        raise TopologyError(key, f"cannot listen on {address}: {reason}; {fix}") from exc


def check_can_listen(key: str, address: HostPort) -> None:
    """Binds the topology's `key` address once and lets it go: a port in use then stops the head at once, not
    after it has fetched and loaded its tensors (minutes for a large model). Port 0 is always free. Raises
    TopologyError, as the real bind later would."""
    if address.port == 0:
        return
    with _listening(key, address):
        family, host = bind_address(address.host, address.port)
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Waitress and the join port bind
            probe.bind((host, address.port))


def start_head(topology: Topology) -> Head:
    """Plan, open the API, listen for workers (who load their layers meanwhile), load the head's share of the model
    (the API meanwhile says so) and serve. Returns once serving. Raises TopologyError, ConfigError, WeightsError,
    ModelSourceError, PlanError, with the API and the workers' port closed again."""
    started = time.perf_counter()
    if topology.head.threads:
        torch.set_num_threads(topology.head.threads)
    source, config, plan = load_config_and_plan(topology)  # checks the topology even when workers will plan
    # the workers fetch their layers from the commit the head's config.json came from, not a branch that may move
    topology = replace(topology, revision=source.revision)
    timed = topology.head.plan_from == "workers" or any(e.speed is not None for e in topology.nodes)
    # one-off torch work runs on threads that end, so the scheduler's thread holds the process's only OpenMP pool
    speed = on_own_thread(lambda: head_speed(topology), "head-speed") if timed else None
    waiting = topology.head.plan_from == "workers"
    if waiting:
        log.info("model %s: %d layers, hidden %d, context %d positions, weights %s; the plan is made from the "
                 "workers' own speeds once all %d have joined", topology.model, config.num_hidden_layers,
                 config.hidden_size, config.context_length, topology.quant, len(plan.stages))
    else:
        log.info("model %s: %d layers, hidden %d, context %d positions, weights %s; plan:\n%s", topology.model,
                 config.num_hidden_layers, config.hidden_size, config.context_length, topology.quant,
                 explain(plan, plan_forecast(topology, config, plan, speed)) if timed else plan.table())
    batch = plan_batch(plan, config, topology.head.max_batch)  # refuses a batch that cannot fit, before loading
    log.info("batch: %s", batch.describe())
    if not waiting:  # a plan made from the workers may differ; each takeover says why a spare cannot serve
        for line in describe_spares(topology, plan, config, batch.max_batch):
            log.info("%s", line)
    check_can_listen("head.listen", topology.head.listen)  # a port in use stops the head before it loads anything
    max_body = topology.head.max_body_bytes
    if max_body is None:
        max_body = body_limit(config.context_length)
    metrics = Metrics()

    def plan_once(hellos: dict[str, Hello], links: dict[str, LinkSpeed | None]) -> Plan:
        made = plan_from_workers(topology, config, hellos, links)
        log.info("plan from the workers' measurements (fixed while the head runs):\n%s",
                 explain(made, plan_forecast(topology, config, made, speed)))
        return made

    registry = WorkerRegistry(topology, None if waiting else plan, config,
                              plan_once=plan_once if waiting else None, batch=batch)
    # while the head loads (minutes for a large model), /metrics shows the workers joining, loading and failing;
    # the service takes the gauges over once it exists
    metrics.watch(lambda: 0, lambda: 0, registry.readiness, slots=lambda: registry.batch.max_batch,
                  tokens_per_s=lambda: 0.0)
    loading = HeadLoading(topology.name, config.context_length, registry.readiness)
    # The API opens now, before the load (minutes for a large model), so that it answers what the head is doing
    # where a closed port said nothing. Enough HTTP threads for the batch, the queue, and health checks, so the
    # bounded queue (not Waitress's unbounded backlog) decides who waits and who gets a 429.
    with _listening("head.api", topology.head.api):
        http = start_http_server(create_loading_app(loading, metrics, topology.head.cors_origins,
                                                    topology.head.api_keys),
                                 topology.head.api.host, topology.head.api.port,
                                 threads=batch.max_batch + topology.head.max_queue + 4, max_body_bytes=max_body,
                                 cors_origins=topology.head.cors_origins, metrics=metrics)
    keys = len(topology.head.api_keys)
    log.info("API at %s/v1 (answers 503 while the head loads its tensors; %s)", http.url,
             f"its /v1 routes want one of {keys} API key{'s' if keys > 1 else ''} (head.api_keys)" if keys else
             "open to whoever reaches it: head.api_keys would ask for a key")
    try:
        return _load_and_serve(topology, source, config, plan, registry, loading, metrics, http, max_body, started)
    except BaseException:
        registry.stop()  # the workers that joined are told, and rejoin a head started again
        http.stop(SHUTDOWN_DRAIN_S)  # a head that cannot serve closes its port, as it exits
        raise


def _load_and_serve(topology: Topology, source: ModelSource, config: ModelConfig, plan: Plan,
                    registry: WorkerRegistry, loading: HeadLoading, metrics: Metrics, http: HttpServer, max_body: int,
                    started: float) -> Head:
    """start_head's part while its API answers that it is loading: listen for workers, which join and load their
    layers meanwhile, fetch and load the head's tensors and its tokenizer, naming each step in `loading`, then
    hand the API the model."""
    names = head_tensor_names(config)
    # while the head loads, a plan made from the workers is logged; once it serves, the batch is its service's
    serving: list[GenerationService] = []  # the service, once made (appended under the registry's lock)

    def planned(made: BatchPlan) -> None:  # the workers' memory may hold fewer sequences than the topology's plan
        log.info("batch: %s", made.describe())
        for service in serving:
            service.max_batch = made.max_batch

    def cluster_ready() -> None:
        if serving:  # else the head, still loading, says so once it serves
            log.info("cluster ready: all %d workers loaded; serving %s at %s/v1", len(registry.slots),
                     topology.name, http.url)

    registry.on_plan, registry.on_ready = planned, cluster_ready
    with _listening("head.listen", topology.head.listen):
        listen_port = registry.start(topology.head.listen.host, topology.head.listen.port)
    spares = ", ".join(e.id for e in topology.spare_nodes)
    token = topology.head.join_token is not None  # the line is copied as it stands: without this it is refused
    log.info("waiting for %d worker(s) on port %d; %s run: python tc.pyz worker --join %s%s [--node-id ID]  "
             "(ids: %s%s)%s", len(plan.stages), listen_port, *join_hint(topology.head.listen.host, listen_port),
             " --join-token-file TOKEN_FILE" if token else "", ", ".join(s.node_id for s in plan.stages),
             f"; spares: {spares}" if spares else "", "; TOKEN_FILE: a file holding head.join_token" if token else "")

    def fetching(file: str, number: int, files: int) -> Callable[[int, int | None], None]:
        loading.begin("fetching_tensors", f"fetching {file} ({number} of {files}) from the Hub", unit="bytes")
        return loading.advance

    # the tokenizer's few small files first: a repo without tokenizer.json is said at once, not after the shards
    loading.begin("fetching_tokenizer", "fetching the tokenizer's files")
    source.fetch_tokenizer()
    fetched = head_names_to_fetch(config)
    model_dir = source.fetch_tensors(fetched, fetching)
    index = WeightIndex.open(model_dir, only=fetched)
    index.validate(config, only=names)
    if own_lm_head(config, index):  # read too, and used where its values are not the embedding's (HeadModel.load)
        names = names + [LM_HEAD]
    dtype = resolve_compute_dtype(topology.dtype, "cpu")
    head_mode = quant.head_weight_mode(topology.quant)

    def load_head_model() -> HeadModel:
        # an lm_head that stays in the compute dtype takes the fastest product this CPU has (blocked bf16: ~40%
        # less time a token, for the matrix held twice while it packs); a quantized one has nothing to pack
        loaded = HeadModel.load(config, index, dtype, pack=None if head_mode == "fp16" else False)
        quant.quantize_linears(loaded, head_mode, topology.group_size)
        loaded.screen_greedy()
        return loaded

    loading.begin("loading_tensors", f"reading its tensors ({format_bytes(index.nbytes(names))}: the embedding, "
                  "the final norm and lm_head)")
    head_model = on_own_thread(load_head_model, "head-load")
    loading.begin("loading_tokenizer", "reading the tokenizer")
    tokenizer = TextTokenizer.load(model_dir, chat_template=topology.chat_template)
    check_vocab(tokenizer, config.vocab_size, model_dir)
    if tokenizer.chat_templates is not None:
        log.info("chat template from %s", tokenizer.chat_templates.source)
    else:
        log.warning("the model has no chat template: /v1/chat/completions will answer 400 until chat_template: "
                    "in the topology file names one")
    reasoning = splits_reasoning(tokenizer, topology.reasoning_content)
    log.info("head tensors loaded (%s, %s) in %.1fs", format_bytes(index.nbytes(names)), dtype,
             time.perf_counter() - started)

    pipeline = RemotePipeline(registry)
    generator = Generator(head_model, tokenizer, pipeline, dtype, draft_tokens=topology.head.draft_tokens)
    sampling = read_sampling_defaults(model_dir)
    if sampling:
        log.info("sampling for requests that leave it out, from the model's generation_config.json: %s (a "
                 "request's own values win)", describe_sampling(sampling))
    service = GenerationService(topology.name, tokenizer, generator, registry.readiness,
                                max_queue=topology.head.max_queue, max_batch=registry.batch.max_batch,
                                prefill_chunk=topology.head.prefill_chunk, step_hops=lambda: pipeline.last_hops,
                                metrics=metrics, prefix_cache=topology.head.prefix_cache, sampling_defaults=sampling)
    with registry.lock:  # a plan made from the workers while the head loaded (planned() runs under this lock)
        service.max_batch = registry.batch.max_batch
        serving.append(service)
    http.serve(create_app(service, max_body_bytes=max_body, cluster=registry,
                          cors_origins=topology.head.cors_origins, reasoning=reasoning,
                          api_keys=topology.head.api_keys))
    readiness = registry.readiness()
    if readiness.is_ready:  # every worker loaded before the head did
        cluster_ready()
    else:
        log.info("API at %s/v1 (answers 503 until the workers are ready: %d of %d so far)", http.url,
                 len(readiness.ready), readiness.required)
    return Head(topology, registry, service, http, listen_port)


def join_hint(host: str, port: int) -> tuple[str, str]:
    """Where to run a worker, and the address it joins: a loopback head.listen takes workers of this machine only,
    and one on a given address is joined there."""
    if host in ("0.0.0.0", "::", ""):
        return "on each machine", f"<this-host>:{port}"
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = False
    where = ("on this machine (head.listen is a loopback address: no other machine can join)" if loopback
             else "on each machine")
    return where, str(HostPort(host, port))


def run_head(args: argparse.Namespace) -> int:
    try:
        topology = load_topology(args.topology).with_ports(api_port=args.api_port, listen_port=args.listen_port)
        head = start_head(topology)
    except TopologyError as exc:  # found once the file was read (a port in use, a limit too small): name the file
        if exc.source != "topology":
            raise
        raise TopologyError(exc.key_path, exc.message, str(args.topology)) from exc
    done = threading.Event()

    def on_signal(sig: signal.Signals) -> None:
        if done.is_set():  # a second signal: the operator does not want to wait for the drain
            log.warning("second %s: exiting now", sig.name)
            os._exit(1)
        log.info("%s received: shutting down", sig.name)
        done.set()

    on_signals((signal.SIGINT, signal.SIGTERM), on_signal)
    while not done.wait(1.0):  # a timed wait, so the signal handler runs promptly on every platform
        pass
    head.stop()
    log.info("head stopped")
    return 0
