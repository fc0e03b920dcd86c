"""The patch layer and what reaches into megatron-core's internals (the release's
adapter in ``adapters/`` owns every such access; the driver, ``training/`` and
``data/`` use megatron-core's public API).

Nothing heavy is imported here, so ``import megatron_sdp4bit.megatron`` stays
cheap; import the submodules you need (for example
``megatron_sdp4bit.megatron.cpu`` for the CPU backend of megatron-core).
"""
