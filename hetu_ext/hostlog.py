"""Keep the host frameworks' noise out of the user's way: one call at the top of each entry point.

Megatron-core 0.16.1 warns four times at import that Transformer Engine and Apex are absent (true and expected on
CPU: it falls back to torch), logs a deprecation line for every legacy tokenizer and three "Unable to save
MockGPTDataset indexes" lines for every mock dataset; its INFO lists every parameter. DeepSpeed logs its
configuration at INFO, and its ZeRO calls torch.distributed APIs torch warns are deprecated; torchrun's agent
logs each rendezvous. None of it is the user's business on a normal run.

:func:`quiet_host_frameworks` installs ``warnings`` filters and logger levels/filters for exactly those sources;
it imports none of the frameworks (so it may run before them) and is idempotent. Errors and our own logging are
untouched.
"""

from __future__ import annotations

import logging
import re
import warnings

HOST_MODULES = ("megatron", "deepspeed", "transformer_engine", "apex")
"""Packages whose import-time ``UserWarning``/``DeprecationWarning``/``FutureWarning`` are dropped."""

LOGGER_LEVELS = {
    "megatron": logging.WARNING,  # its INFO lists every parameter and config field
    "DeepSpeed": logging.WARNING,  # deepspeed.utils.logger: its INFO dumps the engine configuration
    "deepspeed": logging.WARNING,
    "transformer_engine": logging.ERROR,
    "apex": logging.ERROR,
    "torch.distributed.elastic": logging.WARNING,  # torchrun's agent: rendezvous and worker-group INFO
}
"""Minimum level per host logger (a logger already set higher is left as it is)."""

DROPPED_MESSAGES = {
    "megatron.core.datasets.megatron_tokenizer": ("legacy tokenizer system",),
    "megatron.core.datasets.gpt_dataset": ("because path_to_cache is None",),
}
"""Host log lines dropped by pattern (regular expressions, searched in the message), per emitting logger:
warnings that fire on every run and ask nothing of the user (hetu_ext's tokenizers are legacy-API subclasses by
design; mock datasets have no cache path)."""

WARNING_MESSAGES = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"Transformer Engine is not installed",
    r"`torch\.distributed\.\w+` is deprecated",  # torch's FutureWarning for the APIs DeepSpeed's ZeRO calls
    r"torch\.distributed is disabled, unavailable or uninitialized",  # dist_checkpointing saved by one process
)
"""``warnings.warn`` messages (regex, start of message) dropped wherever they are attributed to."""


class DropMessages(logging.Filter):
    """Drops records whose message matches one of ``patterns`` (regular expressions, ``re.search``)."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.patterns = tuple(re.compile(p) for p in patterns)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


_FILTERS = {name: DropMessages(patterns) for name, patterns in DROPPED_MESSAGES.items()}


def quiet_host_frameworks() -> None:
    """Silence the host frameworks' routine warnings and INFO (see the module docstring). Idempotent: the
    ``warnings`` filters replace identical ones, each logging filter is one shared instance."""
    for module in HOST_MODULES:
        for category in (UserWarning, DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category, module=rf"{module}(\.|$)")
    for message in WARNING_MESSAGES:
        warnings.filterwarnings("ignore", message=message)
    for name, level in LOGGER_LEVELS.items():
        logger = logging.getLogger(name)
        if logger.level < level:
            logger.setLevel(level)
    for name, drop in _FILTERS.items():
        logging.getLogger(name).addFilter(drop)  # Logger.addFilter skips an instance it already holds
