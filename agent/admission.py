"""The gateway's admission: at most ``max_streams`` requests streaming, at most ``max_queue``
waiting (first come, first served), each waiting at most ``queue_timeout_seconds``.

Invariant: ``active <= max_streams`` and ``len(waiting) <= max_queue``; a slot is handed from a
finishing request straight to the oldest waiter, so a late arrival cannot overtake the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

CHECK_SECONDS = 0.2


class Busy(Exception):
    """No stream is free and the queue is full, or the wait timed out; retry after a while."""

    def __init__(self, message: str, retry_after_seconds: int = 1):
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class Abandoned(Exception):
    """The request's client went away while it waited in line."""


class Admission:
    def __init__(self, max_streams: int, max_queue: int, queue_timeout_seconds: float):
        self.max_streams, self.max_queue, self.timeout = max_streams, max_queue, queue_timeout_seconds
        self.active = 0
        self.waiting: deque[asyncio.Future[None]] = deque()

    @contextlib.asynccontextmanager
    async def slot(self, gone: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[None]:
        await self.acquire(gone)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, gone: Callable[[], Awaitable[bool]] | None = None) -> None:
        """A stream, at once or after waiting in line; ``gone()`` is asked every CHECK_SECONDS while
        waiting, and a true answer (the client went away) gives up the place with Abandoned."""
        if self.active < self.max_streams and not self.waiting:
            self.active += 1
            return
        if len(self.waiting) >= self.max_queue:
            raise Busy(
                f"all {self.max_streams} streams are busy and {len(self.waiting)} requests are queued "
                f"(max_queue={self.max_queue}); retry later"
            )
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        self.waiting.append(turn)
        deadline = loop.time() + self.timeout
        try:
            while not turn.done():
                if loop.time() >= deadline:
                    raise Busy(
                        f"waited over {self.timeout:g} s for a free stream (queue_timeout_seconds); retry later",
                        max(1, round(self.timeout)),
                    )
                await asyncio.wait([turn], timeout=min(CHECK_SECONDS, deadline - loop.time()))
                if not turn.done() and gone is not None and await gone():
                    raise Abandoned()
        except BaseException:  # timed out, abandoned, or cancelled while waiting
            if turn.done() and not turn.cancelled():
                self.release()  # the stream arrived as we gave up: pass it on
            else:
                turn.cancel()
                self.waiting.remove(turn)
            raise

    def release(self) -> None:
        while self.waiting:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes to the waiter; active is unchanged
                return
        self.active -= 1
