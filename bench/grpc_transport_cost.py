"""Server CPU per unary gRPC call of the lean server's transport, in memory (no sockets).

    .venv/bin/python bench/grpc_transport_cost.py [TREE]

A ``Connection`` of appliance/transport/grpc/ on a uvloop loop is fed 20,000 calls of an echo
coroutine (300-byte messages, HEADERS + DATA as h2load sends them, bench/h2load.py's framing),
one call per turn of the loop, its answers written to a transport that only counts them. The
loop thread's CPU time per call is what the transport (HTTP/2, our accounting and dispatch)
costs a front worker, without the socket system calls both APIs pay alike. ``TREE``: another
checkout's appliance/ (a ``git archive`` of an earlier commit), to compare before and after.
The REST port's transport (httptools, appliance/transport/http/) is measured the same way
beside it, an echo on its loop (its fast route): the per-call cost gRPC is compared with.
"""

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # before the heavy imports
    print(__doc__)
    raise SystemExit(0)

import os, sys, time, asyncio, struct
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
root = sys.argv[1] if len(sys.argv) > 1 else HERE
sys.path.insert(0, HERE)
sys.path.insert(0, root)
import grpc
from appliance.transport.grpc.h2_server import LeanServer
from appliance.transport.grpc.connection import Connection
from bench.h2load import build_request, PREFACE, _frame, SETTINGS
import uvloop, appliance
N = int(__import__("os").environ.get("N", "20000"))
msg = b"x" * 300
req, offsets = build_request("127.0.0.1", 8500, "/t.T/E", msg)
reqs = []
for i in range(N):
    for off in offsets: struct.pack_into(">I", req, off, 2 * i + 1)
    reqs.append(bytes(req))
class T:
    def __init__(self): self.out = 0
    def get_extra_info(self, k, d=None): return ("127.0.0.1", 1) if k == "peername" else None
    def write(self, d): self.out += len(d)
    def is_closing(self): return False
    def close(self): pass
    def pause_reading(self): pass
    def resume_reading(self): pass
async def main():
    srv = LeanServer(1, loop=asyncio.get_running_loop())
    async def echo(r, c): return r
    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {"E": grpc.unary_unary_rpc_method_handler(echo)}),))
    conn = Connection(srv); t = T(); conn.connection_made(t)
    conn.data_received(PREFACE + _frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 2**31-1)) + _frame(8, 0, 0, struct.pack(">I", 2**31-1-65535)) + _frame(SETTINGS, 1, 0))
    await asyncio.sleep(0)
    t0 = time.thread_time()
    for i, r in enumerate(reqs):
        conn.data_received(r)
        await asyncio.sleep(0); await asyncio.sleep(0)
    for _ in range(5): await asyncio.sleep(0)
    t1 = time.thread_time()
    print(f"{os.path.dirname(appliance.__file__)}: {1e6*(t1-t0)/N:.1f} us of CPU per call "
          f"({t.out//N} bytes answered per call, {len(conn.streams)} streams left open)")


async def rest() -> None:
    from appliance.core.config import LimitsConfig
    from appliance.transport.http.connection import Connection as HTTPConnection
    from appliance.transport.http.server import HTTPServer

    class Echo:
        def route(self, environ):
            async def answer(env):
                data = env["wsgi.input"].read()
                return "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(data)))], data
            return answer
    server = HTTPServer(lambda e, s: [b""], "127.0.0.1", 0, 1, 1 << 20, LimitsConfig(), fast=Echo())
    server.loop = asyncio.get_running_loop()
    request = (b"POST /t HTTP/1.1\r\nHost: 127.0.0.1:8501\r\nUser-Agent: h2load nghttp2/1.52.0\r\nAccept: */*\r\n"
               b"content-type: application/json\r\nContent-Length: 300\r\n\r\n" + b"x" * 300)
    conn = HTTPConnection(server)
    t = T()
    conn.connection_made(t)
    t0 = time.thread_time()
    for _ in range(N):
        conn.data_received(request)
        await asyncio.sleep(0); await asyncio.sleep(0)
    print(f"REST (httptools) beside it: {1e6 * (time.thread_time() - t0) / N:.1f} us of CPU per call")
    server.sock.close()


uvloop.run(main())
if len(sys.argv) == 1:
    uvloop.run(rest())
