"""A front worker's CPU per call for TF Serving REST :predict and gRPC Predict, in memory.

    .venv/bin/python bench/worker_path_cost.py [TREE] [--grpc | --rest]

The worker's own code for each API (HTTP/1.1 through httptools or HTTP/2 through libnghttp2,
the token check, the TF Serving family, JSON or protobuf, RUN over the link) fed the bench
MLP's request 20,000 times (``N``), with the serving process replaced by a channel that answers
each RUN at once on the same loop: no sockets, no model. What one API costs a worker beside the
other, where socket system calls and the load generator do not blur it (bench/RESULTS.md,
issue 37). ``TREE``: another checkout's appliance/ to compare.
"""

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # before the heavy imports
    print(__doc__)
    raise SystemExit(0)

import asyncio, os, struct, sys, time
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
root = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else HERE
sys.path.insert(0, HERE)
sys.path.insert(0, root)
import numpy as np, uvloop
from runtimes import SignatureInfo, TensorSpec
from appliance.core.config import Config
from appliance.fronts import messages as m
from appliance.fronts.app import FrontApp, Forwarder, facing, hot_mounts
from appliance.fronts.link import Link
from appliance.fronts.remote import RemoteCore
from appliance.fronts.view import ModelView, ServingView, version_view
from bench import grpc_bench
from bench.h2load import build_request, PREFACE, _frame, SETTINGS
from bench.run_bench import body as rest_body
N = int(os.environ.get("N", "20000"))
sig = SignatureInfo("serving_default", {"input": TensorSpec("input", np.dtype("float32"), (-1, 64), "x:0")},
                    {"output": TensorSpec("output", np.dtype("float32"), (-1, 10), "y:0")})
OUT = {"output": (np.arange(10, dtype=np.float32) / 7).reshape(1, 10)}
class T:
    def __init__(self): self.out = 0
    def get_extra_info(self, k, d=None): return ("127.0.0.1", 1) if k == "peername" else None
    def write(self, d): self.out += len(d)
    def writelines(self, ds): self.out += sum(len(d) for d in ds)
    def is_closing(self): return False
    def close(self): pass
    def pause_reading(self): pass
    def resume_reading(self): pass
    def set_write_buffer_limits(self, *a, **k): pass
    def get_write_buffer_size(self): return 0
class Channel:  # the serving process: every RUN answered at once, on the loop
    def __init__(self, link, loop): self.link, self.loop = link, loop
    def send(self, message):
        if isinstance(message, m.Run):
            self.loop.call_soon(self.link.on_message, None, m.Ran(message.id, 1, OUT))
    def send_threadsafe(self, message): self.loop.call_soon_threadsafe(self.send, message)
def core_on(loop):
    link = Link(lambda message: None)
    link.attach(loop, Channel(link, loop))
    core = RemoteCore(Config(), link)
    core.handles.view = ServingView(1, {"mlp": ModelView({}, {1: version_view(1, "/m", "tflite", False, {"serving_default": sig})}, 1)})
    return core
async def grpc_cost():
    from appliance.api.auth import grpc_interceptor
    from appliance.fronts.grpc_front import FrontGRPC
    from appliance.transport.grpc.connection import Connection
    from appliance.transport.grpc.h2_server import LeanServer
    loop = asyncio.get_running_loop(); core = core_on(loop)
    srv = LeanServer(1, [], [grpc_interceptor(core)], loop=loop)
    srv.add_generic_rpc_handlers([FrontGRPC(core)])
    req, offsets = build_request("127.0.0.1", 8500, grpc_bench.PREDICT, grpc_bench.predict_bytes("mlp"))
    conn = Connection(srv); t = T(); conn.connection_made(t)
    conn.data_received(PREFACE + _frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 2**31-1)) + _frame(8, 0, 0, struct.pack(">I", 2**31-1-65535)) + _frame(SETTINGS, 1, 0))
    reqs = []
    for i in range(N + 500):
        for off in offsets: struct.pack_into(">I", req, off, 2 * i + 1)
        reqs.append(bytes(req))
    async def run(rs):
        for r in rs:
            conn.data_received(r)
            for _ in range(6): await asyncio.sleep(0)
    await run(reqs[:500])
    t0 = time.thread_time(); await run(reqs[500:]); spent = time.thread_time() - t0
    return spent / N, t.out / (N + 500), len(conn.streams)
async def rest_cost():
    from appliance.core.config import LimitsConfig
    from appliance.transport.http.connection import Connection as HTTPConnection
    from appliance.transport.http.server import HTTPServer
    loop = asyncio.get_running_loop(); core = core_on(loop)
    app = FrontApp(core, hot_mounts(core), Forwarder(core.link))
    server = HTTPServer(app, "127.0.0.1", 0, 1, 1 << 20, LimitsConfig(), fast=app, facing=facing())
    server.loop = loop
    b = rest_body("mlp")
    request = (b"POST /v1/models/mlp:predict HTTP/1.1\r\nHost: 127.0.0.1:8501\r\nUser-Agent: h2load nghttp2/1.52.0\r\n"
               b"Accept: */*\r\ncontent-type: application/json\r\nContent-Length: " + str(len(b)).encode() + b"\r\n\r\n" + b)
    conn = HTTPConnection(server); t = T(); conn.connection_made(t)
    async def run(n):
        for _ in range(n):
            conn.data_received(request)
            for _ in range(6): await asyncio.sleep(0)
    await run(500)
    t0 = time.thread_time(); await run(N); spent = time.thread_time() - t0
    server.sock.close()
    return spent / N, t.out / (N + 500), 0
which = [a for a in sys.argv[1:] if a.startswith("-")]
for name, fn in (("gRPC Predict", grpc_cost), ("REST :predict", rest_cost)):
    if which and f"--{name.split()[0].lower()}" not in which: continue
    per, out, left = uvloop.run(fn())
    print(f"{root}: {name}: {1e6 * per:.1f} us of worker CPU per call ({out:.0f} bytes answered, {left} open)", flush=True)
