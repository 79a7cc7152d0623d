"""Internals of ray_triton_shm; nothing here is public API."""
