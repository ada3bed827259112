"""Cluster-scale discrete-event simulation of a training job over a failure trace.

docs/simulator.md describes it.

Pure: plain data in and out, no Redis, asyncio or torch. Every policy is priced by the daemon's own
core (`core.decide`, `core.estimator`, `core.search`, `core.restorer`, `core.selector`): there is no
second model.
"""
