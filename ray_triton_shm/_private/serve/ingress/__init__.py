"""The ingress behind Serve's proxies: KServe v2 over HTTP (``__call__``) and gRPC (deployment methods)."""
