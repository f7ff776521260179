"""k2-launcher: launcher."""
