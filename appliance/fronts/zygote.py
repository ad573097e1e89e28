"""Front workers forked from a parent that imported their code once: the zygote.

A worker started as a fresh interpreter (``python -m appliance.fronts.worker``) imports numpy,
uvloop, the JSON and HTTP libraries and the API families itself: 30 MB of private memory each
(bench/RESULTS.md, "Lean workers"). Forked from a process that imported them already, it shares
those pages with it until it writes to them; ``gc.freeze()`` before the fork keeps the garbage
collector from writing to every inherited object. So the serving process forks one **zygote**
early in its start-up (``Zygote.start``, called by the serve commands right after the config is
read): before any thread starts (forking a multi-threaded process can copy a lock held by a
thread that does not exist in the child) and before any backend library or the serving app
(Flask) is imported. The zygote imports the worker's request path (``PRELOAD``, and gRPC's when
the workers will serve the gRPC port), freezes the collector and waits; each worker is forked
from it, so its pages are shared three ways: the serving process, the zygote and every worker.

The conversation, on a ``SOCK_SEQPACKET`` socketpair (one message per datagram, descriptors
passed with ``SCM_RIGHTS``), in plain ASCII:

- serving -> zygote: ``spawn INDEX PORT GRPC_PORT`` with the worker's channel end, its REST
  listener and, when the workers serve gRPC, its gRPC listener attached (the serving process
  keeps the listeners: appliance/fronts/pool.py);
  ``kill PID`` (SIGKILL, sent by the zygote: only a parent can name a pid safely, since a pid
  the parent has reaped may be reused at once; used only where there are no pidfds).
- zygote -> serving: ``ready`` once its imports are done (a fresh interpreter's only: a forked
  one is ready from the start); ``started INDEX PID`` with a pidfd on the worker attached where the kernel
  has them (appliance/fronts/pids.py), or ``failed INDEX ERRNO``; ``exited PID CODE`` when a
  worker ends (CODE as ``Popen.returncode``: negative for a signal).

The zygote ignores SIGINT and SIGTERM (as a worker does: the serving process drains in its own
order) and exits when its control socket reads EOF (the serving process is gone or closed it);
its workers see their own channel's EOF and exit too. A worker's handle (``Forked``) has the part
of ``subprocess.Popen``'s face the supervisor uses (``pid``, ``poll``, ``wait``, ``kill``), so the
supervisor starts workers the same way whether a zygote forks them or, where none could be made
(threads already running, no ``fork``), a fresh interpreter does (``popen_worker``).

**The zygote is no single point of failure** (issue 47): should it die (kill -9, the OOM
killer), its workers serve on. Each watches the serving process itself (a pidfd on it), not its
parent; the serving process holds a pidfd on each worker, so it still kills them by pidfd and
sees them end, and it is their subreaper (appliance/fronts/pids.py ``become_subreaper``: the kernel hands it the dead
zygote's children, so it reaps them and reads how they ended). ``keeper.Keeper`` starts a new zygote
at once (a fresh interpreter, ``python -m appliance.fronts.zygote FD``: the serving process
runs threads by then, and forking it is not safe), after a pause that doubles while zygotes die
young (appliance/fronts/keeper.py); workers started later are forked by the new one. Where there are no pidfds (Linux
before 5.3), a zygote's workers still follow it, as before.

Thread-safety: ``spawn`` and ``kill`` from any thread (one spawn at a time); replies are read
by one thread of the serving process; ``Keeper.launch`` from the supervisor's threads.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Protocol

from appliance.core.cgroup import WORKER_OOM_SCORE, raise_oom_score
from appliance.fronts.pids import PidFd, become_subreaper, open_pidfd

if TYPE_CHECKING:
    from appliance.core.config import Config

log = logging.getLogger("appliance.workers")

# What a worker's request path imports: loaded once, in the serving process, before the fork.
PRELOAD = ("appliance.fronts.worker", "appliance.api.tfserving.rest", "appliance.api.kserve.rest",
           "appliance.transport.http.server", "uvloop")
PRELOAD_GRPC = ("appliance.fronts.grpc_front", "appliance.transport.grpc.h2_server")
SPAWN_TIMEOUT_S = 10.0
MAX_MESSAGE = 256
LOST = -signal.SIGKILL  # a worker's exit status nobody could read: counted as killed


class WorkerProcess(Protocol):
    """What the supervisor holds of a worker: ``subprocess.Popen``'s face, in part."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


def popen_worker(index: int, port: int, grpc_port: int, channel: socket.socket, listener: socket.socket,
                 grpc_listener: socket.socket | None = None, env: dict[str, str] | None = None) -> WorkerProcess:
    """A worker as a fresh interpreter: the way when there is no zygote (GRPC_LISTENER_FD -1: none)."""
    grpc_fd = grpc_listener.fileno() if grpc_listener is not None else -1
    argv = [sys.executable, "-m", "appliance.fronts.worker", str(port), str(grpc_port), str(index),
            str(channel.fileno()), str(listener.fileno()), str(grpc_fd)]
    passed = (channel.fileno(), listener.fileno(), *((grpc_fd,) if grpc_fd >= 0 else ()))
    return subprocess.Popen(argv, pass_fds=passed, env=env)


class Forked:
    """A worker the zygote forked: its exit code arrives as the zygote's ``exited`` message, or,
    once the zygote is gone, from its pidfd (``adopted``)."""

    def __init__(self, zygote: "Zygote", pid: int, pidfd: PidFd | None = None):
        self.zygote, self.pid, self.pidfd = zygote, pid, pidfd
        self.returncode: int | None = None
        self._done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"front worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is not None:
            return
        if self.pidfd is not None:  # names this process and no other, whoever its parent is now
            self.pidfd.kill()
        else:
            self.zygote.kill(self.pid)

    def ended(self, code: int) -> None:
        self.returncode = code
        self._done.set()
        if self.pidfd is not None:
            self.pidfd.close()

    def adopted(self) -> None:
        """(its own thread) Its zygote is gone and it serves on: wait for its end on its pidfd;
        the serving process, its subreaper now, reaps it and reads how it ended."""
        if self.pidfd is None:
            return _await_orphan(self)
        self.pidfd.ended(None)
        code = self.pidfd.reap()
        self.ended(code if code is not None else LOST)


class Zygote:
    """The serving process's end of the zygote (module docstring)."""

    def __init__(self, pid: int, control: socket.socket, grpc: bool = False,
                 proc: "subprocess.Popen[bytes] | None" = None, on_gone: "Callable[[Zygote], None] | None" = None):
        """``on_gone(zygote)``: it died (not closed by this process); from its reader thread."""
        self.pid, self.control, self.grpc, self.proc = pid, control, grpc, proc
        self.alive = True
        self.born = time.monotonic()
        self.ready = threading.Event()  # its imports are done: it forks at once (a forked one: from the start)
        if proc is None:
            self.ready.set()
        self.on_gone: Callable[[Zygote], None] = on_gone or (lambda zygote: None)
        self._closing = False
        self._children: dict[int, Forked] = {}
        self._replies: list[str] = []
        self._reply = threading.Condition()
        self._spawning = threading.Lock()
        self._ending = threading.Lock()  # ``_gone`` runs once, whether the reader or a spawn finds it gone
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, grpc: bool = False) -> "Zygote | None":
        """Import the worker's code, fork the zygote; None where forking is not safe here (a
        thread already runs) or not possible (no ``fork``)."""
        if not hasattr(os, "fork") or threading.active_count() > 1:
            return None
        for module in _preload(grpc):
            importlib.import_module(module)
        become_subreaper()  # a dead zygote's workers are handed to this process (module docstring)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        gc.freeze()  # what exists now is never scanned again: the children do not write to it for the collector
        pid = os.fork()
        if pid == 0:
            ours.close()
            os._exit(_serve(theirs))
        theirs.close()
        return cls(pid, ours, grpc)

    @classmethod
    def start_fresh(cls, grpc: bool, on_gone: "Callable[[Zygote], None] | None" = None) -> "Zygote":
        """A zygote as a fresh interpreter (``main``): what replaces one that died, from a
        process that runs threads. OSError when it cannot be started."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [sys.executable, "-m", "appliance.fronts.zygote", str(theirs.fileno())] + (["grpc"] if grpc else [])
            proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),))
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(proc.pid, ours, grpc, proc, on_gone)

    # -- the serving process's requests ----------------------------------------------------
    def spawn(self, index: int, port: int, grpc_port: int, channel: socket.socket,
              listener: socket.socket, grpc_listener: socket.socket | None = None) -> WorkerProcess:
        """A worker forked by the zygote, with ``channel`` as its end of the conversation,
        ``listener`` as its REST port's socket and ``grpc_listener`` its gRPC port's (None: it
        binds its own). OSError when the zygote is gone or could not fork."""
        fds = [channel.fileno(), listener.fileno(), *([grpc_listener.fileno()] if grpc_listener is not None else [])]
        with self._spawning:
            if not self.alive:
                raise OSError("the front workers' zygote is gone")
            with self._reply:
                self._replies.clear()
            try:
                socket.send_fds(self.control, [f"spawn {index} {port} {grpc_port}".encode()], fds)
            except OSError:
                self._gone()
                raise
            words = self._await_reply()
        if words[0] != "started":
            raise OSError(int(words[2]), f"the zygote could not fork worker {index}: {os.strerror(int(words[2]))}")
        return self._children[int(words[2])]

    def _await_reply(self) -> list[str]:
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        with self._reply:
            while not self._replies:
                left = deadline - time.monotonic()
                if not self.alive or left <= 0:
                    raise OSError("the front workers' zygote did not answer")
                self._reply.wait(left)
            return self._replies.pop(0).split()

    def kill(self, pid: int) -> None:
        try:
            self.control.send(f"kill {pid}".encode())
        except OSError:
            self._kill_orphan(pid)

    def close(self) -> None:
        """Tell the zygote to exit (its workers are told by their own channels). Idempotent."""
        self._closing = True
        try:
            self.control.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- the reader thread -------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.control, MAX_MESSAGE, 1)
            except OSError:
                data, fds = b"", []
            if not data:
                self._gone()
                return
            words = data.decode().split()
            if words[0] == "started":  # registered before the spawner reads it: an exit may follow at once
                self._children[int(words[2])] = Forked(self, int(words[2]), PidFd(fds[0]) if fds else None)
            else:
                for fd in fds:
                    os.close(fd)
            if words[0] == "ready":
                self.ready.set()
                continue
            if words[0] == "exited":
                child = self._children.pop(int(words[1]), None)
                if child is not None:
                    child.ended(int(words[2]))
                continue
            with self._reply:
                self._replies.append(" ".join(words))
                self._reply.notify_all()

    def _gone(self) -> None:
        """The zygote exited: its workers serve on (module docstring); each is watched by its
        pidfd from now on. Then ``on_gone``, unless this process closed it."""
        with self._ending:
            if not self.alive:
                return
            self.alive = False
        self.ready.set()  # who waits for it, waits no more
        if not self._closing:
            log.error("the front workers' zygote (pid %d) is gone; its %d workers serve on, a new zygote starts",
                      self.pid, len(self._children))
        with self._reply:
            self._reply.notify_all()
        for pid, child in list(self._children.items()):
            threading.Thread(target=child.adopted, name=f"adopted-{pid}", daemon=True).start()
        self._children.clear()
        self._reap()
        if not self._closing:
            self.on_gone(self)

    def _reap(self) -> None:
        if self.proc is not None:
            self.proc.wait()
            return
        try:
            os.waitpid(self.pid, 0)  # the zygote is this process's own child
        except ChildProcessError:
            pass

    def _kill_orphan(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _await_orphan(child: Forked) -> None:
    """Without pidfds: a worker whose zygote died exits when its parent changes; reaped here
    when it was handed to this process, else gone once its pid is (how, not known: ``LOST``)."""
    while True:
        try:
            done, status = os.waitpid(child.pid, os.WNOHANG)
            if done:
                child.ended(os.waitstatus_to_exitcode(status))
                return
        except ChildProcessError:  # another parent's (init's): only its end can be seen
            try:
                os.kill(child.pid, 0)
            except ProcessLookupError:
                child.ended(LOST)
                return
        time.sleep(0.2)


# -- the zygote process ------------------------------------------------------------------------
def _serve(control: socket.socket) -> int:
    """The zygote's loop: fork workers on request, report their exits; 0 at EOF."""
    serving = os.getppid()  # what each worker watches (module docstring)
    raise_oom_score(os.getpid(), WORKER_OOM_SCORE)  # its workers inherit it: they go before the serving process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes to the wake-up pipe
    children: set[int] = set()
    try:
        while True:
            readable, _, _ = select.select([control.fileno(), wake_r], [], [])
            if wake_r in readable:
                os.read(wake_r, 4096)
                _reap(control, children)
            if control.fileno() in readable and not _command(control, children, (wake_r, wake_w), serving):
                return 0
    except OSError:
        return 1


def _command(control: socket.socket, children: set[int], own: tuple[int, int], serving: int) -> bool:
    """One request from the serving process; False at EOF."""
    data, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 3)
    if not data:
        return False
    words = data.decode().split()
    if words[0] == "kill":
        pid = int(words[1])
        if pid in children:  # unreaped: the pid is still this child's
            os.kill(pid, signal.SIGKILL)
    elif words[0] == "spawn":
        index, port, grpc_port = (int(w) for w in words[1:4])
        try:
            pid = _fork_worker(index, port, grpc_port, (fds[0], fds[1], fds[2] if len(fds) > 2 else -1),
                               control, own, serving)
        except OSError as exc:
            control.send(f"failed {index} {exc.errno or 0}".encode())
        else:
            children.add(pid)
            _started(control, index, pid)
        finally:
            for fd in fds:
                os.close(fd)
    return True


def _started(control: socket.socket, index: int, pid: int) -> None:
    """Say so, with a pidfd on the worker: opened before this loop can reap it, so it is exact."""
    message = f"started {index} {pid}".encode()
    pidfd = open_pidfd(pid)
    if pidfd is None:
        control.send(message)
        return
    try:
        socket.send_fds(control, [message], [pidfd.fd])
    finally:
        pidfd.close()


def _fork_worker(index: int, port: int, grpc_port: int, passed: tuple[int, int, int], control: socket.socket,
                 own: tuple[int, int], serving: int) -> int:
    """``passed``: the worker's channel, its REST listener and its gRPC one (-1: none), as the
    serving process sent them."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the worker: none of the zygote's descriptors or handlers
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        control.close()
        for fd in own:
            os.close(fd)
        from appliance.fronts.worker import run_forked

        code = run_forked(index, port, grpc_port, passed[0], serving, passed[1], passed[2])
    except BaseException:  # anything at all: the worker ends here, never back in the zygote's loop
        logging.getLogger("appliance.workers").exception("front worker %d failed", index)
    finally:
        _flush_and_exit(code)
    return 0  # not reached


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _reap(control: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        control.send(f"exited {pid} {os.waitstatus_to_exitcode(status)}".encode())


Launcher = Callable[[int, socket.socket], WorkerProcess]


def _preload(grpc: bool) -> tuple[str, ...]:
    return PRELOAD + (PRELOAD_GRPC if grpc else ())


def main(argv: list[str]) -> int:
    """A zygote as a fresh interpreter: ``python -m appliance.fronts.zygote FD [grpc]``, FD its
    end of the control socket (``Zygote.start_fresh``)."""
    control = socket.socket(fileno=int(argv[1]))
    for module in _preload("grpc" in argv[2:]):
        importlib.import_module(module)
    gc.freeze()  # as the first zygote does: its workers do not write to these pages for the collector
    control.send(b"ready")
    return _serve(control)


# -- the process's one zygote --------------------------------------------------------------------
_early: Zygote | None = None


def start_early(config: "Config") -> Zygote | None:
    """Fork this process's zygote when ``config`` runs front workers: called by the serve
    commands right after the config is read, before the service is imported (module
    docstring). gRPC's modules are preloaded too when the workers may serve its TCP port."""
    global _early
    from appliance.fronts.shares import workers_for

    if _early is None and workers_for(config) > 1:
        _early = Zygote.start(grpc=bool(config.grpc.port))
    return _early


def early() -> Zygote | None:
    """The zygote ``start_early`` forked, while it is alive."""
    return _early if _early is not None and _early.alive else None


__all__ = ["Forked", "Launcher", "PRELOAD", "WorkerProcess", "Zygote", "early", "popen_worker",
           "start_early"]


if __name__ == "__main__":
    sys.exit(main(sys.argv))
