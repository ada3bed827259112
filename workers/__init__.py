"""chameleon-worker: PyTorch training processes that execute chameleond's plans (docs/worker.md)."""
