"""The error a model configuration raises, in a module of its own so that every model module can raise it."""
from __future__ import annotations


class ConfigError(ValueError):
    """config.json is missing, unreadable, or describes a model tc cannot run."""
