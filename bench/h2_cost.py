"""Server-side CPU of python-hyper h2's HTTP/2 state machine per unary gRPC call, in memory.

    .venv/bin/python bench/h2_cost.py [--validate]

A client and a server H2Connection exchange one Predict-sized call at a time (HEADERS+DATA in;
HEADERS, DATA and trailers out; window updates back); only the server side is timed, no
sockets, no protobuf: what h2 alone would add to every call of a gRPC server written on it, with
the lean configuration the gRPC port used before it moved to libnghttp2 (header validation
and normalisation off), or with h2's inbound header validation back on (``--validate``). It is
the measurement behind appliance/transport/grpc/nghttp2.py.
"""

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # before the heavy imports
    print(__doc__)
    raise SystemExit(0)

import sys, time
import h2.connection, h2.config, h2.events
config = h2.config.H2Configuration(client_side=False, header_encoding=None,
                                   validate_inbound_headers="--validate" in sys.argv,
                                   normalize_inbound_headers=False, validate_outbound_headers=False,
                                   normalize_outbound_headers=False)
cc = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
sc = h2.connection.H2Connection(config)
cc.initiate_connection(); sc.initiate_connection()
sc.receive_data(cc.data_to_send()); cc.receive_data(sc.data_to_send()); sc.receive_data(cc.data_to_send()); cc.data_to_send(); sc.data_to_send()
req_hdr = [(":method","POST"),(":scheme","http"),(":path","/tensorflow.serving.PredictionService/Predict"),(":authority","127.0.0.1:8500"),("content-type","application/grpc"),("te","trailers"),("grpc-timeout","30S")]
payload = b"\0\0\0\1\x20" + b"x"*288
resp = b"\0\0\0\0\x40" + b"y"*64
N=5000
spent=0.0
for i in range(N):
    sid = cc.get_next_available_stream_id()
    cc.send_headers(sid, req_hdr); cc.send_data(sid, payload, end_stream=True)
    data = cc.data_to_send()
    t0=time.perf_counter()
    for ev in sc.receive_data(data):
        if isinstance(ev, h2.events.DataReceived):
            sc.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, h2.events.StreamEnded):
            s_ = ev.stream_id
            sc.send_headers(s_, [(":status","200"),("content-type","application/grpc")])
            sc.send_data(s_, resp)
            sc.send_headers(s_, [("grpc-status","0")], end_stream=True)
    out = sc.data_to_send()
    spent += time.perf_counter()-t0
    [cc.acknowledge_received_data(e.flow_controlled_length, e.stream_id) for e in cc.receive_data(out) if isinstance(e, h2.events.DataReceived)]
    back = cc.data_to_send()
    t0=time.perf_counter(); sc.receive_data(back); spent += time.perf_counter()-t0
print(f"h2 (python-hyper) server side per unary call: {1e6*spent/N:.1f} us")
