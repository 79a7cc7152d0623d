"""The Serve layer's KServe v2 ingresses and slot references, in rooms that import downwards only.

* :mod:`~ray_triton_shm._private.serve.net`: what both transports share: the
  listening socket, vectored sends, reads and inflation bounded by a byte limit.
* :mod:`~ray_triton_shm._private.serve.protocol`: KServe v2 and Triton's gRPC
  protocol, transport-neutral: codecs, routes, limits, error answers, and the
  plan and run of a request in a leased slot. Imports ``net`` only.
* :mod:`~ray_triton_shm._private.serve.http1` and
  :mod:`~ray_triton_shm._private.serve.http2`: the transports (HTTP/1.1; HTTP/2
  with gRPC's message framing). Each imports ``net`` only: no KServe in them.
* :mod:`~ray_triton_shm._private.serve.ingress`: the ingress behind Serve's
  proxies (the deployment's ``__call__`` and gRPC methods), on the protocol.
* :mod:`~ray_triton_shm._private.serve.door`: the front door, which joins the
  transports to the protocol on the app's own ports.

``slot_ref`` and ``slot_ref_serve`` (slot references handed between
deployments) stand beside them.
"""
