"""k2-launcher: entry points (k2-train, k2-plan, k2-data, k2-bench), config, data, metrics.

Importing this package silences library messages that carry no action for a k2-launcher user (a CPU
run has no Apex/Transformer Engine by design; megatron's experimental-API notices). Everything else,
including every other warning, is left as it is.
"""

import logging as _logging
import warnings as _warnings

for _msg in (
    r"Apex is not installed",
    r"Transformer Engine and Apex are not installed",
    r"MimoModelConfig is experimental",
    r"full scope is deprecated",
    # megatron's DistributedOptimizer.zero_grad reads .grad of its fp32 shard views, which are not
    # leaves ("throws grad-access warning", its own comment in distrib_optimizer.py); harmless
    r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    # torch's own distributed checkpoint, used inside megatron's torch_dist format, warns about its
    # internal ShardedTensor use on every save/load
    r"Please use DTensor instead and we are deprecating ShardedTensor",
):
    _warnings.filterwarnings("ignore", message=_msg)
_logging.getLogger("torch.utils.cpp_extension").setLevel(_logging.ERROR)


class _DropMessages(_logging.Filter):
    def __init__(self, *needles):
        super().__init__()
        self.needles = needles

    def filter(self, record):
        return not any(n in record.getMessage() for n in self.needles)


_logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(_DropMessages("GPTModel IS DEPRECATED"))
_logging.getLogger("megatron.core.distributed.distributed_data_parallel").addFilter(
    _DropMessages("full_param_layout not provided")
)
# logged on every synchronous save too (megatron wraps even a synchronous torch_dist save in its async
# machinery); k2-launcher does not use megatron's async save
_logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").addFilter(
    _DropMessages("async save is deprecated")
)
