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
    restarts: int = 0  # times `modelfleet up` restarted this process (agent.supervisor)
    peers: dict[str, str] = field(default_factory=dict)
    head: dict[str, Any] = field(default_factory=dict)  # head only: chain readiness, streams, queue
    numa: dict[str, Any] = field(default_factory=dict)  # this rank's binding and where its pages are (agent.numa)
    expert_placement: dict[str, Any] = field(default_factory=dict)  # engine.expert_store's placement report

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
        self.restarts = gauge("restarts", "Times this stage's process was restarted by its supervisor.").labels(
            **labels
        )
        self.streams_active = gauge("streams_active", "Streams admitted (head).").labels(**labels)
        self.queue_depth = gauge("queue_depth", "Requests waiting for a slot (head).").labels(**labels)
        self.chain_ready = gauge(
            "chain_ready", "1 while every stage beats and chain probes answer in time (head)."
        ).labels(**labels)
        # the expert store (engine.expert_store), when MoE layers keep experts in host banks
        self.expert_cache_hits = counter(
            "expert_cache_hits_total", "Routed experts found in device cache slots."
        ).labels(**labels)
        self.expert_cache_misses = counter(
            "expert_cache_misses_total", "Routed experts not in device cache slots."
        ).labels(**labels)
        self.expert_fetch_bytes = counter(
            "expert_fetch_bytes_total", "Expert bytes fetched from host banks into device slots."
        ).labels(**labels)
        self.expert_cpu_bytes = counter(
            "expert_cpu_bytes_total", "Expert bytes computed in place on the CPU from host banks."
        ).labels(**labels)
        self.expert_split_q = gauge("expert_split_q", "Share of expert-miss bytes fetched to the device.").labels(
            **labels
        )
        self.expert_prefetched = counter(
            "expert_prefetched_total", "Experts copied into device slots ahead of the step that would use them."
        ).labels(**labels)
        self.expert_prefetch_bytes = counter(
            "expert_prefetch_bytes_total", "Expert bytes copied into device slots ahead of the step."
        ).labels(**labels)
        self.expert_prefetch_hits = counter(
            "expert_prefetch_hits_total", "Prefetched experts that the layer's next step used."
        ).labels(**labels)
        self._expert_seen = dict.fromkeys(
            ("hits", "misses", "fetch_bytes", "cpu_bytes", "prefetched", "prefetch_bytes", "prefetch_hits"), 0
        )

        # replay after a lost stage (head): see agent.head
        def head_counter(name: str, doc: str) -> Counter:
            return Counter(f"modelfleet_head_{name}", doc, names, registry=self.registry)

        self.replays = head_counter("replays_total", "Times the pipeline healed and its streams were replayed.").labels(
            **labels
        )
        self.replayed_tokens = head_counter(
            "replayed_tokens_total", "Prompt and committed tokens prefilled again by replays."
        ).labels(**labels)
        self.paused_seconds = head_counter(
            "paused_seconds_total", "Seconds the pipeline was paused for a lost stage, until it healed."
        ).labels(**labels)
        self.waiting_for_replay = Gauge(
            "modelfleet_head_streams_waiting_for_replay", "Streams holding a slot while the pipeline is paused.",
            names, registry=self.registry,
        ).labels(**labels)  # fmt: skip
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

    def expert_store(self, report: dict[str, Any]) -> None:
        """Advance the expert-store counters to a placement report's cumulative totals."""
        counters = {"hits": self.expert_cache_hits, "misses": self.expert_cache_misses,
                    "fetch_bytes": self.expert_fetch_bytes, "cpu_bytes": self.expert_cpu_bytes,
                    "prefetched": self.expert_prefetched, "prefetch_bytes": self.expert_prefetch_bytes,
                    "prefetch_hits": self.expert_prefetch_hits}  # fmt: skip
        for key, counter in counters.items():
            total = int(report.get(key, 0))
            counter.inc(max(0, total - self._expert_seen[key]))
            self._expert_seen[key] = total
        if report.get("q") is not None:
            self.expert_split_q.set(float(report["q"]))

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
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                # the prober gave up first (a stage busy loading answers late): its loss, not ours,
                # and not worth a traceback in the stage's log
                return

        def log_message(self, format: str, *args: Any) -> None:  # quiet: probes arrive every second
            return

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="health-http", daemon=True).start()
    return server
