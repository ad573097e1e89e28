"""Tell a standing queue from a burst, and shorten the queue wait allowed while one stands.

CoDel's signal (Nichols and Jacobson, "Controlling Queue Delay", 2012), used the way
Facebook's servers use it to pick a queue timeout ("Fail at scale", 2015). A burst fills a
queue for a moment; overload keeps one standing. The shortest wait among the requests
taken from the queue during an interval tells them apart: when even that one waited more
than ``target``, the queue never emptied during the interval.

While the queue stands, the wait allowed drops from the configured limit
(``limits.max_queue_wait_s``) to ``short``: the requests admitted keep a latency close to
their service time, the others get 503 + Retry-After early instead of after the whole
limit, and throughput stays at capacity because a queue of ``short`` seconds still never
runs dry. A burst that meets an empty queue gets the whole limit. The HTTP server
(appliance/transport/http/server.py) feeds it from its worker threads and asks it at the door.

Thread-safety: ``observe`` runs on any worker thread and ``allowed`` on the loop thread,
without a lock: every field is one reference, replaced whole, and a lost update at worst
delays a switch by one interval.
"""

from __future__ import annotations

import math

# CoDel's interval is 100 ms; a quarter of the limit here (0.5 s for the default 2 s), so a
# burst that the workers drain within that time never counts as overload.
INTERVAL_FRACTION = 0.25
TARGET_FRACTION = 0.05  # of the limit: the least wait that counts as a standing queue
SHORT_FRACTION = 0.1  # of the limit: the wait allowed while the queue stands
FORGET_INTERVALS = 4  # nothing left the queue for this long: no evidence of a standing queue any more


class QueueDelay:
    def __init__(self, limit: float):
        self.limit = limit
        self.target = limit * TARGET_FRACTION
        self.short = limit * SHORT_FRACTION
        self.interval = limit * INTERVAL_FRACTION
        self._window_start = -math.inf
        self._window_min = math.inf
        self._last = -math.inf
        self.standing = False

    def observe(self, waited: float, now: float) -> None:
        """A request left the queue after waiting ``waited`` seconds (``now``: monotonic)."""
        self._last = now
        if waited < self._window_min:
            self._window_min = waited
        if now - self._window_start >= self.interval:
            self.standing = self._window_min > self.target
            self._window_start, self._window_min = now, math.inf

    def allowed(self, now: float) -> float:
        """The queue wait allowed for a request now (``limit``, or ``short`` while the queue stands)."""
        if self.standing and now - self._last < FORGET_INTERVALS * self.interval:
            return self.short
        return self.limit
