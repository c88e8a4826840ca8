"""``python -m hetu_ext.megatron_lm PATH/pretrain_gpt.py <Megatron-LM flags> --hetu-...`` (under torchrun)."""

import sys

from hetu_ext.megatron_lm.run import main

if __name__ == "__main__":
    sys.exit(main())
