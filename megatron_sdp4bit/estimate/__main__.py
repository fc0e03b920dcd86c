import sys

from megatron_sdp4bit.estimate.cli import main

sys.exit(main())
