"""Configuration: load YAML + overrides over the defaults, validate once, freeze.

The one entry point is :func:`load_config`; everything else in the project receives the
frozen ``DictConfig`` it returns (or a run's copy of it read back from Redis).
"""

from app.config.errors import ConfigError
from app.config.loader import DEFAULT_CONFIG_PATH, load_config, service_config, to_yaml

__all__ = ["ConfigError", "DEFAULT_CONFIG_PATH", "load_config", "service_config", "to_yaml"]
