"""Prometheus metrics of the head: requests, tokens, latency, the pipeline's stages and hops, queue and nodes.

Each `Metrics` owns its own `CollectorRegistry` (never prometheus_client's global one), so a process may build
any number of apps, as tests do. Counters and histograms are updated where things happen (the HTTP middleware,
the generation service); the queue and the nodes' state are read when Prometheus scrapes, through a collector
over callables, so they can never go stale.

Hop times come from the remote pipeline after each step: for each worker, the head measures the round trip
and the worker reports its compute time, so `round trip - compute` is the network (and framing) time of that
hop; with direct hops the head sees only the step's whole way, and each worker gets an even share of it. The
single-process pipeline has no hops, so those series stay empty there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

Hop = tuple[str, float, float]  # (node id, compute s, round trip s), as RemotePipeline.last_hops holds them

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
NETWORK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
WAIT_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


class NodeStates(Protocol):
    """What a readiness check says of the planned nodes (service.Readiness)."""

    ready: Sequence[str]
    missing: Sequence[str]


@dataclass(frozen=True)
class _NoNodes:
    ready: Sequence[str] = ()
    missing: Sequence[str] = ()


class _LiveState(Collector):
    """Gauges read at scrape time: requests waiting and running, the batch's slots, the recent token rate, and
    whether each planned node serves."""

    def __init__(self, waiting: Callable[[], int], running: Callable[[], int], readiness: Callable[[], NodeStates],
                 slots: Callable[[], int], tokens_per_s: Callable[[], float]):
        self.waiting, self.running, self.readiness = waiting, running, readiness
        self.slots, self.tokens_per_s = slots, tokens_per_s

    def _families(self) -> tuple[GaugeMetricFamily, ...]:
        return (GaugeMetricFamily("tc_queue_depth",
                                  "Generations waiting for a place in the batch (each choice of a request one)"),
                GaugeMetricFamily("tc_requests_running", "Generations in the batch now (slots in use)"),
                GaugeMetricFamily("tc_batch_slots", "Sequences the batch holds at most (head.max_batch)"),
                GaugeMetricFamily("tc_tokens_per_second", "Tokens generated per second, all sequences together, "
                                  "over the last 10 s"),
                GaugeMetricFamily("tc_node_up", "1 when the planned node is loaded and serving, else 0",
                                  labels=["node"]))

    def describe(self) -> Iterator[Metric]:
        # without describe() the registry would collect at registration, before the service is ready to answer
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        waiting, running, slots, rate, up = self._families()
        waiting.add_metric([], self.waiting())
        running.add_metric([], self.running())
        slots.add_metric([], self.slots())
        rate.add_metric([], self.tokens_per_s())
        nodes = self.readiness()
        for node in nodes.ready:
            up.add_metric([node], 1)
        for node in nodes.missing:
            up.add_metric([node], 0)
        return iter((waiting, running, slots, rate, up))


# the methods counted under their own name (RFC 9110's and PATCH); any other counts as "other"
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


class Metrics:
    """The head's metrics in a registry of their own; `render()` is the body of GET /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter("tc_http_requests", "HTTP requests answered, by route and status",
                                     ["method", "route", "status"], registry=r)
        self.generations = Counter("tc_generations", "Generations by how they ended: stop, length, abandoned "
                                   "(the client went away) or error", ["outcome"], registry=r)
        self.prompt_tokens = Counter("tc_prompt_tokens", "Prompt tokens run through the pipeline", registry=r)
        self.cached_prompt_tokens = Counter("tc_prompt_tokens_cached", "Prompt tokens not run again: a kept cache "
                                            "(head.prefix_cache) held them", registry=r)
        self.completion_tokens = Counter("tc_completion_tokens", "Tokens generated and sent to clients",
                                         registry=r)
        self.draft_tokens = Counter("tc_draft_tokens", "Tokens guessed ahead by greedy requests and checked in the "
                                    "same step (head.draft_tokens)", registry=r)
        self.draft_tokens_accepted = Counter("tc_draft_tokens_accepted", "Guessed tokens that were the tokens "
                                             "chosen, each a step saved", registry=r)
        self.time_to_first_token = Histogram("tc_time_to_first_token_seconds",
                                             "From the start of the prefill to the first token chosen",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("tc_queue_wait_seconds", "Time a generation waited for a place in the batch",
                                    buckets=WAIT_BUCKETS, registry=r)
        self.decode_step = Histogram("tc_decode_step_seconds", "One decode step of the whole batch at the head: "
                                     "pipeline and sampling", buckets=STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("tc_batch_size", "Sequences in one pipeline step", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.stage_compute = Histogram("tc_stage_compute_seconds", "A stage's compute time for one step, as the "
                                       "worker reports it", ["node", "phase"], buckets=STEP_BUCKETS, registry=r)
        self.hop_network = Histogram("tc_hop_network_seconds", "Round trip to a worker minus its compute time, "
                                     "for one step (with direct hops, an even share of the step's network time)",
                                     ["node", "phase"], buckets=NETWORK_BUCKETS, registry=r)
        self._series: dict[tuple[str, str], tuple] = {}  # (node, phase) -> observe_step's two histograms
        # the live gauges, from the start: nothing waiting or running until `watch` names what to read
        self._live = _LiveState(lambda: 0, lambda: 0, _NoNodes, lambda: 0, lambda: 0.0)
        r.register(self._live)

    def watch(self, waiting: Callable[[], int], running: Callable[[], int], readiness: Callable[[], NodeStates], *,
              slots: Callable[[], int], tokens_per_s: Callable[[], float]) -> None:
        """Report these at each scrape from now on, in place of what an earlier call named (the head's registry
        while it loads, then its service): requests waiting, running, the nodes ready and missing, the batch's
        slots and the recent aggregate token rate."""
        live = self._live
        live.waiting, live.running, live.readiness, live.slots, live.tokens_per_s = \
            waiting, running, readiness, slots, tokens_per_s

    def observe_request(self, method: str, route: str, status: int) -> None:
        # a method is any token a client sends ("FOO1", "FOO2", ...): each would be a series kept for good
        self.http_requests.labels(method if method in HTTP_METHODS else "other", route, str(status)).inc()

    def observe_step(self, phase: str, hops: Sequence[Hop]) -> None:
        """One pipeline step ("prefill" or "decode") with each hop's (node, compute s, round trip s)."""
        for node, compute_s, round_trip_s in hops:
            stage, hop = self._step_series(node, phase)
            stage.observe(compute_s)
            hop.observe(max(round_trip_s - compute_s, 0.0))

    def _step_series(self, node: str, phase: str) -> tuple:
        """The (stage compute, hop network) histograms of `node` in `phase`, looked up by label once: this runs
        after every step, and prometheus_client's label lookup costs more than the observations."""
        series = self._series.get((node, phase))
        if series is None:
            series = self._series[(node, phase)] = (self.stage_compute.labels(node, phase),
                                                    self.hop_network.labels(node, phase))
        return series

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
