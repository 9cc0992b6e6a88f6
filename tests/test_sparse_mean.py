"""The sparse round's exchange (issue 68): :class:`SparseMean` sends each rank's top entries of its payload plus its
error-feedback accumulator; every rank gets bitwise the same mean; the bytes are counted from the messages sent; the
accumulator keeps exactly what was not sent, survives a failed round untouched and resumes from a checkpoint; a
payload or a size no rank could send is refused on every rank alike."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_multimodel.comm import collectives, sparse, sparse_mean
from fabric_multimodel.comm.sparse import encode
from fabric_multimodel.comm.sparse_mean import SparseMean
from tests.worlds import World

HEADER = 13  # a round header's slots per rank


def _counted_round(fabric: object, numel: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int, list]:
    """One sparse mean on this rank, its two all-gathers counted: (mean, what this rank sent, traffic, calls)."""
    rank = dist.get_rank()
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed + rank))
    sent = encode(values, 4096, 1 / 64)[1]  # what decoding its payload gives (tests/test_sparse.py)
    calls: list = []
    originals = {name: getattr(collectives, name) for name in ("all_gather_messages", "all_gather_single")}

    def counting(name: str):  # type: ignore[no-untyped-def]
        def call(output: torch.Tensor, message: torch.Tensor, **kwargs: object) -> object:
            calls.append((name, message.numel() * message.element_size()))
            return originals[name](output, message, **kwargs)

        return call

    for name in originals:
        setattr(collectives, name, counting(name))
    mean = SparseMean(numel, 1 / 64, "cpu")
    payload = values.clone()
    try:
        mean.all_reduce_mean(payload)
    finally:
        for name, original in originals.items():
            setattr(collectives, name, original)
    return payload, sent, mean.traffic.bytes, calls


def test_a_sparse_round_of_four_ranks_sends_a_hundredth_of_a_ring_allreduce_and_agrees_bitwise() -> None:
    """The issue's round: 4 ranks, 65,536 values, density 1/64: what each rank sends, counted from its two
    all-gathers (each reaches the 3 other ranks), is at most 1/100 of an fp32 ring allreduce's bytes per rank; every
    rank holds bitwise the same mean, the mean of what the payloads decode to, which points toward the exact mean."""
    numel, seed, world = 65_536, 3, 4
    ranks = World(world)
    try:
        results = ranks.run(_counted_round, numel, seed)
    finally:
        ranks.close()
    means = [mean for mean, _, _, _ in results]
    assert all(torch.equal(mean, means[0]) for mean in means)
    assert torch.equal(means[0], torch.stack([sent for _, sent, _, _ in results]).sum(0) / world)
    ring = 2 * (world - 1) / world * 4 * numel
    for _, _, traffic, calls in results:
        assert [name for name, _ in calls] == ["all_gather_single", "all_gather_messages"]
        counted = (world - 1) * sum(size for _, size in calls)
        assert counted == traffic <= ring / 100, (counted, ring)
    exact = torch.stack([torch.randn(numel, generator=torch.Generator().manual_seed(seed + r)) for r in range(world)])
    cosine = torch.nn.functional.cosine_similarity(means[0], exact.mean(0), dim=0)
    assert cosine > 0.2, cosine


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 5000),
    st.sampled_from([64, 512, 4096]),
    st.floats(1e-3, 1.0),
    st.floats(0.0, 1.0),
    st.integers(0, 2**31 - 1),
)
def test_the_accumulator_keeps_exactly_what_was_not_sent(numel: int, chunk: int, density: float, decay: float,
                                                          seed: int) -> None:  # fmt: skip
    """One rank: the mean is what it sent, and accumulator + sent == payload + decay * accumulator before, for
    round after round; the exact channel comes back as it went."""
    generator = torch.Generator().manual_seed(seed)
    mean = SparseMean(numel, density, "cpu", chunk=chunk, exact_numel=HEADER, decay=decay)
    before = torch.zeros(numel)
    for _ in range(3):
        values = torch.randn(numel, generator=generator)
        payload, head = values.clone(), torch.arange(HEADER, dtype=torch.float32)
        mean.all_reduce_mean(payload, head)
        after = mean.state_dict()["residual"]
        torch.testing.assert_close(after + payload, values + decay * before, rtol=0, atol=1e-5)
        assert int((payload != 0).sum()) <= sparse.per_chunk(chunk, density) * -(-numel // chunk)
        assert torch.equal(head, torch.arange(HEADER, dtype=torch.float32))
        before = after


def test_the_accumulator_resumes_exactly_and_is_refused_when_it_does_not_fit() -> None:
    values = torch.randn(3000, generator=torch.Generator().manual_seed(1))
    first, second = SparseMean(3000, 0.05, "cpu", chunk=500), SparseMean(3000, 0.05, "cpu", chunk=500)
    first.all_reduce_mean(values.clone())
    second.load_state_dict(first.state_dict())
    a, b = values.clone(), values.clone()
    first.all_reduce_mean(a)
    second.all_reduce_mean(b)
    assert torch.equal(a, b) and torch.equal(first.state_dict()["residual"], second.state_dict()["residual"])
    with pytest.raises(ValueError, match="`residual` must be a tensor of 3000"):
        second.load_state_dict({"residual": torch.zeros(10)})
    second.clear_residual()
    assert not second.state_dict()["residual"].any()


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: SparseMean(0, 0.1, "cpu"), "`numel`"),
        (lambda: SparseMean(10, 0.0, "cpu"), "`density`"),
        (lambda: SparseMean(10, 0.1, "cpu", chunk=0), "`chunk`"),
        (lambda: SparseMean(10, 0.1, "cpu", decay=1.5), "`decay`"),
        (lambda: SparseMean(10, 0.1, "cpu").start(torch.zeros(9)), "payload"),
        (lambda: SparseMean(10, 0.1, "cpu", exact_numel=2).start(torch.zeros(10)), "`exact` is required"),
        (lambda: SparseMean(10, 0.1, "cpu").exchange(), "no round was started"),
        (lambda: SparseMean(10, 0.1, "cpu").finish(), "no round in flight"),
    ],
)
def test_bad_arguments_and_misordered_phases_name_themselves(call: object, named: str) -> None:
    with pytest.raises((ValueError, RuntimeError, TypeError), match=named):
        call()  # type: ignore[operator]


def _inf_on_rank_one(fabric: object) -> tuple[list[int], list[float], bool]:
    rank = dist.get_rank()
    values = torch.ones(1000)
    if rank == 1:
        values[[7, 950]] = torch.tensor([float("inf"), 1e6])  # chunks 0 and 9 (1e6 is beyond float16's scales)
    mean = SparseMean(1000, 0.1, "cpu", chunk=100, exact_numel=2)
    head = torch.tensor([float(rank), 1.0])
    mean.all_reduce_mean(values, head)
    chunks = torch.isnan(values).view(10, 100)
    assert (chunks.all(1) | ~chunks.any(1)).all()  # whole chunks
    return (
        chunks.all(1).nonzero().view(-1).tolist(),
        head.tolist(),
        bool(torch.isfinite(mean.state_dict()["residual"]).all()),
    )


def test_a_non_finite_accumulator_on_one_rank_gives_every_rank_nan_in_its_chunks_and_the_exact_sum(worlds) -> None:
    for rank, (chunks, head, finite) in enumerate(worlds(2).run(_inf_on_rank_one)):
        assert chunks == [0, 9] and head == [1.0, 2.0]
        assert finite == (rank == 0)  # the round's rollback clears it (rounds/delta.py)


def _hostile(fabric: object, what: str) -> str:
    """Rank 1 announces or sends what no rank's SparseMean makes; every rank's error."""
    rank = dist.get_rank()
    mean = SparseMean(20_000, 1 / 64, "cpu")
    original = sparse.encode
    if rank == 1:

        def tampered(values, chunk, density):  # type: ignore[no-untyped-def]
            payload, sent = original(values, chunk, density)
            if what == "size":
                return torch.zeros(payload.numel() * 3, dtype=torch.uint8), sent
            return torch.zeros_like(payload), sent  # scales of zero, then no gap ends: not a payload

        sparse_mean.encode = tampered
    try:
        mean.all_reduce_mean(torch.randn(20_000))
    except ValueError as error:
        return str(error)
    finally:
        sparse_mean.encode = original
    return "no error"


@pytest.mark.parametrize(("what", "message"), [("size", "announced a payload of"), ("payload", "sparse.decode")])
def test_a_payload_no_rank_could_send_is_refused_on_every_rank_alike(worlds, what: str, message: str) -> None:
    errors = worlds(2).run(_hostile, what)
    assert errors[0] == errors[1] and message in errors[0], errors


class _FailingWait:
    """A work handle that waits for the real collective (the ranks stay in step), then fails like a lost peer."""

    def __init__(self, handle: object) -> None:
        self.handle = handle

    def wait(self) -> None:
        self.handle.wait()  # type: ignore[attr-defined]
        raise RuntimeError("Connection reset by peer (simulated)")

    def is_completed(self) -> bool:
        return True


def _failing_round(fabric: object, name: str) -> tuple[str, bool, bool]:
    """``collectives.<name>`` fails at its wait on every rank: the error, whether the accumulator is as it was, and
    whether a round after it works."""
    mean = SparseMean(5000, 0.02, "cpu")
    mean.all_reduce_mean(torch.randn(5000, generator=torch.Generator().manual_seed(dist.get_rank())))
    kept = mean.state_dict()["residual"]
    original = getattr(collectives, name)
    setattr(collectives, name, lambda *args, **kwargs: _FailingWait(original(*args, **kwargs)))
    try:
        mean.all_reduce_mean(torch.randn(5000))
        error = "no error"
    except RuntimeError as raised:
        error = str(raised)
    finally:
        setattr(collectives, name, original)
    untouched = torch.equal(mean.state_dict()["residual"], kept)
    mean.all_reduce_mean(torch.randn(5000))
    return error, untouched, not mean.pending


@pytest.mark.parametrize("name", ["all_gather_single", "all_gather_messages"])
def test_a_failed_round_leaves_the_accumulator_as_it_was_and_the_object_idle(worlds, name: str) -> None:
    for error, untouched, idle in worlds(2).run(_failing_round, name):
        assert "(simulated)" in error and untouched and idle
