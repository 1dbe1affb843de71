"""Configuration: load YAML + overrides over the defaults, validate once, freeze.

The one entry point is :func:`load_config`; everything else in the project receives the
frozen, typed ``Config`` it returns (``app.config.schema``; a run's copy is read back from
Redis the same way, ``app.state.runs.run_config``).
"""

from app.config.errors import ConfigError
from app.config.loader import DEFAULT_CONFIG_PATH, load_config, service_config, to_yaml

__all__ = ["ConfigError", "DEFAULT_CONFIG_PATH", "load_config", "service_config", "to_yaml"]
