"""The gateway's link to one head (a pipeline group's stage 0): one asyncio DEALER for every
request sent to that head, and its readiness. The gateway holds one link per head it serves.

Requests are told apart by request id (the same protocol as :class:`FleetClient`): a reader task
routes each ``OutputMsg`` to its request's :class:`Inbox`, taking every message already waiting
on the socket in one turn (one awaited receive per burst, not per message). Every
``wake_seconds`` the link wakes each inbox's waiting reader, so a reader can look at the clock
(is its client still there?) without a timer of its own for every wait. A cancel is sent without waiting, so it can be
sent from a ``finally`` of a task that is being cancelled (a client that went away).
Readiness is the head's own: its HTTP ``/status`` (the plan's ``http_port``) is polled every ``poll_seconds``.
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

log = logging.getLogger("modelfleet.gateway")


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
        self.head_status: dict[str, Any] | None = None
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

    def silent_for(self) -> float:
        """Seconds the head has not reported ready (0 while it does)."""
        return 0.0 if self.unready_since is None else time.monotonic() - self.unready_since

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
            status = await asyncio.to_thread(fetch_json, self.status_url, max(0.2, self.poll_seconds))
            self.head_status = status
            self.ready = bool(status and status.get("ready"))
            if self.ready:
                self.unready_since = None
            elif self.unready_since is None:
                self.unready_since = time.monotonic()
            await asyncio.sleep(self.poll_seconds)


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("could not send to the head: %s", future.exception())
