"""Follow TF Serving's ``--model_config_file`` while serving: with
``model_config_file_poll_wait_seconds`` > 0 the file is checked that often, and a change
asks the service for a reload (the one reload path, ``Service.request_reload``), which
re-reads it (appliance/core/tfs_files.py) and applies it without dropping requests.
"""

from __future__ import annotations

import logging
import os
import threading

from appliance.parts.host import Host

log = logging.getLogger("appliance.tfs")


def attach(service: Host) -> "ConfigFilePoller | None":
    """Reload the service when the model config file changes (poll_wait_seconds > 0)."""
    files = service.config.tfs
    if not files.model_config_file or files.model_config_file_poll_wait_seconds <= 0:
        return None
    poller = ConfigFilePoller(service, files.model_config_file, files.model_config_file_poll_wait_seconds)
    service.hooks.append(poller.on_hook)
    poller.start()
    return poller


class ConfigFilePoller(threading.Thread):
    def __init__(self, service: Host, path: str, every: float):
        super().__init__(name="tfs-config-poll", daemon=True)
        self.service, self.path, self.every = service, path, every
        self._stop = threading.Event()
        self._seen = self._stamp()

    def _stamp(self) -> tuple[float, int] | None:
        try:
            st = os.stat(self.path)
            return (st.st_mtime, st.st_size)
        except OSError:
            return None

    def run(self) -> None:
        while not self._stop.wait(self.every):
            stamp = self._stamp()
            if stamp != self._seen:
                self._seen = stamp
                log.info("%s changed: reloading", self.path)
                self.service.request_reload()

    def on_hook(self, what: str, service: Host) -> None:
        if what == "stopping":
            self._stop.set()
