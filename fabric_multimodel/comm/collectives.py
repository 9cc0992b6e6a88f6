"""The collective primitives every other module is built on.

Each function here issues a fixed, documented number of collectives, so callers (and tests) can
count exactly what an averaging round or a check costs. With no process group initialised, or a
group of one rank, they issue none.
"""

from __future__ import annotations

import hashlib
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

ProcessGroup = Optional["dist.ProcessGroup"]

#: Upper bound on the staging buffer used to coalesce small tensors into one allreduce.
DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024


#: The name of torch.distributed's all-gather into one tensor: ``all_gather_single`` from torch 2.13 on, which
#: deprecates ``all_gather_into_tensor`` (with a FutureWarning at every call), the older name before it.
ALL_GATHER_SINGLE = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup = None, async_op: bool = False
) -> dist.Work | None:
    """Every rank's ``input`` side by side in ``output`` (``world`` times its size): one all-gather, under the name
    this torch has for it (looked up at the call, so a test that wraps it counts it).

    Example::

        everyone = torch.zeros(dist.get_world_size())
        all_gather_single(everyone, torch.tensor([float(dist.get_rank())]))
    """
    return getattr(dist, ALL_GATHER_SINGLE)(output, input, group=group, async_op=async_op)


def all_to_all_messages(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup = None, async_op: bool = False
) -> Any:
    """Shard ``j`` of ``input`` to rank ``j``, and rank ``j``'s shard for this rank into shard ``j`` of ``output``
    (``world`` equal shards each): an all-to-all, sent as point-to-point messages on gloo (``_messages``),
    torch's ``all_to_all_single`` elsewhere. For payloads that cross a slow link.

    Example::

        received = torch.empty_like(shards)
        all_to_all_messages(received, shards)
    """
    world = group_size(group)
    pg = group if group is not None else dist.group.WORLD
    if world > 1 and pg is not None and _over_gloo(input, pg):
        return _messages(input.view(world, -1).__getitem__, output.view(world, -1), pg, async_op)
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)


def all_gather_messages(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup = None, async_op: bool = False
) -> Any:
    """Every rank's ``input`` side by side in ``output``: an all-gather, sent as point-to-point messages on gloo
    (``_messages``), :func:`all_gather_single` elsewhere. For payloads that cross a slow link.

    Example::

        everyone = torch.empty(world * shard.numel(), dtype=shard.dtype)
        all_gather_messages(everyone, shard)
    """
    world = group_size(group)
    pg = group if group is not None else dist.group.WORLD
    if world > 1 and pg is not None and _over_gloo(input, pg):
        return _messages(lambda peer: input.view(-1), output.view(world, -1), pg, async_op)
    return all_gather_single(output, input, group=group, async_op=async_op)


class Messages:
    """The point-to-point messages of one exchange (``_messages``) as one work handle.

    ``steps`` yields the work of each step in turn, posting the next step's messages once asked for it (after the
    last step's are done). Gloo's handles of messages say they are complete only once waited for, so a thread
    waits for them, and ``is_completed()`` asks whether it is done (:func:`wait_all` polls it between looks at
    whether to abandon).
    """

    def __init__(self, steps: Iterable[list[dist.Work]]) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._wait_for, args=(steps,), name="fmm-messages", daemon=True)
        self._thread.start()

    def _wait_for(self, steps: Iterable[list[dist.Work]]) -> None:
        try:
            for work in steps:
                for w in work:
                    w.wait()
        except BaseException as error:  # a lost peer: raised again by wait() in the caller's thread
            self._error = error

    def is_completed(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> bool:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return True


#: Per process group, its last exchange of messages; weakly, so that a group destroyed is freed then (a gloo group
#: freed at the interpreter's exit can abort it), not with this module.
_in_flight: weakref.WeakKeyDictionary[dist.ProcessGroup, Messages] = weakref.WeakKeyDictionary()


def _messages(
    piece_for: Callable[[int], torch.Tensor], into: torch.Tensor, pg: dist.ProcessGroup, async_op: bool
) -> Messages | None:
    """Row ``r`` of ``into`` <- what rank ``r`` sends this rank; this rank sends ``piece_for(p)`` to each peer
    ``p`` (ranks of ``pg``). Every receive is posted at once; the sends go in ``world - 1`` steps, to the next rank
    round, then the one after, each once the step before has been sent and received, so that each link carries one
    message each way at a time. Waited for unless ``async_op``; an exchange on a group whose last one is still in
    flight waits for that one first (every rank then posts the messages of both in the same order).

    Why: across a link of limited rate, gloo's own all-to-all and all-gather back to back (a low-bit round) took
    1.54x their bytes over the rate (a 232 kB round at 3 Mbit/s: 951 ms, in every run), these messages 1.05x
    (654 ms), as gloo's segmented allreduce; with the sends posted first 1.29x. Among 3 sites, sending to both
    peers at once took 1.26-1.30x (plain TCP, 3 and 10 Mbit/s), one peer at a time 1.00-1.01x
    (benchmarks/README.md, link_rate.py).
    """
    earlier = _in_flight.get(pg)
    if earlier is not None:
        earlier._thread.join()  # its error, if any, is its caller's
    rank, world = pg.rank(), pg.size()
    into[rank].copy_(piece_for(rank))
    receives = [pg.recv([into[(rank - i) % world]], (rank - i) % world, 0) for i in range(1, world)]

    def send(i: int) -> dist.Work:
        return pg.send([piece_for((rank + i) % world)], (rank + i) % world, 0)

    first = [receives[0], send(1)]  # posted here, in the caller's thread

    def steps() -> Iterator[list[dist.Work]]:
        yield first
        for i in range(2, world):
            yield [receives[i - 1], send(i)]

    if not async_op:
        for work in steps():
            for w in work:
                w.wait()
        return None
    handle = Messages(steps())
    _in_flight[pg] = handle
    return handle


def _over_gloo(tensor: torch.Tensor, pg: dist.ProcessGroup) -> bool:
    """True when ``pg`` carries ``tensor`` over gloo (a group may hold gloo for CPU and NCCL for CUDA)."""
    return pg._get_backend(tensor.device).name() == "gloo"


def new_group(ranks: Sequence[int], backend: str | None = None) -> dist.ProcessGroup | None:
    """A process group of ``ranks`` (of ``backend``; None: the default group's), or None on a rank outside it.
    Every rank calls it for every group, in the same order (``torch.distributed.new_group``, whose return type
    also admits a non-member sentinel).

    Example::

        node = new_group([0, 1])  # on ranks 2 and 3: None
    """
    group = dist.new_group(list(ranks), backend=backend)
    return group if isinstance(group, dist.ProcessGroup) else None


def wait_all(work: Iterable[dist.Work | None], abandon: Callable[[], bool] | None = None) -> None:
    """Wait for each of ``work``: what collectives called with ``async_op=True`` return (None on a rank with
    nothing to wait for, in some versions' types). ``abandon``, asked every ``POLL_S`` while one is unfinished, ends
    the wait with a RuntimeError when it says True: a peer has left the group, so the collective can only time out
    (gloo's waits cannot be interrupted, and a peer's error does not close its connections).

    Example::

        wait_all([dist.all_reduce(t, async_op=True) for t in tensors])
    """
    for w in work:
        if w is None:
            continue
        asked, pause = time.monotonic(), 1e-4  # short pauses first: most collectives end within milliseconds
        while abandon is not None and not w.is_completed():
            time.sleep(pause)
            pause = min(2 * pause, PAUSE_S)  # a finished collective is seen within PAUSE_S, not POLL_S
            if time.monotonic() - asked >= POLL_S:
                if abandon():
                    raise RuntimeError("the collective was abandoned: a peer of its group has left it")
                asked = time.monotonic()
        w.wait()


#: Seconds between two looks at whether a wait should be abandoned (:func:`wait_all`).
POLL_S = 0.05
#: The longest pause between two looks at whether a collective finished, while :func:`wait_all` may abandon it: a
#: round waited for is seen done within 5 ms (a 50 ms pause added up to 50 ms to each phase of a live run's rounds).
PAUSE_S = 0.005


def group_size(group: ProcessGroup = None) -> int:
    """Number of ranks in ``group`` (the default group when None); 1 without torch.distributed.

    Example::

        if group_size() == 1:
            return  # nothing to average
    """
    if group is not None:
        return group.size()
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def group_rank(group: ProcessGroup = None) -> int:
    """This process's rank inside ``group`` (the default group when None); 0 without torch.distributed.

    Example::

        if group_rank(node_group) == 0:
            print("first process of this node")
    """
    if group is not None:
        return group.rank()
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank()


def group_ranks(group: ProcessGroup = None) -> list[int]:
    """The global ranks of ``group`` (the default group when None), in group order; ``[0]`` without torch.distributed.
    A standalone group (:func:`standalone_group`, a membership epoch's) spans processes of several worlds and has
    no global ranks: its own ranks, ``0..size-1``.

    Example::

        first = group_ranks(across_nodes)[0]  # the group's first rank, as a global rank
    """
    if group is not None and not registered(group):
        return list(range(group.size()))
    if not (dist.is_available() and dist.is_initialized()):
        return [0]
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def registered(group: dist.ProcessGroup) -> bool:
    """True for a group of this process's world (``new_group``, a device mesh's), False for a standalone one.

    Example::

        assert not registered(epoch.group)
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def standalone_group(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout: float
) -> dist.ProcessGroup:
    """A process group of ``size`` processes that need not share a world (sites that are jobs of their own): each
    passes its ``rank`` and a store they all reach (a ``PrefixStore`` per group). Gloo for CPU tensors, and NCCL
    for CUDA ones when ``device`` is a GPU; every collective fails after ``timeout`` seconds. Blocks until all
    ``size`` processes arrived (or ``timeout``). torchft reconfigures its process groups the same way.

    Example::

        group = standalone_group(dist.PrefixStore("epoch/3", store), rank, size, fabric.device, timeout=30.0)
        dist.all_reduce(tensor, group=group)
    """
    limit = timedelta(seconds=timeout)
    group = dist.ProcessGroup(store, rank, size)
    gloo = dist.ProcessGroup.BackendType.GLOO
    group._register_backend(torch.device("cpu"), gloo, dist.ProcessGroupGloo(store, rank, size, limit))
    if device.type == "cuda":
        nccl = dist.ProcessGroup.BackendType.NCCL
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = limit
        group._register_backend(device, nccl, dist.ProcessGroupNCCL(store, rank, size, options))
        group._set_default_backend(nccl)
    else:
        group._set_default_backend(gloo)
    return group


def check_member(group: ProcessGroup, caller: str) -> None:
    """Raise on this rank, before any collective, when it is not a member of ``group``.

    Example::

        check_member(process_group, "Averager")
    """
    if group is None or not registered(group):
        return  # a standalone group holds every process that made it
    if dist.get_rank() not in dist.get_process_group_ranks(group):
        raise ValueError(
            f"{caller}: `process_group` does not contain this rank ({dist.get_rank()}); its ranks are"
            f" {dist.get_process_group_ranks(group)}. Pass each rank a group it belongs to (for example the"
            " one `torch.distributed.new_subgroups` returns on that rank)."
        )


class Traffic(NamedTuple):
    """What a collective call sent: elements and bytes per rank (before any transport overhead)."""

    elements: int = 0
    bytes: int = 0

    def __add__(self, other: Traffic) -> Traffic:  # type: ignore[override]
        return Traffic(self.elements + other.elements, self.bytes + other.bytes)


@torch.no_grad()
def all_reduce_mean_(
    tensors: Sequence[torch.Tensor],
    group: ProcessGroup = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    scale: float = 1.0,
    abandon: Callable[[], bool] | None = None,
) -> Traffic:
    """Replace every tensor, in place, by its mean across the ranks of ``group``.

    Contiguous tensors of at least ``bucket_bytes`` are reduced in place, with no copy; smaller ones
    are packed into staging buffers of at most ``bucket_bytes`` so that many small tensors cost one
    allreduce, not one each. Tensors are bucketed by device and dtype in the order given, so every
    rank must pass tensors of the same shapes, dtypes and order. Issues one allreduce per bucket
    and returns the :class:`Traffic` sent (zero when the group has one rank). ``scale``: this rank's
    tensors count that many times (a weighted mean when the scales sum to the group's size); ``abandon``:
    see :func:`wait_all`.

    Example::

        traffic = all_reduce_mean_([p.data for p in model.parameters()])
    """
    traffic = Traffic()
    world = group_size(group) if tensors else 1
    if world == 1:
        return traffic
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None  # more than one rank
    for bucket in _buckets(tensors, bucket_bytes):
        if len(bucket) == 1 and bucket[0].is_contiguous():
            flat = bucket[0]
        else:
            flat = torch.cat([t.reshape(-1) for t in bucket])
        # NCCL averages inside the collective; gloo has no AVG, so it sums and every rank divides the
        # same sum, which keeps the result bitwise identical everywhere.
        average_in_collective = pg._get_backend(flat.device).name() == "nccl"
        op = dist.ReduceOp.AVG if average_in_collective else dist.ReduceOp.SUM
        if scale != 1.0:
            flat.mul_(scale)
        wait_all([dist.all_reduce(flat, op=op, group=group, async_op=True)], abandon)
        if not average_in_collective:
            flat.div_(world)
        if flat is not bucket[0]:
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        traffic += Traffic(flat.numel(), flat.numel() * flat.element_size())
    return traffic


def _buckets(tensors: Iterable[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Group consecutive tensors of one device and dtype into lists of at most ``bucket_bytes``."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        same_kind = not bucket or (t.device == bucket[0].device and t.dtype == bucket[0].dtype)
        if bucket and (not same_kind or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def extremes(values: Sequence[int], device: torch.device, group: ProcessGroup = None) -> tuple[list[int], list[int]]:
    """The largest and the smallest of each 64-bit value over the ranks of ``group``. One small allreduce.

    Example::

        top, bottom = extremes([checksum], fabric.device)
        same_everywhere = top == bottom
    """
    if group_size(group) == 1:
        return list(values), list(values)
    # MAX of (v, -v) yields (max, -min) in one call.
    pairs = torch.tensor([v for value in values for v in (value, -value)], dtype=torch.int64, device=device)
    dist.all_reduce(pairs, op=dist.ReduceOp.MAX, group=group)
    return pairs[0::2].tolist(), (-pairs[1::2]).tolist()


def all_ranks_agree(value: int, device: torch.device, group: ProcessGroup = None) -> bool:
    """True when every rank of ``group`` passed the same 64-bit ``value``. One small allreduce.

    Every rank gets the same answer, so callers can raise on all ranks at once instead of letting
    a mismatch turn into a hang later.

    Example::

        if not all_ranks_agree(fingerprint(str(shapes)), fabric.device):
            raise ValueError("models differ across ranks")
    """
    top, bottom = extremes([value], device, group)
    return top == bottom


def describe_disagreement(description: str, device: torch.device, group: ProcessGroup = None) -> str | None:
    """None when every rank of ``group`` passed the same ``description``; else which ranks differ and how.

    One small allreduce when the ranks agree; when they do not (every rank learns that at once),
    one more collective gathers the descriptions, so the error can say what differs.

    Example::

        problem = describe_disagreement(repr(model_names), fabric.device)
        if problem:
            raise ValueError(f"models differ across ranks: {problem}")
    """
    if all_ranks_agree(fingerprint(description), device, group):
        return None
    descriptions: list[str] = [""] * group_size(group)
    dist.all_gather_object(descriptions, description, group=group)
    ranks = group_ranks(group)
    first = descriptions[0]
    return "; ".join(
        [f"rank {ranks[0]}: {first}"]
        + [f"rank {rank}: {text}" for rank, text in zip(ranks[1:], descriptions[1:]) if text != first]
    )


def fingerprint(data: bytes | str) -> int:
    """A stable signed 63-bit hash (unlike ``hash()``, the same in every process).

    Example::

        fingerprint("period=8")  # same integer on every rank
    """
    raw = data.encode() if isinstance(data, str) else data
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1


def broadcast_differences(
    flats: Sequence[torch.Tensor],
    pieces: Sequence[tuple[int, int, int]],
    device: torch.device,
    group: ProcessGroup = None,
) -> Traffic:
    """Make every rank's ``flats`` equal to those of the group's first rank, sending only what differs.

    ``pieces`` are ``(flat, offset, numel)`` slices (one per tensor). One allreduce of two int64s per
    piece finds the pieces whose bytes differ on some rank; then one broadcast per flat buffer that
    holds any, of the span from its first differing piece to its last. Replicas that already agree
    (models built from the same seed) cost that one small allreduce and nothing more. Returns what
    the broadcasts sent.

    Example::

        broadcast_differences(storage.buffers, storage.slots, fabric.device, across_nodes)
    """
    if group_size(group) == 1 or not pieces:
        return Traffic()
    local = [tensors_fingerprint([flats[b][offset : offset + numel]]) for b, offset, numel in pieces]
    top, bottom = extremes(local, device, group)
    spans: dict[int, tuple[int, int]] = {}
    for (b, offset, numel), high, low in zip(pieces, top, bottom):
        if high != low:
            start, end = spans.get(b, (offset, offset + numel))
            spans[b] = (min(start, offset), max(end, offset + numel))
    sent = Traffic()
    for b, (start, end) in sorted(spans.items()):
        span = flats[b][start:end]
        dist.broadcast(span, group=group, group_src=0)
        sent += Traffic(span.numel(), span.numel() * span.element_size())
    return sent


def tensors_fingerprint(tensors: Iterable[torch.Tensor]) -> int:
    """Hash of the exact bytes, shapes and dtypes of ``tensors`` (copies GPU tensors to host).

    Example::

        fingerprint_before = tensors_fingerprint(model.parameters())
    """
    digest = hashlib.blake2b(digest_size=8)
    for t in tensors:
        t = t.detach()
        digest.update(f"{tuple(t.shape)}{t.dtype}".encode())
        # numpy() of a copy: numpy() of the tensor itself would leave its storage unresizable for good (FlatStorage
        # frees the memory of its copy of FSDP2's shards by resizing it)
        digest.update(t.contiguous().reshape(-1).view(torch.uint8).cpu().clone().numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1
