"""A front worker process: the REST port's HTTP and JSON on a core of its own.

    python -m appliance.service.front_worker PORT INDEX CHANNEL_FD

Started only by appliance/service/fronts.py, which holds the port and passes its end of a
private channel; the worker listens on the port with SO_REUSEPORT beside the others. The first message on the channel is the service's config;
the worker then serves appliance/api/remote/front.py's ``FrontApp`` on
appliance/transport/http/server.py's server, with its share of the port's limits, until
the serving process says ``DRAIN`` (finish what is held, then exit 0) or goes away (EOF:
close everything, exit 1). Ctrl-C in a terminal reaches the whole process group: a worker
ignores SIGINT and SIGTERM and waits for the serving process's word, so the drain happens
in its order (the workers, then the models).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

from appliance.api.remote import messages as m
from appliance.api.remote.front import FrontApp, Link, RemoteCore, hot_mounts
from appliance.core import logs, memory
from appliance.core.config import Config
from appliance.service.fronts import worker_limits
from appliance.service.tls import tls_context
from appliance.transport.channel import BlockingChannel, Message
from appliance.transport.http.server import HTTPServer, listen

log = logging.getLogger("appliance.workers")

REPORT_EVERY_S = 1.0  # HTTP figures and memory to the serving process
CONFIG_WAIT_S = 60.0


class Worker:
    def __init__(self, index: int, port: int, channel: BlockingChannel):
        self.index, self.port = index, port
        self.link = Link(channel, self.on_push)
        self.config: Config | None = None
        self.core: RemoteCore | None = None
        self.server: HTTPServer | None = None
        self.have_config = threading.Event()
        self.done = threading.Event()
        self.exit_code = 0

    def on_push(self, message: Message) -> None:
        """(the link's reader thread) What the serving process says unasked."""
        kind, _, payload = message
        if kind == m.CONFIG:
            self.config = m.config_from_plain(payload)
            if self.core is not None:
                self.core.config = self.config
            self.have_config.set()
        elif kind == m.VIEW:
            view = m.view_from_plain(payload)
            if self.core is not None:
                self.core.manager.view = view
            else:
                self.first_view = view
        elif kind == m.DRAIN:
            threading.Thread(target=self.drain, args=(payload,), name="drain", daemon=True).start()
        elif kind == "eof":  # the serving process is gone: nothing here can be answered any more
            self.gone()

    def gone(self) -> None:
        """Stop: the serving process is gone (EOF, or this process was handed to init)."""
        self.exit_code = 1
        self.done.set()
        self.have_config.set()  # a start-up still waiting for its config gives up at once
        server = self.server
        if server is not None:
            threading.Thread(target=server.close, name="close", daemon=True).start()

    def drain(self, timeout: float) -> None:
        if self.server is not None:
            self.server.drain(timeout)
        self.done.set()

    def run(self) -> int:
        threading.Thread(target=self.link.serve, name="channel", daemon=True).start()
        if not self.have_config.wait(CONFIG_WAIT_S) or self.config is None or self.done.is_set():
            return 1
        config = self.config
        logs.setup(config.log_level)
        self.core = RemoteCore(config, self.link)
        view = getattr(self, "first_view", None)
        if view is not None:
            self.core.manager.view = view
        security = config.security
        context = tls_context(security) if security.tls_cert_file else None
        workers = config.server.workers or (os.cpu_count() or 1)
        listener = listen(config.server.host, self.port, reuse_port=True)
        self.server = HTTPServer(FrontApp(self.core, hot_mounts(self.core)), config.server.host, self.port,
                                 config.server.threads, config.server.max_body_bytes,
                                 worker_limits(config.limits, workers), context, sock=listener)
        if self.done.is_set():  # the serving process went away while this one started
            self.server.close()
            return 1
        self.send_stats()  # listening: the serving process counts this worker in
        threading.Thread(target=self.report, name="report", daemon=True).start()
        memory.tune_gc()
        self.server.serve_forever()
        return self.exit_code

    def report(self) -> None:
        """HTTP figures and memory every REPORT_EVERY_S (``/api/status`` ``workers``); and a
        check that the serving process is still this one's parent, should its EOF be missed."""
        assert self.server is not None
        parent = os.getppid()
        while not self.done.wait(REPORT_EVERY_S):
            if os.getppid() != parent:
                log.error("front worker %d: the serving process (pid %d) is gone; exiting", self.index, parent)
                self.gone()
                return
            self.send_stats()

    def send_stats(self) -> None:
        assert self.server is not None
        self.link.send(m.STATS, {"pid": os.getpid(), "rss_bytes": _rss(), "http": dict(self.server.stats),
                                 "served": self.server.tracker.served})


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    memory.limit_arenas()
    port, index, channel_fd = (int(a) for a in argv[-3:])
    channel = BlockingChannel(socket.socket(fileno=channel_fd))
    return Worker(index, port, channel).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
