"""``appliance fleet --serve``: the fleet page (ui/fleet/) on the operator's machine, fed by a
thread that reads the bucket every ``--refresh`` seconds (only the reports written since the
last read: sync/listing.py). The page is read-only and the bucket's credentials never leave
this process; by default it listens on loopback only."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from appliance.commands.common import source as bucket
from sync.source import Source

if TYPE_CHECKING:  # the listing (and its crypto) is imported when the page starts
    from sync.listing import ReportCache


class Snapshots:
    """The last snapshot, encoded once per refresh, handed to the page's threads.

    Thread-safety: ``refresh`` runs on one thread; ``fleet``/``device`` on any."""

    def __init__(self, source: Source, cache: ReportCache, workers: int):
        self.source, self.cache, self.workers = source, cache, workers
        self._lock = threading.Lock()
        self._fleet = b"{}"
        self._rows: dict[str, dict[str, Any]] = {}
        self._reports: dict[str, Any] = {}
        self._view: dict[str, Any] = {}

    def refresh(self) -> None:
        from sync.errors import SyncError
        from sync.fleet import dumps, snapshot, without_reports

        try:
            view = snapshot(self.source, self.cache, self.workers)
        except SyncError as exc:  # the bucket away: the page keeps the last view and says why
            if not self._view:
                raise  # nothing to show yet: the command fails with the reason
            with self._lock:
                stale = {**self._view, "refresh_error": f"{exc} (showing the view of "
                                                       f"{time.strftime('%H:%M:%S', time.localtime(self._view.get('generated_at', 0)))})"}
                self._fleet = dumps(stale)
            return
        encoded = dumps(without_reports(view))
        with self._lock:
            self._view = without_reports(view)
            self._fleet = encoded
            self._rows = {r["device_id"]: r for r in view["devices"]}
            self._reports = view["reports"]

    def fleet(self) -> bytes:
        with self._lock:
            return self._fleet

    def device(self, device_id: str) -> bytes | None:
        with self._lock:
            row = self._rows.get(device_id)
            report = self._reports.get(device_id)
        return None if row is None else json.dumps({"row": row, "report": report}, default=str).encode()


def serve(args: argparse.Namespace) -> int:
    from sync.listing import cache_for
    from ui.fleet import FleetPage, FleetView

    snapshots = Snapshots(bucket(args), cache_for(args.bucket, not args.no_cache), args.workers)
    snapshots.refresh()
    page = FleetPage(FleetView(snapshots.fleet, snapshots.device), args.host, args.port).start()
    print(f"fleet page: {page.url}/ (read-only; Ctrl-C stops it)", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(max(1.0, args.refresh)):
            snapshots.refresh()
            snapshots.cache.save()
    except KeyboardInterrupt:
        pass
    finally:
        page.close()
    print("fleet page stopped", file=sys.stderr)
    return 0
