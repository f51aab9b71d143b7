"""Configuration: verl's key tree, typed (schema), loaded with did-you-mean errors (loader), checked (validate)."""

from meshrl.config.loader import ConfigError, default_config, load_config
from meshrl.config.schema import MeshRLConfig

__all__ = ["ConfigError", "MeshRLConfig", "default_config", "load_config"]
