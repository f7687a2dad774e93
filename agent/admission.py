"""The gateway's admission: streams spread over several heads (a plan's pipeline groups, and the
groups of further plans serving the same model), at most ``max_queue`` requests waiting (first
come, first served), each waiting at most ``queue_timeout_seconds``.

Each head ``h`` has a stream limit ``limits[h]`` and counts ``active_by_head[h]``. A request is
admitted to the ready head with the most free capacity: the least ``active / limit``, ties to the
lower index. Which heads are ready is asked of ``ready(h)`` at each decision. A request may
``avoid`` some heads (those that already failed it): it is admitted only to the others, and a
waiter that avoids every head with a free stream lets the next waiter have it.

A request that finds no head it may take ready while some of them are **healing** (alive, their
pipeline paused for a lost stage, see :mod:`.headlink`) waits for one, past
``queue_timeout_seconds`` and up to ``heal_timeout_seconds`` (the heads' replay deadline) after
it arrived: a pipeline that replays is a short outage, not a full fleet.

Invariant: ``active_by_head[h] <= limits[h]`` and ``len(waiting) <= max_queue``; a freed stream
goes straight to the oldest waiter that may take it (on whichever ready head it may take is then
least loaded), so a late arrival cannot overtake the queue. Waiters also look again every
CHECK_SECONDS, so a head that turns ready takes the queue without waiting for some stream to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

CHECK_SECONDS = 0.2


class Busy(Exception):
    """No stream is free and the queue is full, or the wait timed out; retry after a while."""

    def __init__(self, message: str, retry_after_seconds: int = 1, status: int = 429):
        super().__init__(message)
        self.retry_after_seconds, self.status = retry_after_seconds, status  # status: 503 when no head healed


class Abandoned(Exception):
    """The request's client went away while it waited in line."""


@dataclass(frozen=True)
class Waiter:
    turn: asyncio.Future[int]  # set to the head index once a stream is handed to it
    avoid: frozenset[int]


class Admission:
    def __init__(
        self,
        limits: Sequence[int],
        max_queue: int,
        queue_timeout_seconds: float,
        ready: Callable[[int], bool] = lambda head: True,
        healing: Callable[[int], bool] = lambda head: False,
        heal_timeout_seconds: float = 0.0,
    ):
        if not limits or min(limits) < 1:
            raise ValueError(f"every head needs a stream limit >= 1, got {list(limits)}")
        self.limits, self.max_queue, self.timeout, self.ready = list(limits), max_queue, queue_timeout_seconds, ready
        self.healing, self.heal_timeout = healing, max(heal_timeout_seconds, queue_timeout_seconds)
        self.active_by_head = [0] * len(self.limits)
        self.waiting: deque[Waiter] = deque()

    @property
    def active(self) -> int:
        return sum(self.active_by_head)

    @property
    def max_streams(self) -> int:
        return sum(self.limits)

    def best_head(self, avoid: frozenset[int] = frozenset()) -> int | None:
        """The ready head not in ``avoid`` with a free stream and the least active streams for its
        limit, if any."""
        free = [h for h, limit in enumerate(self.limits)
                if self.active_by_head[h] < limit and h not in avoid and self.ready(h)]  # fmt: skip
        return min(free, key=lambda h: (self.active_by_head[h] / self.limits[h], h), default=None)

    @contextlib.asynccontextmanager
    async def slot(
        self, gone: Callable[[], Awaitable[bool]] | None = None, avoid: frozenset[int] = frozenset(),
        waited_seconds: float = 0.0,
    ) -> AsyncIterator[int]:  # fmt: skip
        """A stream on some head (its index), released on the way out."""
        head = await self.acquire(gone, avoid, waited_seconds)
        try:
            yield head
        finally:
            self.release(head)

    async def acquire(
        self, gone: Callable[[], Awaitable[bool]] | None = None, avoid: frozenset[int] = frozenset(),
        waited_seconds: float = 0.0,
    ) -> int:  # fmt: skip
        """A stream on a head not in ``avoid``, at once or after waiting in line: the index of the
        head it is on. The wait ends ``queue_timeout_seconds`` after the request arrived, which
        was ``waited_seconds`` ago (a retried request keeps its first arrival). ``gone()`` is
        asked every CHECK_SECONDS while waiting, and a true answer (the client went away) gives
        up the place with Abandoned."""
        head = None if self.waiting else self.best_head(avoid)
        if head is not None:
            self.active_by_head[head] += 1
            return head
        if len(self.waiting) >= self.max_queue:
            raise Busy(
                f"all {self.max_streams} streams of {len(self.limits)} head(s) are busy or not ready and "
                f"{len(self.waiting)} requests are queued (max_queue={self.max_queue}); retry later"
            )
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[int] = loop.create_future()
        waiter = Waiter(turn, avoid)
        self.waiting.append(waiter)
        deadline = loop.time() + self.timeout - waited_seconds
        heal_deadline = loop.time() + self.heal_timeout - waited_seconds
        try:
            while not turn.done():
                if loop.time() >= deadline and not (loop.time() < heal_deadline and self.heals(avoid)):
                    raise self._timed_out(self.heals(avoid))
                await asyncio.wait([turn], timeout=CHECK_SECONDS)
                self._hand_out()  # a head may have turned ready
                if not turn.done() and gone is not None and await gone():
                    raise Abandoned()
            return turn.result()
        except BaseException:  # timed out, abandoned, or cancelled while waiting
            if turn.done() and not turn.cancelled():
                self.release(turn.result())  # the stream arrived as we gave up: pass it on
            else:
                turn.cancel()
                self.waiting.remove(waiter)
            raise

    def heals(self, avoid: frozenset[int] = frozenset()) -> bool:
        """No head outside ``avoid`` is ready and one of them is healing: worth waiting for."""
        heads = [h for h in range(len(self.limits)) if h not in avoid]
        return not any(self.ready(h) for h in heads) and any(self.healing(h) for h in heads)

    def _timed_out(self, healing: bool) -> Busy:
        if healing:
            return Busy(f"no pipeline healed within {self.heal_timeout:g} s (replay_timeout_seconds) while this "
                        "request waited; retry later", 1, status=503)  # fmt: skip
        return Busy(f"waited over {self.timeout:g} s for a free stream (queue_timeout_seconds); retry later",
                    max(1, round(self.timeout)))  # fmt: skip

    def release(self, head: int) -> None:
        self.active_by_head[head] -= 1
        self._hand_out()

    def _hand_out(self) -> None:
        """Free streams to the oldest waiters, each on the then least loaded ready head it may take
        (a waiter that avoids every free head keeps its place and is passed over)."""
        for waiter in list(self.waiting):
            if self.best_head() is None:
                return
            head = self.best_head(waiter.avoid)
            if head is None:
                continue
            self.waiting.remove(waiter)
            if not waiter.turn.done():
                self.active_by_head[head] += 1
                waiter.turn.set_result(head)
