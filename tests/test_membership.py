"""Live membership: sites (processes with no world in common) that agree through a coordinator on who trains
together, lose a site and admit one with no restart, and end with identical models."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_multimodel import Averager
from fabric_multimodel.comm.collectives import POLL_S, wait_all
from fabric_multimodel.membership.decisions import Decision
from fabric_multimodel.membership.epoch import RunEnded
from fabric_multimodel.membership.membership import NAMELESS, Membership
from fabric_multimodel.membership.names import MAX_SITE_NAME, check_site_name, site_of
from fabric_multimodel.membership.stores import coordinator_store
from fabric_multimodel.run.launch import free_port, process_context
from tests.membership_sites import averaging_site, counting_site

_runs = itertools.count()


@pytest.fixture(scope="module")
def coordinator() -> Iterator[str]:
    """The coordinator, started as a user starts it; it must stop on SIGTERM."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric_multimodel.coordinator", "--port", str(port)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert "serving on port" in proc.stdout.readline()
    yield f"127.0.0.1:{port}"
    proc.terminate()
    assert proc.wait(timeout=10) == 0


def _start(target: Any, address: str, name: str, plan: dict[str, Any], queue: Any) -> Any:
    proc = process_context().Process(target=target, args=(address, name, plan, queue), daemon=True)
    proc.start()
    return proc


def _run_sites(
    target: Any,
    address: str,
    plans: dict[str, dict[str, Any]],
    joiner: tuple[str, dict[str, Any]],
    lost: str,
    processes: int = 1,
    ghost: bool = False,
    on_registered: Callable[[], None] = lambda: None,
    nameless: bool = False,
) -> dict[str, Any]:
    """Start the sites of ``plans`` one after the other, each once the one before has registered (so that the first
    is rank 0 of the first epoch); once ``lost`` reported its last round, start ``joiner``; collect every report
    (``processes`` per site: each site a gloo world of its own, its process i > 0 reporting as ``name/i``). With
    ``ghost``, a site registers once the others did and never beats (it died waiting): ``reports["ghost"]`` is
    what its ``admit/`` key says at the end. ``on_registered()`` is called once every site of ``plans`` registered.
    With ``nameless``, a registration then takes its number and never writes its name (its site died registering):
    ``reports["nameless"]`` is what its ``join/`` key says at the end."""
    queue = process_context().Queue()
    run = next(iter(plans.values()))["run"]
    coordinator = coordinator_store(address, timeout=60)  # held: the prefix does not keep an etcd store alive
    store = dist.PrefixStore(f"{run}/", coordinator)
    procs = []

    def start(name: str, plan: dict[str, Any]) -> None:
        site = {"site_port": free_port(), "processes": processes} if processes > 1 else {}
        for local_rank in range(processes):
            procs.append(_start(target, address, name, {**plan, **site, "local_rank": local_rank}, queue))

    for registered, (name, plan) in enumerate(plans.items(), start=1):
        start(name, plan)
        deadline = time.monotonic() + 60
        while store.add("joins", 0) < registered and time.monotonic() < deadline:
            time.sleep(0.02)
    on_registered()
    if ghost:
        number = store.add("joins", 1)
        store.set(f"join/{number}", f"ghost#{number}")
    if nameless:
        unnamed = store.add("joins", 1)
    reports: dict[str, Any] = {}
    try:
        while lost not in reports:
            name, report, waited = queue.get(timeout=60)
            reports[name] = (report, waited)
        start(*joiner)
        while len(reports) < (len(plans) + 1) * processes:
            name, report, waited = queue.get(timeout=90)
            reports[name] = (report, waited)
        for proc in procs:
            proc.join(timeout=30)
            assert proc.exitcode == 0, f"a site exited with {proc.exitcode}"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    if ghost:
        key = f"admit/ghost#{number}"
        reports["ghost"] = store.get(key).decode() if store.check([key]) else None
    if nameless:
        reports["nameless"] = store.get(f"join/{unnamed}").decode() if store.check([f"join/{unnamed}"]) else None
    return reports


def test_sites_agree_on_each_epoch_through_a_loss_and_a_join(coordinator: str) -> None:
    """Site a, the first to register and so rank 0 of the first epoch, is lost; then d registers. Before that, a
    site registers and dies before it is admitted (it never beats): it is passed over, and no one waits the group's
    timeout for it; and one takes its number and dies before it writes its name: passed over too, and the site after
    it is admitted. (The live LM run in test_sites.py loses another rank, where a survivor waits on the other
    survivor: the abandoned wait.)"""
    lost = "a"
    run = f"count{next(_runs)}"
    values = {"a": 1.0, "b": 2.0, "c": 4.0}
    plans = {
        name: {"run": run, "rounds": 120, "min_sites": 3, "value": value, "die_after": 10 if name == lost else None}
        for name, value in values.items()
    }
    joiner = ("d", {"run": run, "rounds": 120, "value": 8.0})
    reports = _run_sites(counting_site, coordinator, plans, joiner, lost, ghost=True, nameless=True)
    assert reports.pop("ghost") == "gone"  # told so, had it still been waiting
    assert reports.pop("nameless") == NAMELESS  # passed over: should its name still come, it registers again

    survivors = sorted(set(values) - {lost})
    lost_rounds, _ = reports[lost]
    assert {(e, s, t) for e, s, t in lost_rounds} == {(1, ("a", "b", "c"), 7.0)}  # a, b, c: in the order they came
    for name in survivors:
        rounds, waited = reports[name]
        epochs = [k for k, _ in itertools.groupby((e, tuple(sorted(s)), t) for e, s, t in rounds)]
        kept = sum(values[s] for s in survivors)
        # d is admitted at a round boundary, or with the survivors' recovery when it registered before that
        assert epochs in (
            [(1, ("a", "b", "c"), 7.0), (2, tuple(survivors), kept), (3, (*survivors, "d"), kept + 8.0)],
            [(1, ("a", "b", "c"), 7.0), (2, (*survivors, "d"), kept + 8.0)],
        )
        assert len(rounds) == 120  # every round was done once, none twice: the lost one was redone
        assert waited < 5.0, f"{name} waited {waited:.1f} s on membership"
        # the epoch after the loss keeps the members' order: the oldest one left is its rank 0
        assert rounds[-1][1] == tuple(s for s in rounds[0][1] if s != lost) + ("d",)
    joined, _ = reports["d"]
    assert joined and {(e, t) for e, _, t in joined} == {(epochs[-1][0], kept + 8.0)}


def _diloco(**options: Any) -> dict[str, Any]:
    return {"period": 8, "warmup_steps": 0, "outer_lr": 0.7, **options}


@pytest.mark.slow
def test_a_lost_site_and_a_joining_one_cost_no_restart_and_every_site_ends_identical(coordinator: str) -> None:
    """Blocking fp32 DiLoCo rounds, which without a membership would send from the parameters' own storage (streaming
    fp8 rounds: the LM example in test_sites.py, with --launcher live), averaging the inner SGD's momentum too."""
    options = _diloco()
    run = f"avg{next(_runs)}"
    common = {"run": run, "steps": 240, "options": options, "step_s": 0.01, "momentum": 0.9}
    plans = {name: {**common, "min_sites": 3, "die_at": 40 if name == "a" else None} for name in "abc"}
    # d's state arrives 2 s late (a slow link); what d sends in its first round must weigh nothing (x100 here)
    joiner = ("d", {**common, "receive_delay_s": 2.0, "poison": True})
    reports = _run_sites(averaging_site, coordinator, plans, joiner, "a")

    finished = {name: report for name, (report, _) in reports.items() if name != "a"}
    assert reports["a"][0]["epochs"] == [(1, reports["a"][0]["epochs"][0][1])]
    assert len({r["params"] for r in finished.values()}) == 1, "the sites left the block with different models"
    assert len({r["optimizer"] for r in finished.values()}) == 1, "the sites' momentum differs after the last round"
    for name, r in finished.items():
        assert r["steps"] == 240
        assert r["wait_s"] < 5.0, f"{name} waited {r['wait_s']:.1f} s on membership"
    (entered,) = finished["d"]["starts"]
    assert entered["seconds"] >= 2.0 and entered["state_bytes"] > 0
    assert finished["d"]["transfers"][-1] == (entered["state_bytes"],) * 2  # its progress, to the last byte
    assert not finished["b"]["transfers"] and not finished["c"]["transfers"]  # they received nothing
    for name in "bc":  # the state crossed while they trained on: entering d's epoch took them no 2 s
        (entry,) = [s for s in finished[name]["starts"] if s["epoch"] == entered["epoch"]]
        assert entry["seconds"] < 1.0, f"{name} took {entry['seconds']:.2f} s to enter the epoch d joined"
        # below the first steps' loss (about 20): weighed in, d's first round took it past 800
        assert finished[name]["worst"] < 100, f"{name}'s loss reached {finished[name]['worst']:.0f} once d joined"
    for name in "bc":
        epochs = [(e, tuple(sorted(s))) for e, s in finished[name]["epochs"]]
        assert epochs in (  # d admitted at a round boundary, or with the recovery when it registered before it
            [(1, ("a", "b", "c")), (2, ("b", "c")), (3, ("b", "c", "d"))],
            [(1, ("a", "b", "c")), (2, ("b", "c", "d"))],
        )
        starts = finished[name]["starts"]
        assert [s["epoch"] for s in starts] == [e for e, _ in epochs]
        assert starts[0].get("broadcast", 0) >= 1  # the sites began from their own seeds: the first member's values
        # every later start: the agreement check and the one all-gather of where every member is; the state goes to
        # the new site alone, point to point, and nothing is broadcast
        for start in starts[1:]:
            assert start.get("all_reduce") == 1 and sum(v for k, v in start.items() if "gather" in k) == 1
            assert "broadcast" not in start
    assert [e for e, _ in finished["d"]["epochs"]] == [epochs[-1][0]]


@pytest.mark.slow
def test_sites_train_on_through_an_etcd_cluster_that_loses_a_member(etcd: tuple[str, list[Any]]) -> None:
    """The agreement kept in an etcd cluster of three: the member every site asks first is killed once the sites
    registered, and the sites still lose one of theirs and admit another (etcd goes on with two of three), and end
    with the same model."""
    address, members = etcd
    run = f"etcd{next(_runs)}"
    common = {"run": run, "steps": 240, "options": _diloco(), "step_s": 0.01, "momentum": 0.9}
    plans = {name: {**common, "min_sites": 3, "die_at": 40 if name == "a" else None} for name in "abc"}

    def lose_a_member() -> None:
        members[0].kill()
        members[0].wait(timeout=10)

    reports = _run_sites(averaging_site, address, plans, ("d", common), "a", on_registered=lose_a_member)
    assert members[0].poll() is not None
    finished = {name: report for name, (report, _) in reports.items() if name != "a"}
    assert len({r["params"] for r in finished.values()}) == 1, "the sites left the block with different models"
    assert all(r["steps"] == 240 for r in finished.values())
    for name in "bc":
        epochs = [(e, tuple(sorted(s))) for e, s in finished[name]["epochs"]]
        assert epochs[0] == (1, ("a", "b", "c")) and epochs[-1][1] == ("b", "c", "d"), epochs


@pytest.mark.slow
def test_paced_sites_agree_their_pace_again_when_a_site_leaves_and_when_one_joins(coordinator: str) -> None:
    """pace="speed": c (and later d) steps three times slower than a and b, so runs a third of their steps per
    round. a is lost, d joins: each epoch agrees the pace again among its members, d running the fastest site's
    steps until it timed its own; every site ends at the same round with the same model and momentum."""
    fast_s, slow_s, total = 0.01, 0.03, 300
    options = _diloco(period=12, warmup_steps=8, pace="speed")
    run = f"paced{next(_runs)}"
    common = {"run": run, "steps": total, "options": options, "momentum": 0.9}
    step_s = {"a": fast_s, "b": fast_s, "c": slow_s}
    plans = {
        name: {**common, "min_sites": 3, "step_s": s, "die_at": 60 if name == "a" else None}
        for name, s in step_s.items()
    }
    joiner = ("d", {**common, "step_s": slow_s})
    reports = _run_sites(averaging_site, coordinator, plans, joiner, "a")

    finished = {name: report for name, (report, _) in reports.items() if name != "a"}
    assert len({r["params"] for r in finished.values()}) == 1, "the sites left the block with different models"
    assert len({r["optimizer"] for r in finished.values()}) == 1, "the sites' momentum differs after the last round"
    assert len({r["rounds"] for r in finished.values()}) == 1, {n: r["rounds"] for n, r in finished.items()}
    b, c, d = finished["b"], finished["c"], finished["d"]
    assert [s for _, s in b["epochs"]][-1] == ("b", "c", "d")
    assert b["pace"] == c["pace"] == d["pace"]
    # b steps fastest; d timed its steps, about three times b's (the ratio moves on loaded cores), and runs fewer
    fastest, *slow = b["pace"]
    assert fastest == 12 and all(period < 12 for period in slow), b["pace"]
    assert c["steps"] < b["steps"] and d["steps"] <= b["steps"], (b["steps"], c["steps"], d["steps"])
    for name, r in finished.items():
        assert r["worst"] < 100, f"{name}'s loss reached {r['worst']:.0f}"
        assert r["wait_s"] < 5.0, f"{name} waited {r['wait_s']:.1f} s on membership"


@pytest.mark.slow
@pytest.mark.parametrize("inside", ["ddp", "fsdp2"])
def test_sites_of_two_processes_lose_a_site_and_take_one_in_as_one(coordinator: str, inside: str) -> None:
    """Sites of two processes (islands: DDP inside each, each process sending half of a streaming fp8 round with
    error feedback across in a group of its own; or FSDP2, each process its shard), with the period chosen at the end
    of warm-up, lose the first site and admit a new one; every process ends as its peers (islands: all four
    identical; FSDP2: each shard as the other site's) with the same period, and the new site's state crosses the link
    once (islands: to its process 0), not once per process."""
    fp8 = {"comm_dtype": torch.float8_e4m3fn, "error_feedback": True}
    options = _diloco(period="auto", warmup_steps=4, fragments=2, overlap_steps=2, **fp8)
    run = f"{inside}{next(_runs)}"
    common = {"run": run, "steps": 160, "options": options, "step_s": 0.01, "shard": inside == "fsdp2"}
    plans = {name: {**common, "min_sites": 2, "die_at": 40 if name == "a" else None} for name in "ab"}
    reports = _run_sites(averaging_site, coordinator, plans, ("c", common), "a", processes=2)

    finished = {name: report for name, (report, _) in reports.items() if not name.startswith("a")}
    assert sorted(finished) == ["b", "b/1", "c", "c/1"]
    if inside == "fsdp2":  # shard i of each site alike; the two shards differ
        assert finished["b"]["params"] == finished["c"]["params"] != finished["b/1"]["params"]
        assert finished["b/1"]["params"] == finished["c/1"]["params"]
    else:
        assert len({r["params"] for r in finished.values()}) == 1, "the processes left the block with different models"
    assert len({r["period"] for r in finished.values()}) == 1 and finished["c"]["period"] >= 6  # shortest: 2 x (2 + 1)
    for name, r in finished.items():
        assert r["steps"] == 160
        assert r["wait_s"] < 5.0, f"{name} waited {r['wait_s']:.1f} s on membership"
    epochs = [(e, tuple(sorted(s))) for e, s in finished["b"]["epochs"]]
    assert epochs in ([(1, ("a", "b")), (2, ("b",)), (3, ("b", "c"))], [(1, ("a", "b")), (2, ("b", "c"))])
    assert finished["b/1"]["epochs"] == finished["b"]["epochs"]  # a site moves as one
    sites_in = dict(finished["b"]["epochs"])
    for name in ("b", "b/1"):  # per later start: the agreement across (with a site to agree with), one all-gather,
        for start in finished[name]["starts"][1:]:  # the site's agreement
            across = len(sites_in[start["epoch"]]) > 1
            assert start.get("all_reduce") == 1 + across and sum(v for k, v in start.items() if "gather" in k) == 1
            assert "broadcast" not in start
    joined = {name: finished[name]["starts"] for name in ("c", "c/1")}
    assert [s["epoch"] for s in joined["c"]] == [s["epoch"] for s in joined["c/1"]] == [epochs[-1][0]]
    if inside == "fsdp2":  # each process received its own shards' state, about half of the model's each
        assert joined["c"][0]["state_bytes"] > 0 and joined["c/1"][0]["state_bytes"] > 0
    else:
        assert joined["c"][0]["state_bytes"] > 0 and joined["c/1"][0]["state_bytes"] == 0  # the state crossed once


def test_a_site_that_comes_after_the_run_finished_is_told_so_at_once(coordinator: str) -> None:
    run = f"ended{next(_runs)}"
    first = Membership(coordinator, "a", run=run, timeout=5.0)
    assert first.join().sites == ("a",)
    late = Membership(coordinator, "b", run=run, timeout=5.0)
    first.close(finished=True)
    with pytest.raises(RunEnded, match="finished before site 'b' was admitted"):
        late.join()  # it would wait for admission forever otherwise
    late.close()


def test_an_averager_refuses_what_membership_cannot_take_before_the_site_registers(coordinator: str) -> None:
    run = f"refused{next(_runs)}"
    host, port = coordinator.rsplit(":", 1)
    store = dist.PrefixStore(f"{run}/", dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False))
    membership = Membership(coordinator, "a", run=run, timeout=5.0)
    model = torch.nn.Linear(2, 2)
    for options, named in (
        ({"period": 4, "node_period": 2}, "`node_group` or `node_period`"),
        ({"period": 4, "process_group": object()}, "a `process_group`"),
    ):
        with pytest.raises(ValueError, match=f"`membership` does not take {named}"):
            Averager(torch.device("cpu"), model, membership=membership, **options)
    assert store.add("joins", 0) == 0  # nobody registered
    membership.close()


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"coordinator": "nohost", "site": "a"}, "coordinator"),
        ({"coordinator": "etcd://h1:2379,h2", "site": "a"}, "coordinator"),
        ({"coordinator": "127.0.0.1:1", "site": "a#1"}, "site"),
        ({"coordinator": "127.0.0.1:1", "site": "a", "min_sites": 0}, "min_sites"),
        ({"coordinator": "127.0.0.1:1", "site": "a", "timeout": -1}, "timeout"),
        ({"coordinator": "127.0.0.1:1", "site": "a", "min_sites": 3, "max_sites": 2}, "min_sites"),
    ],
)
def test_membership_names_the_argument_it_refuses(arguments: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=f"`{named}`"):
        Membership(**arguments)


def test_a_token_names_its_site() -> None:
    assert site_of("berlin#12") == "berlin"


names = st.text(alphabet=st.characters(blacklist_characters="#,|", blacklist_categories=("Cs",)), min_size=1)


@given(members=st.lists(st.tuples(names, st.integers(1, 10**6)), unique=True), seen=st.integers(0, 10**6))
def test_a_decision_reads_back_as_written(members: list[tuple[str, int]], seen: int) -> None:
    """What the store holds for an epoch: its members' tokens and the registrations it has seen, exactly."""
    decision = Decision(tuple(f"{site}#{n}" for site, n in members), seen)
    assert Decision.decode(decision.encode().encode()) == decision
    assert [site_of(token) for token in decision.members] == [site for site, _ in members]


class _Pending:
    """A collective's handle that finishes after ``polls`` looks (or never), as gloo's does while a peer is away."""

    def __init__(self, polls: int | None) -> None:
        self.polls, self.waited = polls, False

    def is_completed(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def wait(self) -> bool:
        self.waited = True
        return True


@settings(max_examples=6)  # each example waits up to a few POLL_S
@given(polls=st.integers(0, 10), told_after=st.integers(0, 2))
def test_a_wait_ends_when_its_collective_does_or_once_told_to_abandon_it(polls: int, told_after: int) -> None:
    """wait_all asks ``abandon`` only while a handle is unfinished, at most every POLL_S, and then stops waiting."""
    asked = []

    def abandon() -> bool:
        asked.append(time.monotonic())
        return len(asked) > told_after

    done = _Pending(polls)
    wait_all([done], lambda: False)  # however long it takes, a wait nobody abandons ends with its collective
    assert done.waited
    stuck = _Pending(None)
    start = time.monotonic()
    asked.clear()
    with pytest.raises(RuntimeError, match="abandoned"):
        wait_all([stuck], abandon)
    assert not stuck.waited and len(asked) == told_after + 1
    assert time.monotonic() - start >= told_after * POLL_S
    assert all(b - a >= POLL_S * 0.9 for a, b in itertools.pairwise(asked))


NAME_CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"


@given(st.text(alphabet=NAME_CHARACTERS, min_size=1, max_size=MAX_SITE_NAME))
def test_a_site_name_of_the_allowed_characters_is_taken_as_it_is(name: str) -> None:
    if name[0] in "._-":
        with pytest.raises(ValueError, match="starting with a letter or digit"):
            check_site_name(name)
    else:
        assert check_site_name(name) == name and site_of(f"{name}#3") == name


@given(st.one_of(st.text(max_size=3 * MAX_SITE_NAME), st.binary(max_size=8), st.integers(), st.none()))
def test_any_other_site_name_is_one_line_that_names_the_rule_before_the_store_is_reached(name: object) -> None:
    valid = isinstance(name, str) and bool(name) and len(name) <= MAX_SITE_NAME and name[0] not in "._-"
    if valid and all(c in NAME_CHARACTERS for c in name):  # type: ignore[union-attr]
        return
    with pytest.raises(ValueError) as refused:
        Membership("127.0.0.1:1", name, timeout=0.1)  # type: ignore[arg-type]  # port 1: nothing is reached
    message = str(refused.value)
    assert "`site`" in message and f"1 to {MAX_SITE_NAME} letters" in message and "\n" not in message
    assert len(message) < 400  # a 10,000-character name is shown cut


def test_a_ten_thousand_character_site_name_is_refused_by_the_flags_too(capsys: pytest.CaptureFixture[str]) -> None:
    from fabric_multimodel.run.cli import Parser, add_membership_arguments, check_membership_arguments

    parser = Parser("train.py", "a script")
    parser.add_argument("--period", type=int, default=8)
    add_membership_arguments(parser)
    args = parser.parse_args(["--coordinator", "127.0.0.1:1", "--site", "x" * 10_000])
    with pytest.raises(SystemExit):
        check_membership_arguments(parser, args)
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "--site NAME" in error and "10000 characters" in error


def test_the_first_epoch_forms_past_a_registration_that_never_wrote_its_name(coordinator: str) -> None:
    """The run's first registration takes its number and dies before it writes its name; the two sites after it form
    the first epoch without it (min_sites=2) once it stood nameless for 3 heartbeats, and train to the end."""
    run = f"count{next(_runs)}"
    store = dist.PrefixStore(f"{run}/", coordinator_store(coordinator, timeout=60))
    assert store.add("joins", 1) == 1  # and no name
    queue = process_context().Queue()
    plans = {
        name: {"run": run, "rounds": 20, "min_sites": 2, "value": value} for name, value in (("a", 1.0), ("b", 2.0))
    }
    procs = [_start(counting_site, coordinator, name, plan, queue) for name, plan in plans.items()]
    try:
        reports = dict(queue.get(timeout=60)[:2] for _ in procs)
        for proc in procs:
            proc.join(timeout=30)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    assert store.get("join/1").decode() == NAMELESS
    for rounds in reports.values():
        assert len(rounds) == 20 and {(e, tuple(sorted(s)), t) for e, s, t in rounds} == {(1, ("a", "b"), 3.0)}
