"""The HTTP/1.1 transport: a lean server whose request bodies can be read straight into a buffer."""
