"""Typed configuration of a run: one frozen dataclass per component (:mod:`.schema`), the command line and the
``--hetu-config`` YAML file generated from and checked against them (:mod:`.parse`). Pure: no torch."""

from .parse import FlagParser, build_parser, from_namespace, load_config_file, parse_namespace, report_error, to_yaml
from .schema import (
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    LaunchConfig,
    LoggingConfig,
    ModelConfig,
    PackingConfig,
    ParallelConfig,
    RunConfig,
    StragglerConfig,
    TrainingConfig,
)

__all__ = ["SECTIONS", "CheckpointConfig", "DataConfig", "FlagParser", "LaunchConfig", "LoggingConfig",
           "ModelConfig", "PackingConfig", "ParallelConfig", "RunConfig", "StragglerConfig", "TrainingConfig",
           "build_parser", "from_namespace", "load_config_file", "parse_namespace", "report_error", "to_yaml"]
