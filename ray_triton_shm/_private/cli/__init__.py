"""The command line: commands, demo, status, soak."""
