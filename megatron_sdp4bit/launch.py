"""``python -m megatron_sdp4bit.launch PATH/TO/pretrain_gpt.py <args> --sdp4bit``.

See ``megatron_sdp4bit.megatron_lm.launcher``.
"""
from megatron_sdp4bit.megatron_lm.launcher import main

if __name__ == "__main__":
    main()
