"""The gateway's admission: at most ``max_streams`` requests streaming, at most ``max_queue``
waiting (first come, first served), each waiting at most ``queue_timeout_seconds``.

Invariant: ``active <= max_streams`` and ``len(waiting) <= max_queue``; a slot is handed from a
finishing request straight to the oldest waiter, so a late arrival cannot overtake the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator


class Busy(Exception):
    """No stream is free and the queue is full, or the wait timed out; retry after a while."""

    def __init__(self, message: str, retry_after_seconds: int = 1):
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class Admission:
    def __init__(self, max_streams: int, max_queue: int, queue_timeout_seconds: float):
        self.max_streams, self.max_queue, self.timeout = max_streams, max_queue, queue_timeout_seconds
        self.active = 0
        self.waiting: deque[asyncio.Future[None]] = deque()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    async def acquire(self) -> None:
        if self.active < self.max_streams and not self.waiting:
            self.active += 1
            return
        if len(self.waiting) >= self.max_queue:
            raise Busy(
                f"all {self.max_streams} streams are busy and {len(self.waiting)} requests are queued "
                f"(max_queue={self.max_queue}); retry later"
            )
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.timeout)
        except BaseException as exc:  # a timeout, or the client went away while waiting
            if turn.done() and not turn.cancelled():
                self.release()  # the slot arrived as we gave up: pass it on
            else:
                turn.cancel()
                self.waiting.remove(turn)
            if isinstance(exc, TimeoutError):
                raise Busy(
                    f"waited over {self.timeout:g} s for a free stream (queue_timeout_seconds); retry later",
                    max(1, round(self.timeout)),
                ) from None
            raise

    def release(self) -> None:
        while self.waiting:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes to the waiter; active is unchanged
                return
        self.active -= 1
