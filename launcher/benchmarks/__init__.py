"""``k2-bench``'s benchmarks (``registry`` lists them): core attention, the optimizer step, the pipeline
with decoupled weight gradients, activation memory, and the full K2 step against plain megatron-core.
"""
