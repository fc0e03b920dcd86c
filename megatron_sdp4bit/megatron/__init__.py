"""The SDP4Bit patch layer for megatron-core (``patch.install(config)``), and the
adapters that own every access to a megatron-core release's internals
(``adapters/``: the layer's seams, and the sites ``cpu_backend/``, ``training/`` and
``data/`` need; those otherwise use megatron-core's public API).

Nothing heavy is imported here, so ``import megatron_sdp4bit.megatron`` stays
cheap; import the submodules you need (``megatron_sdp4bit.megatron.patch``).
"""
