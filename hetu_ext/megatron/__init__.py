"""The Megatron-core adapter: the only package that imports megatron.

Importing it imports no framework (``launch_plan`` decides a launch without Megatron). It silences the host
frameworks' routine warnings (:func:`hetu_ext.hostlog.quiet_host_frameworks`, what every hetu_ext entry point does;
``python -m hetu_ext.megatron.preprocess_data`` imports this package before its own code runs) and arranges that
Megatron-core, wherever it is first imported, is imported with ``torch.compile`` deferred to each fused function's
first call (:mod:`hetu_ext.patches.megatron_import`: the same compilation, ~1.6 CPU-s less start-up per rank).
"""

from hetu_ext.hostlog import quiet_host_frameworks
from hetu_ext.patches.megatron_import import defer_compile_at_megatron_import

quiet_host_frameworks()
defer_compile_at_megatron_import()
