"""Data: the embedded stdlib corpus (``corpus``, ``tokenizer``), validation of the ``data`` settings
(``resolve``), megatron GPT datasets (``gpt``) and the microbatch order (``microbatches``).
"""
