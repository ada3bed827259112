"""The chameleond service: Redis stream in, plans out (see docs/daemon.md).

`chameleond.daemon.service.Service` runs it (the command line, `chameleond run`, builds one; so can
an embedding program). The package itself imports none of its parts beyond the settings and the
metrics, so that a part can be imported without the rest of the daemon.
"""

from chameleond.daemon.config import Config, ConfigError
from chameleond.daemon.metrics import Metrics

__all__ = ["Config", "ConfigError", "Metrics"]
