"""``python -m ray_triton_shm`` runs the command-line interface."""

from ray_triton_shm._private.cli.cli import main

raise SystemExit(main())
