"""The Triton server process and talking to it: environment, repositories, requests, HTTP/gRPC (no Ray)."""
