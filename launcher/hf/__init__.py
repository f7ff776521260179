"""Hugging Face interoperability: ``k2-convert import`` (a DeepSeek-V3 / Kimi K2 HF checkpoint -> a
k2-launcher checkpoint) and ``k2-convert export`` (ours -> an HF directory that ``transformers`` loads).

Modules: ``mapping`` (THE table between the two tensor namings, with the ``[gate; up]``, expert-bias,
RoPE and latent-norm conventions), ``hf_config`` (``config.json`` both ways), ``fp8`` (128 x 128
block-quantized weights), ``dist`` (the one-process group megatron's dist-checkpointing needs),
``lazy_save`` (megatron's torch_dist save with each tensor made when its writer reaches it), ``export``
and ``importer`` (the two directions, streamed tensor group by tensor group).
"""
