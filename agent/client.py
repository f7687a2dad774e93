"""A client of a fleet's head: submit token-id prompts, receive tokens as they are sampled.

The gateway uses this protocol to reach the fleet; tests and benchmarks use this class directly.
One DEALER socket carries any number of concurrent requests, told apart by request id.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from ..engine.errors import ModelfleetError
from ..engine.sampling import SamplingParams
from ..plan import StagePlan, stage_at
from . import transport as wire


class FleetError(ModelfleetError):
    """The fleet refused or failed a request; the message says why."""


@dataclass
class Completion:
    request_id: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    code: str | None = None  # an ErrorCode value when finish_reason is "error"
    error: str = ""
    submitted_at: float = 0.0
    token_times: list[float] = field(default_factory=list)  # perf_counter time each token arrived
    first_token_at: float | None = None
    finished_at: float | None = None


class FleetClient:
    def __init__(self, head: StagePlan | str, keys: wire.KeyPair | None = None, timeout_seconds: float = 60.0):
        """head: the head stage of the plan, or its address host:port (clients connect to its client port)."""
        stage = stage_at(head) if isinstance(head, str) else head
        self.context: zmq.Context[Any] = zmq.Context.instance()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            wire.curve_client(self.socket, keys, keys.public)
        self.socket.connect(f"tcp://{stage.host}:{stage.client_port}")
        self.timeout = timeout_seconds
        self.ids = itertools.count(int(time.time() * 1000) % (1 << 40))
        self.results: dict[int, Completion] = {}

    def close(self) -> None:
        self.socket.close(linger=0)

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        request_id = next(self.ids)
        self.results[request_id] = Completion(request_id, submitted_at=time.perf_counter())
        self.socket.send_multipart(wire.encode(wire.SubmitMsg.of(request_id, prompt_ids, params)))
        return request_id

    def cancel(self, request_id: int) -> None:
        self.socket.send_multipart(wire.encode(wire.CancelMsg(request_id=request_id)))

    def poll(self, timeout_seconds: float) -> list[wire.OutputMsg]:
        """Output messages that arrive within the timeout (at least one, or none on timeout)."""
        out: list[wire.OutputMsg] = []
        if not self.socket.poll(int(timeout_seconds * 1000)):
            return out
        while True:
            try:
                msg = wire.decode(self.socket.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return out
            if isinstance(msg, wire.OutputMsg):
                self._record(msg)
                out.append(msg)

    def _record(self, msg: wire.OutputMsg) -> None:
        result = self.results.setdefault(msg.request_id, Completion(msg.request_id))
        now = time.perf_counter()
        if msg.token_ids and result.first_token_at is None:
            result.first_token_at = now
        result.token_ids += msg.token_ids
        result.token_times += [now] * len(msg.token_ids)
        if msg.finish_reason is not None:
            result.finish_reason, result.code, result.error = msg.finish_reason, msg.code, msg.error
            result.finished_at = now

    def wait(self, request_ids: Sequence[int]) -> list[Completion]:
        """Block until every request has finished (or the client timeout passes)."""
        deadline = time.monotonic() + self.timeout
        while any(self.results[r].finish_reason is None for r in request_ids):
            if time.monotonic() > deadline:
                raise FleetError(f"no answer from the fleet within {self.timeout:.0f} s")
            self.poll(0.1)
        return [self.results[r] for r in request_ids]

    def stream(self, request_id: int) -> Iterator[int]:
        """Tokens of one request as they arrive; raises FleetError if it ends in error."""
        seen = 0
        deadline = time.monotonic() + self.timeout
        while True:
            result = self.results[request_id]
            while seen < len(result.token_ids):
                yield result.token_ids[seen]
                seen += 1
            if result.finish_reason is not None:
                if result.finish_reason == "error":
                    raise FleetError(result.error)
                return
            if time.monotonic() > deadline:
                raise FleetError(f"no answer from the fleet within {self.timeout:.0f} s")
            self.poll(0.1)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        return self.wait([self.submit(prompt_ids, params)])[0]
