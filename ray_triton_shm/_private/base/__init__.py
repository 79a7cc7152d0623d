"""The base layer's internals: what the config dataclasses are built of (no Ray, nothing above ``errors``)."""
