"""The patch layer: the only package of megatron_sdp4bit that imports megatron.

Nothing heavy is imported here, so ``import megatron_sdp4bit.megatron`` stays
cheap; import the submodules you need (for example
``megatron_sdp4bit.megatron.cpu`` for the CPU backend of megatron-core).
"""
