"""Every agent's HTTP face: /healthz, /readyz, /status (JSON) and /metrics (Prometheus).

The server runs in a daemon thread and only reads :class:`AgentStatus`, which the agent's own
thread updates; a lifecycle is a :class:`Phase` (Loading -> Ready -> Draining, or Failed).
"""

from __future__ import annotations

import enum
import json
import threading
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Phase(enum.StrEnum):
    LOADING = "Loading"
    READY = "Ready"
    DRAINING = "Draining"
    FAILED = "Failed"


@dataclass
class AgentStatus:
    group_index: int
    stage_index: int
    layer_start: int
    layer_end: int
    role: str  # head | middle | tail | head+tail
    phase: Phase = Phase.LOADING
    layers_loaded: int = 0
    layers_total: int = 0
    slots_in_use: int = 0
    kv_bytes: int = 0
    weights_bytes: int = 0
    bytes_by_role: dict[str, dict[str, int]] = field(default_factory=dict)  # {role: {format: bytes}}
    backend: dict[str, Any] = field(default_factory=dict)  # what executes the stage (engine.backend.backend_info)
    tensor_rank: int = 0  # this process's rank in its stage's tensor group, of tensor_size
    tensor_size: int = 1
    reason: str = ""
    peers: dict[str, str] = field(default_factory=dict)
    head: dict[str, Any] = field(default_factory=dict)  # head only: chain readiness, streams, queue

    @property
    def ready(self) -> bool:
        if self.phase != Phase.READY:
            return False
        return bool(self.head.get("chain_ready", True))

    def to_json(self) -> str:
        data = asdict(self)
        data["phase"] = str(self.phase)
        data["ready"] = self.ready
        return json.dumps(data)


class StageMetrics:
    """Per-stage counters under ``modelfleet_stage_*``, labelled by group and stage."""

    def __init__(self, group_index: int, stage_index: int):
        self.registry = CollectorRegistry()
        labels = {"group": str(group_index), "stage": str(stage_index)}
        names = ["group", "stage"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"modelfleet_stage_{name}", doc, names, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"modelfleet_stage_{name}", doc, names, registry=self.registry)

        self.frames = counter("frames_total", "Frames computed.").labels(**labels)
        self.rows = counter("rows_total", "Frame rows computed.").labels(**labels)
        self.compute_seconds = counter("compute_seconds_total", "Seconds spent computing frames.").labels(**labels)
        self.queue_wait_seconds = counter(
            "queue_wait_seconds_total", "Seconds frames waited between arrival and compute."
        ).labels(**labels)
        self.idle_seconds = counter("idle_seconds_total", "Seconds the stage waited with no work.").labels(**labels)
        self.malformed = counter("malformed_messages_total", "Messages dropped as malformed.").labels(**labels)
        self.errors = counter("frame_errors_total", "Frames refused by the engine (capacity, input).").labels(**labels)
        self.active_slots = gauge("active_slots", "KV slots in use.").labels(**labels)
        self.layers_loaded = gauge("layers_loaded", "Layers loaded so far.").labels(**labels)
        self.streams_active = gauge("streams_active", "Streams admitted (head).").labels(**labels)
        self.queue_depth = gauge("queue_depth", "Requests waiting for a slot (head).").labels(**labels)
        self.chain_ready = gauge(
            "chain_ready", "1 while every stage beats and chain probes answer in time (head)."
        ).labels(**labels)
        link_names = [*names, "link", "direction"]
        self._bytes = Counter("modelfleet_stage_bytes_total", "Bytes per link.", link_names, registry=self.registry)
        self._labels = labels
        # speculative decoding at the head (engine.speculative): what was proposed, what survived
        spec_names = [*names, "method"]
        self.drafted = Counter("modelfleet_speculative_drafted_tokens_total", "Proposed tokens verified (head).",
                               spec_names, registry=self.registry)  # fmt: skip
        self.accepted = Counter("modelfleet_speculative_accepted_tokens_total", "Proposed tokens accepted (head).",
                                spec_names, registry=self.registry)  # fmt: skip
        self.fallback_trips = Counter(
            "modelfleet_speculative_fallback_trips_total",
            "Times a stream's acceptance fell under tau and drafting paused (head).", names, registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self.verify_width = Histogram(
            "modelfleet_speculative_verify_width", "Proposals per decode row, as chosen each step (head).", names,
            buckets=tuple(range(0, 17)), registry=self.registry,
        ).labels(**labels)  # fmt: skip

    def speculation(self, method: str, drafted: int, accepted: int) -> None:
        self.drafted.labels(**self._labels, method=method).inc(drafted)
        self.accepted.labels(**self._labels, method=method).inc(accepted)

    def bytes(self, link: str, direction: str, count: int) -> None:
        self._bytes.labels(**self._labels, link=link, direction=direction).inc(count)


def serve_http(host: str, port: int, status: AgentStatus, metrics: StageMetrics) -> ThreadingHTTPServer:
    """Start the health server in a daemon thread and return it (``shutdown()`` to stop)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server hook's name
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._send(200, "text/plain", b"ok\n")
            elif path == "/readyz":
                ok = status.ready
                self._send(200 if ok else 503, "text/plain", b"ready\n" if ok else b"not ready\n")
            elif path == "/status":
                self._send(200, "application/json", status.to_json().encode())
            elif path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(metrics.registry))
            else:
                self._send(404, "text/plain", b"not found: try /healthz, /readyz, /status, /metrics\n")

        def _send(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: probes arrive every second
            return

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="health-http", daemon=True).start()
    return server
