"""The Hydra config tree of k2-launcher, shipped as package data (one directory per config group)."""
