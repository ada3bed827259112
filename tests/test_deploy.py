"""The deployment recipes in deploy/ as users take them: a worker started from the environment file
docs/operations.md shows, by the command its systemd unit runs, trains and checkpoints into the
job's shared directory; the SLURM batch script is valid bash and writes a spec chameleond reads;
the Kubernetes manifests validate against the schemas of a pinned Kubernetes version."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import Daemon, wait_for
from worker_harness import tiny_spec

from chameleond.auth import SECRET_ENV
from chameleond.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]
OPERATIONS = ROOT / "docs" / "operations.md"
WORKER_UNIT = ROOT / "deploy" / "systemd" / "chameleon-worker@.service"
SBATCH = ROOT / "deploy" / "slurm" / "chameleon.sbatch"
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
KUBERNETES = "1.31.0"  # the oldest release the manifests are kept valid for


def env_file_of_the_docs() -> dict[str, str]:
    """The fenced block after the line of docs/operations.md that names
    /etc/chameleond/worker-ID.env, as systemd's EnvironmentFile reads it: KEY=VALUE lines."""
    text = OPERATIONS.read_text()
    found = re.search(r"/etc/chameleond/worker-ID\.env`[^\n]*\n(?:[^\n]*\n)*?```sh\n(.*?)```",
                      text, re.S)  # fmt: skip
    assert found, "docs/operations.md: no ```sh block after the line naming worker-ID.env"
    env: dict[str, str] = {}
    for line in found.group(1).splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"not KEY=VALUE: {line!r}"
            env[key.strip()] = value.strip()
    return env


def exec_start(unit: Path, instance: str, env: dict[str, str]) -> list[str]:
    """The unit's ExecStart as systemd runs it: %i the instance, ${VAR} one word, $VAR split on
    white space, /usr/local/bin/ where this environment's console scripts are."""
    (line,) = re.findall(r"^ExecStart=(.*)$", unit.read_text(), re.M)
    argv: list[str] = []
    for word in line.replace("%i", instance).split():
        if word.startswith("${") and word.endswith("}"):
            argv.append(env.get(word[2:-1], ""))
        elif word.startswith("$"):
            argv += env.get(word[1:], "").split()
        else:
            argv.append(word.replace("/usr/local/bin/", f"{Path(sys.executable).parent}/"))
    return argv


def test_a_worker_from_the_documented_environment_file_trains(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    job, steps = "envfile", 6
    documented = env_file_of_the_docs()
    for key in ("CHAMELEON_JOB", "CHAMELEON_REDIS_URL", "CHAMELEON_SECRET",
                "CHAMELEON_BIND_ADDRESS", "CHAMELEON_CHECKPOINT_DIR"):  # fmt: skip
        assert key in documented, f"the worker's environment file in docs/operations.md lacks {key}"
    assert "%i" not in documented["CHAMELEON_CHECKPOINT_DIR"], "one directory for the job"
    shared = tmp_path / "checkpoints" / job
    shared.mkdir(parents=True)
    # This test's Redis, secret, directory and address; a checkpoint every 2 steps and an end.
    args = re.sub(r"--checkpoint-every \d+", "--checkpoint-every 2",
                  documented.get("CHAMELEON_WORKER_ARGS", ""))  # fmt: skip
    env = {
        **documented,
        "CHAMELEON_JOB": job,
        "CHAMELEON_DEVICE": "cpu",
        "CHAMELEON_REDIS_URL": redis_server.url,
        "CHAMELEON_SECRET": os.environ[SECRET_ENV],
        "CHAMELEON_BIND_ADDRESS": "127.0.0.1",
        "CHAMELEON_CHECKPOINT_DIR": str(shared),
        "CHAMELEON_WORKER_ARGS": f"{args} --max-steps {steps}",
        "PATH": os.environ["PATH"],
    }
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(tiny_spec(job, workers=1, stages=1)))
    daemon = Daemon(redis_server.url, tmp_path, "--spec", str(spec), job=job)
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        daemon.start().wait_ready()
        worker = subprocess.Popen(
            exec_start(WORKER_UNIT, "w0", env), env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=tmp_path,
        )  # fmt: skip
        try:
            code = worker.wait(timeout=240)
            assert code == 0, log.read_text()[-3000:]
            wait_for(lambda: daemon.status()["state"] == "finished", 30, "state finished")
            assert daemon.status()["progress"]["step"] == steps - 1
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
            daemon.stop()
    written = sorted(p.name for p in shared.iterdir())
    assert any(name.startswith("w0-") and name.endswith(".safetensors") for name in written), (
        written, log.read_text()[-3000:],
    )  # fmt: skip


MODEL = """
[links.intra_host]
bandwidth_bytes_per_second = 1.0e11
latency_seconds = 5.0e-6

[links.inter_host]
bandwidth_bytes_per_second = 1.25e10
latency_seconds = 1.0e-5

[[model.layers]]
count = 8
forward_seconds = 0.004
backward_seconds = 0.008
param_bytes = 100_000_000
optimizer_bytes = 600_000_000
activation_bytes = 140_000_000
output_bytes = 8_000_000

[training]
global_batch = 64
micro_batch = 1
"""


def test_the_slurm_script_is_valid_bash() -> None:
    syntax = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    shellcheck = shutil.which("shellcheck")
    if shellcheck is not None:  # not packaged for every test machine; bash -n always runs
        lint = subprocess.run([shellcheck, str(SBATCH)], capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout
    header = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    for option in ("--nodes=", "--ntasks-per-node=1", "--gpus-per-node=", "--no-kill"):
        assert any(option in line for line in header), option
    assert "--kill-on-bad-exit=0" in SBATCH.read_text()


def test_the_slurm_script_writes_a_spec_of_its_allocation(tmp_path: Path) -> None:
    """Two nodes of SLURM's hostlist, two GPUs each (the typed form of --gpus-per-node): the
    spec chameleond reads has a worker per GPU, named after its node."""
    from chameleond.core.spec import load_spec

    model = tmp_path / "model.toml"
    model.write_text(MODEL)
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_GPUS_PER_NODE": "h100:2", "CHAMELEON_MEMORY_BYTES": str(80 << 30)}  # fmt: skip
    printed = subprocess.run(
        ["bash", str(SBATCH), "--print-spec", str(model)], env=env, capture_output=True,
        text=True, timeout=30,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(printed.stdout)
    spec = load_spec(spec_path)
    assert [(w.id, w.host, w.device, w.memory_bytes) for w in spec.workers] == [
        (f"{host}-{i}", host, "cuda", 80 << 30) for host in ("gpu07", "gpu08") for i in range(2)
    ]
    checked = subprocess.run(
        [str(Path(sys.executable).parent / "chameleond"), "check", "--config-only",
         "--spec", str(spec_path)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


# SLURM's launcher stands in for itself on one node: the step's command, run here.
SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
SLURMD_NODENAME=localhost exec "$@"
"""


def test_the_slurm_script_runs_a_job_to_its_end(tmp_path: Path) -> None:
    """The batch script on a one-node allocation of two CPU "GPUs": its Redis, its chameleond, an
    agent through srun, two workers that train 5 steps and write their final checkpoints into the
    job's shared directory; then it stops what it started and exits 0."""
    from chameleond.redis_server import free_port

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text(SRUN)
    (tmp_path / "bin" / "srun").chmod(0o755)
    (tmp_path / "model.toml").write_text(
        MODEL.replace("count = 8", "count = 6").replace("global_batch = 64", "global_batch = 12")
        .replace("micro_batch = 1", "micro_batch = 2")
        + "\n[model.arch]\nd_model = 32\nheads = 2\nblocks = 4\nseq_len = 32\nvocab = 256\n"
        + "\n[plan]\nstages = 2\n"
    )  # fmt: skip
    scripts = Path(sys.executable).parent
    env = {
        "PATH": f"{tmp_path / 'bin'}:{scripts}:{os.environ['PATH']}", "HOME": str(tmp_path),
        "SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "localhost", "SLURM_GPUS_PER_NODE": "2",
        "CHAMELEON_DEVICE_KIND": "cpu", "CHAMELEON_MEMORY_BYTES": str(8 << 30),
        "CHAMELEON_REDIS_PORT": str(free_port()), "CHAMELEON_HTTP_PORT": str(free_port()),
        "CHAMELEON_BIND_ADDRESS": "127.0.0.1",
    }  # fmt: skip
    run = subprocess.run(
        ["bash", str(SBATCH), "model.toml", "--", "chameleon-worker", "--max-steps", "5"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "published generation=1" in out, out[-4000:]
    for worker in ("localhost-0", "localhost-1"):
        assert f"worker={worker} step 4 committed: finished" in out, out[-4000:]
    written = {p.name.split("-")[1] for p in (tmp_path / "chameleon-77" / "checkpoints").iterdir()}
    assert written == {"0", "1"}, written  # localhost-0-4.safetensors, localhost-1-4...
    assert "Connection refused" not in out, out[-4000:]  # chameleond stopped before its Redis


def manifests() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in MANIFESTS
            for doc in yaml.safe_load_all(path.read_text()) if doc]  # fmt: skip


def test_the_kubernetes_manifests_validate_strictly() -> None:
    from kubernetes_validate import utils

    found = manifests()
    kinds = {(name, doc["kind"]) for name, doc in found}
    for expected in (("control-plane.yaml", "Deployment"), ("control-plane.yaml", "Secret"),
                     ("workers-statefulset.yaml", "StatefulSet"),
                     ("agent-daemonset.yaml", "DaemonSet")):  # fmt: skip
        assert expected in kinds, expected
    for name, doc in found:
        try:
            utils.validate(doc, KUBERNETES, strict=True)
        except utils.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            raise AssertionError(f"{name}: {doc['kind']} {doc['metadata']['name']}: {path}: "
                                 f"{e.message}") from None  # fmt: skip


@pytest.mark.parametrize("layout", ["workers-statefulset.yaml", "agent-daemonset.yaml"])
def test_each_layouts_spec_and_the_daemons_settings_make_a_plan(
    layout: str, tmp_path: Path
) -> None:
    """`chameleond check --config-only` with the ConfigMaps' files as the pods mount them."""
    files: dict[str, str] = {}
    for name, doc in manifests():
        if doc["kind"] == "ConfigMap" and name in ("control-plane.yaml", layout):
            files.update(doc["data"])
    (tmp_path / "chameleond.toml").write_text(files["chameleond.toml"])
    (tmp_path / "spec.toml").write_text(files["spec.toml"])
    checked = subprocess.run(
        [str(Path(sys.executable).parent / "chameleond"), "check", "--config-only",
         "--config", str(tmp_path / "chameleond.toml"), "--spec", str(tmp_path / "spec.toml")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
