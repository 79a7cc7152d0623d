"""Internals of ray_triton_shm; nothing here is public API.

The modules are grouped by layer, lowest first; the public module of each
layer is named after it:

1. ``base``: ``ray_triton_shm.errors``, ``ray_triton_shm.config``, and what
   the config dataclasses are built of: fields read from the environment,
   checks of values.
2. ``shm``: shared-memory segments, slot tables, slot pools, layouts, byte
   tensors, CUDA buffers.
3. ``triton``: the Triton server process (``ray_triton_shm.server``) and
   talking to it: environment, repositories, native models, requests over
   gRPC and HTTP, error translation, the observer interface.
4. ``core``: the client machinery behind ``ray_triton_shm.client``: pools
   by model, slot runs.
5. ``node``, the Ray layer: the node actor and its config, lifecycle,
   health, registry, pools, client, metrics and model control
   (``ray_triton_shm.node``).
6. ``serve``: the Serve ingress (KServe v2 over HTTP and gRPC) and slot
   references (``ray_triton_shm.serve``, ``ray_triton_shm.data``, and the
   package itself, which names their classes but loads them on first use).
   Inside it, rooms: ``net`` (what the transports share), ``protocol``
   (KServe v2, transport-neutral), the transports ``http1`` and ``http2``,
   ``ingress`` (behind Serve's proxies) and ``door`` (the front door, which
   joins the transports to the protocol); see ``_private/serve/__init__.py``.
7. ``bench``: the benchmark.
8. ``cli``: the command line (``ray-triton-shm``, ``python -m
   ray_triton_shm``): its commands, the demo, status, the soak.

The rules, checked by ``tests/unit/test_layers.py``: a layer imports only
itself and the layers below it; nothing below ``node`` imports Ray; nothing
in the library imports ``bench`` or ``cli`` (only the command line runs the
benchmark); no two modules import each other, directly or in a circle.
Imports sit at the top of a module, except where laziness is the point
(Ray, cupy, optional packages), each one marked ``# lazy: <reason>``.
"""
