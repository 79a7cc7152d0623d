"""The Ray layer: the node actor, its config, lifecycle, health, registry, pools, client and metrics."""
