"""chameleon-worker: PyTorch training processes that execute chameleond's plans (docs/worker.md)."""

from chameleond.extras import require

require("worker", "chameleon-worker")
