"""Two nodes of two processes, simulated on this machine: two `fabric run` launchers, one per node.

One launch runs every scenario of tests/multinode_task.py (the groups, the islands layout plain and
DiLoCo, two-level averaging, a resume, bad layouts); the tests read what each rank wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fabric_multimodel.rounds.header import Header
from fabric_multimodel.run.launch import free_port, stop_process_tree

ROOT = Path(__file__).resolve().parents[1]
FABRIC = Path(sys.executable).parent / "fabric"
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("multinode")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LT_")}
    launchers = []
    logs = []
    for node in (0, 1):
        log = (out / f"node{node}.log").open("w")
        cmd = [
            str(FABRIC), "run", "--accelerator", "cpu", "--num-nodes", "2", "--node-rank", str(node), "--devices", "2",
            "--main-address", "127.0.0.1", "--main-port", str(port), "tests/multinode_task.py", "--out", str(out),
        ]  # fmt: skip
        launchers.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    try:
        for launcher in launchers:
            launcher.wait(timeout=TIMEOUT_S)
    finally:
        for launcher in launchers:
            stop_process_tree(launcher, grace_s=5)  # always: a failed node must not leave ranks behind
        for log in logs:
            log.close()
    report = "\n".join((out / f"node{node}.log").read_text()[-3000:] for node in (0, 1))
    assert all(launcher.returncode == 0 for launcher in launchers), report
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]


def test_groups_are_the_node_and_the_same_local_rank_across_nodes(ranks):
    for r in ranks:
        assert r["node_rank"] == r["rank"] // 2 and r["local_rank"] == r["rank"] % 2
        assert r["node"] == [2 * r["node_rank"], 2 * r["node_rank"] + 1]
        assert r["across"] == [r["local_rank"], r["local_rank"] + 2]


def halves(elements: int) -> list[int]:
    """What the first and the second process of a node send of a payload: its first half, and the rest."""
    return [elements // 2, elements - elements // 2]


@pytest.mark.parametrize("layout", ["islands", "islands-diloco"])
def test_islands_keep_each_node_identical_every_step_and_all_after_rounds(ranks, layout):
    runs = [r["layouts"][layout] for r in ranks]
    assert all(run["islands"] for run in runs)
    steps = len(runs[0]["log"])
    for i in range(steps):
        entries = [run["log"][i] for run in runs]
        # DDP inside the node: the two processes of a node are bitwise identical at every step.
        assert entries[0]["params"] == entries[1]["params"] and entries[2]["params"] == entries[3]["params"]
        step = entries[0]["step"]
        scheduled = step > 2 and (step - 2) % 3 == 0  # warm-up (steps 1-2) sends nothing across nodes
        assert (entries[0]["round"] == "across") == scheduled, entries[0]
        if step <= 2:
            assert all(e["bytes"] == 0 for e in entries), entries[0]["bytes"]
        if scheduled and layout == "islands":  # a blocking round across nodes: all four identical
            assert len({e["params"] for e in entries}) == 1, i
        if not scheduled:  # between rounds (and in warm-up, from the same start) the nodes drift apart
            assert entries[0]["params"] != entries[2]["params"], i
    assert len({run["final"] for run in runs}) == 1  # leaving the block: every replica identical
    # Bytes across nodes: each round sends the parameters and a header of 2 ranks, in fp32, split between
    # the node's two processes (each sends its half; they exchange the halves inside the node). Step 14
    # was a round, so the plain layout's exit round changes nothing (not counted) but is sent; the
    # overlapped one still had its last round's local progress to average.
    header = Header.SLOTS * 2
    for node in (runs[:2], runs[2:]):
        sent_without_a_round = 1 if layout == "islands" else 0
        assert all(run["node_bytes"] == 0 for run in node)
        rounds = node[0]["rounds"] + sent_without_a_round
        assert [run["bytes"] for run in node] == [rounds * 4 * half for half in halves(node[0]["params"] + header)]


def test_islands_stream_fragments_warm_up_apart_and_start_with_a_plain_mean(ranks):
    runs = [r["layouts"]["islands-fragments"] for r in ranks]
    # Two fragments (the first Linear's weight, then the rest), period 6: fragment 0 at local steps 3, 9,
    # fragment 1 at 6, 12; the warm-up (steps 1-2) sends nothing across nodes.
    first = {0: 5, 1: 8}  # the steps of each fragment's first round: a plain mean of the two nodes
    tensors_of = {0: [0], 1: [1, 2, 3]}
    header = Header.SLOTS * 2
    bytes_before = 0
    for i, entry in enumerate(runs[0]["log"]):
        step = entry["step"]
        fragment = {5: 0, 8: 1, 11: 0, 14: 1}.get(step)
        assert (entry["round"] == "across") == (fragment is not None), entry["step"]
        others = [run["log"][i] for run in runs]
        if step <= 2:
            assert all(e["bytes"] == 0 for e in others)
        if fragment is None:
            continue
        # The fragment's tensors are identical on all four ranks after its round; the others are not touched.
        for t in tensors_of[fragment]:
            assert len({e["tensors"][t] for e in others}) == 1, (step, t)
        sizes = [len(values) for values in entry["before"]]
        assert entry["bytes"] - bytes_before == 4 * halves(sum(sizes[t] for t in tensors_of[fragment]) + header)[0]
        bytes_before = entry["bytes"]
        if step == first[fragment]:  # no anchor is shared yet: the mean of the nodes, no outer step
            for t in tensors_of[fragment]:
                mean = [(a + b) / 2 for a, b in zip(others[0]["before"][t], others[2]["before"][t])]
                assert max(abs(x - y) for x, y in zip(entry["after"][t], mean)) < 1e-6
    assert len({run["final"] for run in runs}) == 1


def test_two_level_rounds_at_the_right_steps_with_the_right_group(ranks):
    runs = [r["layouts"]["two-level"] for r in ranks]
    assert not any(run["islands"] for run in runs)
    for i, entry in enumerate(runs[0]["log"]):
        step, local = entry["step"], entry["step"] - 2
        expected = None if local <= 0 else "across" if local % 6 == 0 else "node" if local % 2 == 0 else None
        assert entry["round"] == expected, entry
        fingerprints = [run["log"][i]["params"] for run in runs]
        if step <= 2 or expected == "across":  # warm-up (DDP over the world) or a world round
            assert len(set(fingerprints)) == 1, entry
        elif expected == "node":  # identical inside each node, not across
            assert fingerprints[0] == fingerprints[1] and fingerprints[2] == fingerprints[3]
            assert fingerprints[0] != fingerprints[2]
    # Bytes per level, exact: every round sends the parameters and its group's header (a slot per rank) in fp32.
    world, node = (4 * (runs[0]["params"] + Header.SLOTS * ranks) for ranks in (4, 2))
    for run in runs:
        assert run["node_rounds"] == 4  # local steps 2, 4, 8, 10 (6 and 12 are world rounds)
        assert run["rounds"] == 6  # and the exit round, after step 14's, changes nothing (sent, not counted)
        assert run["node_bytes"] == run["node_rounds"] * node
        assert run["bytes"] == run["node_bytes"] + (run["rounds"] - run["node_rounds"] + 1) * world


def test_resume_in_the_islands_layout_is_bitwise(ranks):
    assert all(r["resume"] for r in ranks)


def test_bad_layouts_are_clear_errors_on_every_rank(ranks):
    for r in ranks:
        bad = r["bad"]
        assert bad["still in step"] == 4
        assert "do not make 3 nodes of equal size" in bad["uneven nodes"]
        assert "must be a multiple of `node_period`" in bad["period not a multiple"]
        assert "switches DDP off after warm-up" in bad["islands with node_period"]
        assert "synchronises over ranks [0, 1, 2, 3]" in bad["DDP over the world, averaging across nodes"]
