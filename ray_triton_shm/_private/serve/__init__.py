"""The Serve ingress: KServe v2 over HTTP and gRPC, slot references."""
