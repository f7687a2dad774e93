"""The gateway's link to one head (a pipeline group's stage 0): one asyncio DEALER for every
request sent to that head, and its readiness. The gateway holds one link per head it serves.

Requests are told apart by request id (the same protocol as :class:`FleetClient`): a reader task
routes each ``OutputMsg`` to its request's :class:`Inbox`, taking every message already waiting
on the socket in one turn (one awaited receive per burst, not per message). Every
``wake_seconds`` the link wakes each inbox's waiting reader, so a reader can look at the clock
(is its client still there?) without a timer of its own for every wait. A cancel is sent without waiting, so it can be
sent from a ``finally`` of a task that is being cancelled (a client that went away).
Readiness is the head's own: its HTTP ``/status`` (the plan's ``http_port``) is polled every ``poll_seconds``.

A head that answers "not ready" is alive: its pipeline may be paused for a lost stage (it replays
once healed) or still loading; a head that does not answer may be gone, or only starved. The
``/status`` answers are the head's heartbeats and their deadlines are measured, as the head's for
its stages (:mod:`.liveness`): a poll waits ``STATUS_TIMEOUT_FACTOR`` times the slowest recent
answer, and the head is **gone** once no answer came for 5 s, or 3 times the longest recent gap
between answers when the machine answers that late (at most 30 s). Until then an unready head is
**healing**: requests wait for it rather than fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from ..engine.sampling import SamplingParams
from ..plan import StagePlan, stage_at
from . import transport as wire
from .launcher import fetch_json
from .liveness import LivenessPolicy, heartbeat_deadline_seconds

log = logging.getLogger("modelfleet.gateway")
STATUS_LIVENESS = LivenessPolicy(heartbeat_seconds=5.0, heartbeat_factor=3.0, heartbeat_cap_seconds=30.0)
STATUS_TIMEOUT_FACTOR = 4.0  # x the slowest recent /status answer ...
STATUS_TIMEOUT_CAP_SECONDS = 10.0  # ... at most, and at least the poll interval (never under 0.2 s)
ANSWERS_KEPT = 32  # recent answers the deadlines are measured from


class Inbox:
    """One request's outputs in arrival order, read by one task."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque[wire.OutputMsg] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, msg: wire.OutputMsg) -> None:
        self.items.append(msg)
        self.wake()

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self) -> bool:
        """Until an output is waiting or :meth:`wake` is called; True when woken with none waiting."""
        if self.items:
            return False
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
        return not self.items


class HeadLink:
    def __init__(self, head: StagePlan | str, keys: wire.KeyPair | None = None, poll_seconds: float = 0.5,
                 wake_seconds: float = 0.2):  # fmt: skip
        """head: the head stage of the plan, or its address host:port."""
        stage = stage_at(head) if isinstance(head, str) else head
        self.address = stage.address
        self.endpoint = f"tcp://{stage.host}:{stage.client_port}"
        self.status_url = f"http://{stage.host}:{stage.http_port}/status"
        self.keys, self.poll_seconds, self.wake_seconds = keys, poll_seconds, wake_seconds
        self.ids = itertools.count(int(time.time() * 1000) % (1 << 40))
        self.queues: dict[int, Inbox] = {}
        self.ready = False
        self.unready_since: float | None = time.monotonic()
        self.head_status: dict[str, Any] | None = None  # the last answer (kept while polls go unanswered)
        self.answered_at: float | None = None  # monotonic, of the last answer
        self.answer_gaps: deque[float] = deque(maxlen=ANSWERS_KEPT)  # between answers
        self.answer_seconds: deque[float] = deque(maxlen=ANSWERS_KEPT)  # how long each answer took
        self.unanswered = 0  # polls in a row that got no answer
        self.context: zmq.asyncio.Context | None = None
        self.socket: Any = None
        self.waiting: Any = None  # the socket's synchronous shadow: takes what is already waiting
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        wire.limit_message_bytes(self.socket)
        if self.keys is not None:
            wire.curve_client(self.socket, self.keys, self.keys.public)
        self.socket.connect(self.endpoint)
        self.waiting = zmq.Socket.shadow(self.socket.underlying)
        self.tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._poll_ready()),
                      asyncio.create_task(self._wake_readers())]  # fmt: skip

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.socket is not None:
            self.socket.close(linger=0)
        if self.context is not None:
            self.context.term()

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, continued: int = 0) -> tuple[int, Inbox]:
        """``continued``: the last prompt ids are the stream's output so far (see ``SubmitMsg``)."""
        request_id = next(self.ids)
        inbox = self.queues[request_id] = Inbox()
        self._send(wire.SubmitMsg.of(request_id, prompt_ids, params, continued))
        return request_id, inbox

    def cancel(self, request_id: int) -> None:
        """Ask the head to finish the request and free its slot on every stage; returns at once."""
        if self.queues.pop(request_id, None) is not None:
            self._send(wire.CancelMsg(request_id=request_id))

    def forget(self, request_id: int) -> None:
        """The request finished at the head; stop routing its outputs."""
        self.queues.pop(request_id, None)

    @property
    def paused(self) -> bool:
        """The head answers but waits for a lost stage to come back (its streams wait for replay)."""
        return bool(self.head_status and (self.head_status.get("head") or {}).get("paused"))

    @property
    def replay_timeout_seconds(self) -> float | None:
        """How long the head's paused pipeline may take to heal before its streams fail (its own figure)."""
        value = ((self.head_status or {}).get("head") or {}).get("replay_timeout_seconds")
        return float(value) if isinstance(value, int | float) else None

    def silent_for(self) -> float:
        """Seconds the head has not reported ready (0 while it does)."""
        return 0.0 if self.unready_since is None else time.monotonic() - self.unready_since

    def silence_deadline(self) -> float:
        """Seconds without an answer after which the head is gone (measured; see the module)."""
        return heartbeat_deadline_seconds(STATUS_LIVENESS, self.answer_gaps)

    @property
    def gone(self) -> bool:
        """No /status answer within its deadline (or none yet): the head may not exist."""
        return self.answered_at is None or time.monotonic() - self.answered_at > self.silence_deadline()

    @property
    def answering(self) -> bool:
        """The last poll was answered (a late one may be a starved head, not a gone one)."""
        return self.answered_at is not None and self.unanswered == 0

    @property
    def healing(self) -> bool:
        """Not ready, but alive: paused for a lost stage, loading, or answering late."""
        return not self.ready and not self.gone

    def poll_timeout(self) -> float:
        slowest = STATUS_TIMEOUT_FACTOR * max(self.answer_seconds, default=0.0)
        return min(STATUS_TIMEOUT_CAP_SECONDS, max(0.2, self.poll_seconds, slowest))

    def _send(self, msg: wire.Message) -> None:
        sent = self.socket.send_multipart(wire.encode(msg))
        sent.add_done_callback(_log_failure)

    async def _read(self) -> None:
        while True:
            self._route(await self.socket.recv_multipart())
            while True:
                try:
                    parts = self.waiting.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._route(parts)

    def _route(self, parts: list[bytes]) -> None:
        try:
            msg = wire.decode(parts)
        except wire.MalformedMessage as exc:
            log.warning("dropped a malformed message from the head: %s", exc.reason)
            return
        if isinstance(msg, wire.OutputMsg) and (inbox := self.queues.get(msg.request_id)) is not None:
            inbox.put(msg)

    async def _wake_readers(self) -> None:
        while True:
            await asyncio.sleep(self.wake_seconds)
            for inbox in list(self.queues.values()):
                inbox.wake()

    async def _poll_ready(self) -> None:
        while True:
            asked = time.monotonic()
            status = await asyncio.to_thread(fetch_json, self.status_url, self.poll_timeout())
            self._answered(status, asked, time.monotonic())
            await asyncio.sleep(self.poll_seconds)

    def _answered(self, status: dict[str, Any] | None, asked: float, now: float) -> None:
        """A poll's outcome: ``status`` (None: no answer within the poll's timeout)."""
        if status is None:
            self.unanswered += 1
        else:
            self.unanswered = 0
            self.answer_seconds.append(now - asked)
            if self.answered_at is not None and now - self.answered_at <= self.silence_deadline():
                self.answer_gaps.append(now - self.answered_at)  # (a gone head's return measures nothing)
            self.answered_at, self.head_status = now, status
        self.ready = bool(status and status.get("ready"))
        if self.ready:
            self.unready_since = None
        elif self.unready_since is None:
            self.unready_since = now


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("could not send to the head: %s", future.exception())
