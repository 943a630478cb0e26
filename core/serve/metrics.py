"""The server's Prometheus metrics (prometheus-client), one registry per server.

Gauges read the engine when scraped; the latencies are observed from the engine's events on
its own thread (prometheus-client is thread safe):

- ``lockstep_queue_depth``: requests waiting for a slot;
- ``lockstep_running_requests``: requests holding a slot; ``lockstep_slot_usage``: their share
  of the slots (0..1);
- ``lockstep_time_to_first_token_seconds``: arrival to the first token;
- ``lockstep_inter_token_latency_seconds``: between two tokens of a request;
- ``lockstep_request_latency_seconds``: arrival to the last event;
- ``lockstep_prompt_tokens_total``, ``lockstep_generation_tokens_total``: tokens in and out;
- ``lockstep_requests_total{finish_reason}``: finished requests; ``lockstep_rejected_total{reason}``:
  requests refused before queueing (full queue, bad input);
- weight streaming (``--weight-budget`` / ``--device-budget``), read from the engine's counters
  at every scrape: ``lockstep_htod_bytes_total`` (weight bytes copied host to device),
  ``lockstep_page_ins_total`` (copies into staging slots), ``lockstep_evictions_total`` (copies
  that overwrote another weight), ``lockstep_htod_bytes_per_token`` and
  ``lockstep_page_ins_per_token`` (decode copies per generated token), and the plan's
  ``lockstep_weight_bytes_streamed_per_step`` and ``lockstep_weight_bytes_resident`` (all 0
  or resident-only when nothing streams).
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from core.engine import Event, Request

#: engine counters exported as Prometheus counters (name, help)
STREAM_COUNTERS = (("htod_bytes", "Weight bytes copied host to device (streamed weights)"),
                   ("page_ins", "Weight copies into staging slots"),
                   ("evictions", "Weight copies that overwrote another weight in a staging slot"))
#: engine counters exported as gauges (name, help)
STREAM_GAUGES = (("htod_bytes_per_token", "Decode weight bytes copied per generated token"),
                 ("page_ins_per_token", "Decode weight copies per generated token"),
                 ("weight_bytes_streamed_per_step", "Weight bytes the residency plan streams per step"),
                 ("weight_bytes_resident", "Weight bytes resident on the device"))

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """The metrics of one server over one engine (module docstring)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("lockstep_queue_depth", "Requests waiting for a slot", registry=r)
        self.running = Gauge("lockstep_running_requests", "Requests holding a slot", registry=r)
        self.slot_usage = Gauge("lockstep_slot_usage", "Share of the KV slots in use (0..1)", registry=r)
        self.ttft = Histogram("lockstep_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("lockstep_inter_token_latency_seconds", "Time between two tokens of a request",
                             buckets=_LATENCY, registry=r)
        self.latency = Histogram("lockstep_request_latency_seconds", "Arrival to the last event",
                                 buckets=_LATENCY, registry=r)
        self.tokens_in = Counter("lockstep_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.tokens_out = Counter("lockstep_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("lockstep_requests", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("lockstep_rejected", "Requests refused before queueing", ["reason"], registry=r)

    def watch(self, engine) -> None:
        """Read the gauges and the streaming counters from ``engine`` at every scrape."""
        self.registry.register(StreamingCollector(engine))
        self.queue_depth.set_function(lambda: engine.waiting)
        self.running.set_function(lambda: engine.running)
        self.slot_usage.set_function(lambda: engine.running / engine.max_batch)

    def observe(self, request: Request, event: Event, last: float | None) -> float | None:
        """Account one event of ``request``; ``last`` is the time of its previous token (None
        before the first). Returns the time of its latest token (None before the first)."""
        now = time.perf_counter()
        if event.token_ids:
            self.tokens_out.inc(len(event.token_ids))
            if last is None:
                self.ttft.observe(now - request.arrived)
                self.tokens_in.inc(len(request.prompt_ids))
            else:
                self.itl.observe(now - last)
            last = now
        if event.finish_reason is not None:
            self.latency.observe(now - request.arrived)
            self.finished.labels(event.finish_reason).inc()
        return last


class StreamingCollector(Collector):
    """The weight-streaming counters of an engine (:data:`STREAM_COUNTERS`,
    :data:`STREAM_GAUGES`), read from ``engine.counters`` when scraped (plain reads of numbers
    the engine's thread updates)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        c = self.engine.counters
        for name, text in STREAM_COUNTERS:
            yield CounterMetricFamily(f"lockstep_{name}", text, value=float(getattr(c, name)))
        for name, text in STREAM_GAUGES:
            yield GaugeMetricFamily(f"lockstep_{name}", text, value=float(getattr(c, name)))
