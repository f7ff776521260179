"""k2-launcher: model."""
