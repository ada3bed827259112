"""The chameleond service: Redis stream in, plans out (see docs/daemon.md)."""

from chameleond.daemon.config import Config, ConfigError
from chameleond.daemon.metrics import Metrics
from chameleond.daemon.service import Service

__all__ = ["Config", "ConfigError", "Metrics", "Service"]
