"""The Megatron-core adapter: the only package that imports megatron.

Megatron-core is imported here first, with ``torch.compile`` deferred to each fused function's first call
(:mod:`hetu_ext.patches.megatron_import`: the same compilation, ~1.6 CPU-s less start-up per rank), and with the
host frameworks' routine warnings silenced first (:func:`hetu_ext.hostlog.quiet_host_frameworks`, what every
hetu_ext entry point does; ``python -m hetu_ext.megatron.preprocess_data`` imports this package before its own
code runs).
"""

from hetu_ext.hostlog import quiet_host_frameworks
from hetu_ext.patches.megatron_import import import_megatron_core

quiet_host_frameworks()
import_megatron_core()
