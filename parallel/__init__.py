"""k2-launcher: parallel."""
