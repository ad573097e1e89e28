"""The worker threads that run the WSGI app, fed from the event loop in arrival order.

One queue, oldest first, so the loop can ask how long its head has waited (the signal the
door sheds on: appliance/transport/http/server.py) without touching another library's
internals. A job is a callable taking the time it was queued (monotonic).

Thread-safety: ``submit`` and ``oldest_wait`` from any thread (the loop), ``start`` and
``stop`` from the owner; the jobs run on the pool's threads.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("appliance.http")

Job = Callable[[float], None]


class WorkerPool:
    def __init__(self, threads: int, name: str = "http-worker"):
        self.threads = max(1, threads)
        self.name = name
        self._queue: collections.deque[tuple[float, Job]] = collections.deque()
        self._cond = threading.Condition()
        self._workers: list[threading.Thread] = []
        self._stopping = False

    def start(self) -> None:
        """Start the threads; idempotent."""
        with self._cond:
            if self._workers:
                return
            self._stopping = False
            self._workers = [threading.Thread(target=self._run, name=f"{self.name}-{i}", daemon=True)
                             for i in range(self.threads)]
        for t in self._workers:
            t.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            self._queue.append((time.monotonic(), job))
            self._cond.notify()

    def queued(self) -> int:
        return len(self._queue)

    def oldest_wait(self) -> float:
        """How long the job at the head of the queue has waited; 0 when it is empty."""
        try:
            return time.monotonic() - self._queue[0][0]
        except IndexError:
            return 0.0

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:  # stopping and nothing left
                    return
                queued_at, job = self._queue.popleft()
            try:
                job(queued_at)
            except Exception:  # a job renders its own errors; this is a bug, never a lost worker
                log.exception("HTTP worker job failed")
            # Drop the finished job now: it holds its request (body included) until the next
            # one arrives otherwise, and 32 idle threads then keep 32 bodies alive.
            del job

    def stop(self, timeout: float = 5.0) -> None:
        """Let queued jobs finish, then end the threads (bounded by ``timeout``); idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))
        self._workers = [t for t in self._workers if t.is_alive()]
