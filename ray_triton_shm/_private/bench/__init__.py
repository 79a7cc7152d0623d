"""The benchmark behind ``make bench`` and ``ray-triton-shm bench``.

Every method runs against one Triton server (the node actor's when Ray is
used) and the same example models; see :mod:`.runner` for the flow. Nothing in
the library imports this package: only the command line's bench commands do.
"""
