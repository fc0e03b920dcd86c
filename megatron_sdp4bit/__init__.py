"""megatron_sdp4bit: 4-bit communication for sharded data-parallel GPT training.

Layers (imports point down only): ``pretrain``/``data`` -> ``megatron`` (the only
package that imports megatron) -> ``comm`` (quantized collectives) -> ``quant``
(tensor math) -> ``config``.
"""
from megatron_sdp4bit.config import PRESETS, SDP4BitConfig, preset

__version__ = "0.1.0"
__all__ = ["SDP4BitConfig", "PRESETS", "preset", "__version__"]
