"""The front workers, as one feature: HTTP and JSON on every core, one batch queue per model.

With ``[server] workers`` above one, HTTP parsing and JSON decoding and encoding run in front
worker processes, while every model version, batch queue, rollout and metric stays in the one
serving process. The API code is the same in both: a worker's core is a ``remote.RemoteCore``
whose handles have the face of the core's (appliance/core/seams.py), so TF Serving's and KServe
v2's handlers decode and encode in the worker exactly as they would in the serving process, and
only numpy arrays cross (appliance/transport/channel.py).

- ``pool``: the port and its workers, as the service sees them (the face of the HTTP server).
- ``supervisor``: the worker processes kept running.
- ``serving``: the serving process's side: runs what workers send through the manager's
  handles and the real app, pushes the serving view when it changes, counts their metrics.
- ``worker``: a worker process's main; ``app``: its front app (inference answered there,
  everything else forwarded); ``grpc_front``: its gRPC port.
- ``remote``: the remote core and handles; ``link``: the worker's end of the conversation;
  ``messages``: the message kinds; ``view``: what serves, as the workers see it.
"""
