"""The head process: plan from the topology, load the head's tensors, accept workers, serve the API."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch

from ..generation import Generator
from ..model import quant
from ..model.config import ModelConfig
from ..model.qwen2 import HeadModel, resolve_compute_dtype
from ..model.tokenizer import TextTokenizer
from ..model.weights import WeightIndex, head_tensor_names, is_quantized, layer_prefix, layer_shapes
from ..model_source import ModelSource
from ..planner import Plan, layer_weight_bytes, make_plan, node_specs
from ..topology import Topology, load_topology
from .api import create_app
from .http_server import HttpServer, start_http_server
from .pipeline import RemotePipeline
from .service import GenerationService
from .workers import WorkerRegistry

log = logging.getLogger(__name__)

SHUTDOWN_DRAIN_S = 3.0  # longest wait, on shutdown, for requests in flight to end (they fail fast: no workers)


def model_source(topology: Topology) -> ModelSource:
    return ModelSource(topology.model, topology.model_is_local, topology.revision, topology.hf_cache_dir)


def build_plan(topology: Topology, config: ModelConfig) -> Plan:
    """The static plan: layer sizes follow from config.json's shapes (checked against the headers on load)."""
    per_layer = [[(layer_prefix(i) + name, shape, 2) for name, shape in layer_shapes(config, i).items()]
                 for i in range(config.num_hidden_layers)]
    layer_bytes = layer_weight_bytes(per_layer, topology.quant, topology.group_size, quantized=is_quantized)
    return make_plan(config.num_hidden_layers, layer_bytes, node_specs(topology.without_spares()))


def load_config_and_plan(topology: Topology) -> tuple[ModelSource, ModelConfig, Plan]:
    """The model's config (through its family's registry entry: an architecture tc does not run is refused here,
    before anything starts) and the plan. Raises ConfigError, WeightsError, PlanError."""
    source = model_source(topology)
    config_dir = source.config_dir()
    config = ModelConfig.from_file(config_dir / "config.json")
    if topology.model_is_local:  # headers are on this disk: check them before promising a plan
        WeightIndex.open(config_dir).validate(config)
    return source, config, build_plan(topology, config)


def run_plan(args: argparse.Namespace) -> int:
    topology = load_topology(args.topology)
    _, config, plan = load_config_and_plan(topology)
    print(f"model {topology.model} ({config.model_type}): {config.num_hidden_layers} layers, weights "
          f"{topology.quant}")
    print(plan.table())
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


def start_head(topology: Topology) -> Head:
    """Load the head's share of the model, listen for workers and serve the API. Returns once serving."""
    started = time.perf_counter()
    if topology.head.threads:
        torch.set_num_threads(topology.head.threads)
    source, config, plan = load_config_and_plan(topology)
    log.info("model %s: %d layers, hidden %d, weights %s; plan:\n%s", topology.model, config.num_hidden_layers,
             config.hidden_size, topology.quant, plan.table())
    names = head_tensor_names(config)
    model_dir = source.fetch_tensors(names)
    source.fetch_tokenizer()
    index = WeightIndex.open(model_dir, only=names)
    index.validate(config, only=names)
    dtype = resolve_compute_dtype(topology.dtype, "cpu")
    head_model = HeadModel.load(config, index, dtype)
    if topology.quant != "fp16":
        quant.quantize_linears(head_model, quant.head_weight_mode(topology.quant), topology.group_size)
    tokenizer = TextTokenizer.load(model_dir, chat_template=topology.chat_template)
    if tokenizer.chat_templates is not None:
        log.info("chat template from %s", tokenizer.chat_templates.source)
    else:
        log.warning("the model has no chat template: /v1/chat/completions will answer 400 until chat_template: "
                    "in the topology file names one")
    log.info("head tensors loaded (%.0f MB, %s) in %.1fs", index.nbytes(names) / 1e6, dtype,
             time.perf_counter() - started)

    registry = WorkerRegistry(topology, plan, config)
    pipeline = RemotePipeline(registry, topology.head.resume, topology.head.resume_grace_s)
    generator = Generator(head_model, tokenizer, pipeline, dtype)
    service = GenerationService(topology.name, tokenizer, generator, registry.readiness,
                                max_queue=topology.head.max_queue, step_hops=lambda: pipeline.last_hops)
    max_body = topology.head.max_body_bytes
    # enough HTTP threads for the one generating, the queue, and health checks, so the bounded queue (not
    # Waitress's unbounded backlog) decides who waits and who gets a 429
    http = start_http_server(create_app(service, max_body_bytes=max_body, cluster=registry), topology.head.api.host,
                             topology.head.api.port, threads=topology.head.max_queue + 4, max_body_bytes=max_body)
    listen_port = registry.start(topology.head.listen.host, topology.head.listen.port)
    registry.on_ready = lambda: log.info("cluster ready: all %d workers loaded; serving %s at %s/v1",
                                         len(plan.stages), topology.name, http.url)
    log.info("API at %s/v1 (answers 503 until the workers are ready)", http.url)
    log.info("waiting for %d worker(s) on port %d; on each machine run: python tc.pyz worker --join "
             "<this-host>:%d [--node-id ID]  (ids: %s)", len(plan.stages), listen_port, listen_port,
             ", ".join(s.node_id for s in plan.stages))
    return Head(topology, registry, service, http, listen_port)


def run_head(args: argparse.Namespace) -> int:
    topology = load_topology(args.topology).with_ports(api_port=args.api_port, listen_port=args.listen_port)
    head = start_head(topology)
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if done.is_set():  # a second signal: the operator does not want to wait for the drain
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s received: shutting down", signal.Signals(signum).name)
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    while not done.wait(1.0):  # a timed wait, so the signal handler runs promptly on every platform
        pass
    head.stop()
    log.info("head stopped")
    return 0
