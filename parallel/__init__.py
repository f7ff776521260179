"""Parallel layout (layer 2, above ``k2.config``): validated PP/VPP/EP/DP sizes and layer placement
(``dims``, ``layout``), process groups and DDP wrapping (``distributed``), and the CPU (gloo) backend that
lets megatron-core's real code run without CUDA (``cpu_backend``)."""

from k2.parallel import eager_fusions

eager_fusions.install()  # before anything imports megatron-core: its import-time torch.compile stays eager on CPU
