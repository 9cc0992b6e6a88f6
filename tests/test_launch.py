"""fabric_multimodel.launch: worlds' processes come from one fork server that imported torch and Lightning once."""

from __future__ import annotations

import os

from fabric_multimodel.launch import run_world


def origin(fabric) -> tuple[int, int]:
    """This rank's parent process, and its rank."""
    return os.getppid(), fabric.global_rank


def test_world_processes_are_forked_from_one_preloaded_server():
    first, second = run_world(2, origin, timeout=120), run_world(2, origin, timeout=120)
    parents = {parent for parent, _ in first + second}
    assert len(parents) == 1 and os.getpid() not in parents, (first, second)  # spawn: this process, every time
    assert [rank for _, rank in first] == [0, 1]
