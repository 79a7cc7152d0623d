"""The client machinery behind ``ray_triton_shm.client``: pools by model, slot runs (no Ray)."""
