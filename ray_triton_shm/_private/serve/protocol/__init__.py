"""KServe v2 and Triton's gRPC protocol, transport-neutral: codecs, routes, limits, errors, slot plans."""
