"""Server CPU per unary gRPC call of the lean server's transport, in memory (no sockets).

    .venv/bin/python bench/grpc_transport_cost.py [TREE]

A ``Connection`` of appliance/transport/grpc/ on a uvloop loop is fed 20,000 calls of an echo
coroutine (300-byte messages, HEADERS + DATA as h2load sends them, bench/h2load.py's framing),
one call per turn of the loop, its answers written to a transport that only counts them. The
loop thread's CPU time per call is what the transport (HTTP/2, our accounting and dispatch)
costs a front worker, without the socket system calls both APIs pay alike. ``TREE``: another
checkout's appliance/ (a ``git archive`` of an earlier commit), to compare before and after.
"""
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
uvloop.run(main())
