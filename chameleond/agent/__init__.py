"""chameleon-agent: the per-host supervisor of a job's workers (docs/agent.md).

`supervise` is the pure core (what a worker's exit means, when to restart it, which deaths are one
host fault), `run` the I/O edge (processes, signals, Redis), `cli` the command line.
"""
