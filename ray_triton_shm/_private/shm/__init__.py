"""Shared memory: segments, slot tables, pools, layouts, byte tensors, CUDA buffers (no Triton, no Ray)."""
