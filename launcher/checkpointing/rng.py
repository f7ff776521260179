"""The RNG state of one rank, saved in every checkpoint: Python, NumPy, torch CPU and CUDA generators and
megatron's model-/expert-parallel RNG-tracker streams.
"""

from __future__ import annotations

import random

import torch


def rng_state() -> dict:
    """This rank's generators: Python, NumPy, torch CPU, CUDA (when present), megatron's RNG tracker
    (the model-parallel / expert-parallel / data-parallel streams, ``tensor_parallel.random``)."""
    import numpy as np
    from megatron.core import tensor_parallel

    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    """Inverse of :func:`rng_state`."""
    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
