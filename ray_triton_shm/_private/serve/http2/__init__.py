"""The HTTP/2 transport with gRPC's message framing: connections, frames, header blocks, messages."""
