"""Typed configuration, Megatron-style flags and named presets."""

from domino.config.flags import add_config_flags, config_from_args, config_from_dict, config_to_dict, parse_config
from domino.config.schema import (
    CheckpointConfig,
    DataConfig,
    DominoConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from domino.config.validate import ConfigError, padded_vocab_size, validate

__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "DominoConfig", "LoggingConfig", "ModelConfig",
    "ParallelConfig", "TrainConfig", "add_config_flags", "config_from_args", "config_from_dict",
    "config_to_dict", "padded_vocab_size", "parse_config", "validate",
]
