"""A handle across processes: front workers decode, the serving process batches and runs.

With ``[server] workers`` above one, HTTP parsing and JSON decoding and encoding run in
front worker processes (appliance/service/fronts.py starts them), while every model
version, batch queue, rollout and metric stays in the one serving process. The API code
is the same in both: a worker's core is a ``front.RemoteCore`` whose manager hands out
``RemoteHandle``s with the face of appliance/core/handle.py's ``Handle``, so TF Serving's
and KServe v2's REST handlers decode and encode in the worker exactly as they would in
the serving process, and only numpy arrays cross (appliance/transport/channel.py).

- ``front``: the worker's side: the handles, the forwarding of every request that is not
  inference (status, page, admin, metrics, generation streams) as a WSGI call, and the
  worker's app (hot mounts answered here, the rest forwarded).
- ``serving``: the serving process's side: runs what workers send through
  ``manager.handle`` and the real app, pushes the serving view (appliance/core/serving_view.py)
  when it changes, and merges the workers' request metrics into its own.
- ``messages``: the message kinds and how an error crosses.
"""
