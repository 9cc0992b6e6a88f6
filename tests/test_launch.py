"""fabric_multimodel.run.launch: worlds' processes come from one fork server that imported torch and Lightning once; a
script's world is the launcher's, told from its environment, or its own."""

from __future__ import annotations

import os

import pytest

from fabric_multimodel.run.launch import launched_by, run_world, world_shape


def origin(fabric) -> tuple[int, int]:
    """This rank's parent process, and its rank."""
    return os.getppid(), fabric.global_rank


def test_world_processes_are_forked_from_one_preloaded_server():
    first, second = run_world(2, origin, timeout=120), run_world(2, origin, timeout=120)
    parents = {parent for parent, _ in first + second}
    assert len(parents) == 1 and os.getpid() not in parents, (first, second)  # spawn: this process, every time
    assert [rank for _, rank in first] == [0, 1]


LAUNCHERS = {  # what each launcher puts in its processes' environment (a world of 2 nodes x 3 processes)
    "fabric run": {"LT_CLI_USED": "1", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "6"},
    "torchrun": {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "6"},
    "SLURM": {"SLURM_NTASKS": "6", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "train"},
    None: {"SLURM_NTASKS": "6", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "bash"},  # an interactive allocation
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_the_world_shape_is_the_launchers_or_the_scripts_own(monkeypatch, launcher) -> None:
    for name in ("LT_CLI_USED", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in LAUNCHERS[launcher].items():
        monkeypatch.setenv(name, value)
    assert launched_by() == launcher
    expected = (3, 2) if launcher is not None else (4, 1)  # the script's own --devices 4 when no launcher
    assert world_shape(devices=4, num_nodes=1) == expected
