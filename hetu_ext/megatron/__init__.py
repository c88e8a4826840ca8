"""The Megatron-core adapter: the only package that imports megatron.

Megatron-core is imported here first, with ``torch.compile`` deferred to each fused function's first call
(:mod:`hetu_ext.patches.megatron_import`: the same compilation, ~1.6 CPU-s less start-up per rank).
"""

from hetu_ext.patches.megatron_import import import_megatron_core

import_megatron_core()
