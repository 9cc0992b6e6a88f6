"""Peer libraries' averaging rounds, set up the way their own users would, for ``averaging_cost.py``.

Only :func:`torchft_diloco_round` for now: one synchronisation round of torchft 0.2.0's own
``torchft.local_sgd.DiLoCo`` (``sync_every=1``), with its Lighthouse, Manager, quorum and commit
vote, across the two processes of a 2-rank CPU/gloo world made by
:func:`fabric_multimodel.run.launch.join_local_world`.

The benchmark imports this module only when torchft is installed; torchft itself is imported
inside the function, so importing this file never needs it.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

#: Every torchft wait (quorum, commit vote, allreduce, store, RPC connect) gives up after this many
#: seconds, so a lost peer raises instead of hanging the benchmark (torchft's default is also 60).
TORCHFT_TIMEOUT_S = 60
#: The inner optimizer's learning rate. Each round's inner step moves every parameter by
#: ``INNER_LR * 1.0``, so the pseudo-gradient is non-zero (its size does not change the cost).
INNER_LR = 1e-4
#: Where the Lighthouse, the Managers and the per-replica TCPStores listen and are reached. The
#: benchmark's world is on one machine (``join_local_world`` uses 127.0.0.1); using the loopback
#: address explicitly avoids depending on how the machine's hostname resolves (torchft's default).
HOST = "127.0.0.1"


class _TorchftDiLoCoRound:
    """One torchft DiLoCo round per call; owns the torchft objects so they live as long as it does."""

    def __init__(
        self,
        diloco: Any,
        inner_optimizer: Any,
        params: list[Any],
        grads: list[Any],
        manager: Any,
        lighthouse: Any,
        store: Any,
    ) -> None:
        self.diloco = diloco
        self.inner_optimizer = inner_optimizer
        self.params = params
        self.grads = grads
        self.manager = manager
        self.lighthouse = lighthouse
        self.store = store  # this replica group's TCPStore (the Manager and the PG only hold clients)
        self.rounds = 0
        # Shut torchft's servers down when this object goes away (or at interpreter exit), without
        # holding a reference to self: the Rust ManagerServer/LighthouseServer threads and the
        # checkpoint HTTP server would otherwise keep heartbeating until the process ends.
        self._finalizer = weakref.finalize(self, _close, diloco, manager, lighthouse)

    def __call__(self) -> None:
        # A fake backward: hand every parameter a gradient (preallocated; DiLoCo's outer step leaves
        # .grad as None). Then ONE inner step; with sync_every=1 its post-hook runs the whole round.
        for p, g in zip(self.params, self.grads):
            p.grad = g
        self.inner_optimizer.step()
        if self.manager.errored() is not None:
            # torchft swallows a failed round (should_commit is False, parameters are restored); a
            # benchmark must not time such a round as if it were a real one.
            raise RuntimeError(f"torchft DiLoCo round failed: {self.manager.errored()}")
        self.rounds += 1

    def close(self) -> None:
        """Shut the Manager (and, on rank 0, the Lighthouse) down now; later calls fail. Optional."""
        self._finalizer()


def _close(diloco: Any, manager: Any, lighthouse: Any) -> None:
    diloco.__exit__(None, None, None)  # removes DiLoCo's optimizer hooks
    manager.shutdown(wait=False)  # checkpoint HTTP server, ManagerServer, quorum thread
    if lighthouse is not None:
        lighthouse.shutdown()


def torchft_diloco_round(
    fabric: Any, model_factory: Callable[[], dict[str, Any]], *, bucketize: bool
) -> Callable[[], None]:
    """Set up torchft 0.2.0's own DiLoCo on this rank and return a callable that runs exactly ONE
    DiLoCo synchronisation round (sync_every=1) per call, on the same models, every call a full round.

    Call it on both ranks of a 2-process gloo world (a launched ``Fabric``), in the same order; it
    is collective (it uses the default group once, to share the Lighthouse's address, and runs one
    warm-up round). ``model_factory()`` must give the same weights on every rank; its modules are
    put in one ``nn.ModuleDict``, which is DiLoCo's single model fragment.

    Setup, as torchft's own integration tests do it on CPU (``local_sgd_integ_test.py``,
    ``_test/diloco_trainer.py``), except that each replica group is a separate process here:

    - Each rank is its own torchft replica group of size 1 (``Manager(rank=0, world_size=1)``,
      ``replica_id="fabric_rank_<rank>"``), so there are 2 replicas and the outer allreduce crosses
      the two processes. Each group has its own ``TCPStore`` (the Manager publishes its server's
      address there) and a reconfigurable ``torchft.ProcessGroupGloo``.
    - Rank 0 starts a ``LighthouseServer(min_replicas=2)`` in-process; its address goes to rank 1
      through ``broadcast_object_list`` on the default group. Each call gets its own Lighthouse, so
      several of these rounds (e.g. bucketized and not) can be alive at once without one's quorum
      waiting for the other's replicas.
    - ``Manager(min_replica_size=2, use_async_quorum=False)`` (DiLoCo requires a synchronous
      quorum), ``init_sync=False`` (the weights are identical by construction, so the first quorum
      does not make replica 1 fetch a checkpoint from replica 0), every timeout 60 s.
    - ``DiLoCo(manager, [model], SGD(lr=1e-4), SGD(lr=0.7, momentum=0.9, nesterov=True),
      sync_every=1, use_bucketization=bucketize)``, entered once; the backup copy of the global
      parameters is on the CPU (DiLoCo's default). Bucketized, torchft's default bucket cap (1 GiB)
      puts every pseudo-gradient in one flat buffer: one allreduce; not bucketized, one allreduce
      per parameter tensor (18 for the DCGAN pair, 400 for the MLP), all started before any wait.
    - One round is run before returning, so the first quorum, which configures torchft's gloo
      process group (a new TCP connection between the replicas), is not part of any timed call.

    One call of the returned callable is what one DiLoCo round costs a torchft user at
    ``sync_every=1``, minus the forward/backward (a preallocated constant gradient is assigned to
    every ``.grad``):

    1. the inner ``SGD.step()`` (for-loop implementation, torch's CPU default), whose pre/post hooks
       take and release torchft's state-dict lock;
    2. ``manager.start_quorum()``: a gRPC call to this replica's ManagerServer, which asks the
       Lighthouse on rank 0 and waits until both replicas have joined (the same quorum id, so the
       process group is not reconfigured);
    3. the pseudo-gradients ``backup - param`` (new tensors), their allreduce(s) in fp32 over
       torchft's gloo group (SUM, then a divide by the number of participants in a callback;
       bucketized: copy into one zeroed flat buffer first and back out after), and the wait;
    4. copying the local parameters aside and restoring the backup into the parameters;
    5. ``manager.should_commit()``: the commit vote, a gRPC call to this replica's ManagerServer;
       the vote is among the ranks of this replica group (here one process), so it does not wait
       for the other replica;
    6. the outer Nesterov ``SGD.step()`` (for-loop, lr 0.7, momentum 0.9) on the averaged
       pseudo-gradients, saving the new global parameters into the backup, the (alpha=0) merge
       ``lerp_`` with the local copy, and ``zero_grad`` (which sets every ``.grad`` to None).

    Measured peak extra memory of one call (torch.profiler, as the benchmark counts it): 2.0 (MLP) to
    2.3 (DCGAN) model copies not bucketized (the pseudo-gradients and the local copy, plus Nesterov's
    temporary), one more bucketized (the flat buffer).

    The call raises ``RuntimeError`` if torchft reported an error in the round (it would otherwise
    skip the update silently). The torchft objects live as long as the returned callable; its
    ``close()`` (or garbage collection, or interpreter exit) shuts them down.

    Example::

        round_ = torchft_diloco_round(fabric, lambda: build("dcgan"), bucketize=True)
        for _ in range(10):
            round_()
    """
    # torchft's native extension logs ~20 INFO lines per round per process to stderr (quorum and
    # commit chatter), which would bury the benchmark's progress lines. Its logger reads RUST_LOG
    # once, when torchft is first imported in the process; keep any value the user set. (Measured:
    # the logging does not change a round's time here.)
    os.environ.setdefault("RUST_LOG", "warn")
    import torch
    import torch.distributed as dist
    from torch import nn
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer
    from torchft.local_sgd import USE_BUCKETIZATION_ENV, DiLoCo

    if not bucketize and os.environ.get(USE_BUCKETIZATION_ENV, "False") == "True":
        # torchft lets this environment variable turn bucketization on over the argument; the
        # non-bucketized row would silently measure the bucketized round.
        raise ValueError(f"{USE_BUCKETIZATION_ENV}=True is set: torchft would bucketize anyway")
    if fabric.world_size != 2:
        # One replica per rank and a Lighthouse that waits for exactly 2: other sizes are untested.
        raise ValueError(f"torchft_diloco_round needs a 2-rank world, got {fabric.world_size}")
    rank = fabric.global_rank
    timeout = timedelta(seconds=TORCHFT_TIMEOUT_S)

    # The Lighthouse decides every quorum. Bound to the loopback address; its own address() names
    # the machine's hostname, so the address is rebuilt from the port it got.
    lighthouse = None
    address: list[str | None] = [None]
    if rank == 0:
        lighthouse = LighthouseServer(bind=f"{HOST}:0", min_replicas=2)
        address[0] = f"http://{HOST}:{lighthouse.address().rsplit(':', 1)[1]}"
    dist.broadcast_object_list(address, src=0)
    lighthouse_addr = address[0]
    assert lighthouse_addr is not None

    # One store per replica group (as torchft's tests do): both ranks are group rank 0 of their own
    # group, so sharing the default group's store would make them overwrite each other's keys.
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timeout)

    model = nn.ModuleDict(model_factory())
    params = list(model.parameters())
    inner_optimizer = torch.optim.SGD(params, lr=INNER_LR)
    outer_optimizer = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        # Used only if a replica has to heal from the other (a failed round); DiLoCo registers its
        # backup parameters and outer optimizer state besides.
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        min_replica_size=2,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=HOST,
        store_port=store.port,
        lighthouse_addr=lighthouse_addr,
        replica_id=f"fabric_rank_{rank}",
        hostname=HOST,
        init_sync=False,
    )
    diloco = DiLoCo(
        manager,
        [model],
        inner_optimizer,
        outer_optimizer,
        sync_every=1,
        use_bucketization=bucketize,
    )
    diloco.__enter__()
    grads = [torch.ones_like(p) for p in params]
    round_ = _TorchftDiLoCoRound(diloco, inner_optimizer, params, grads, manager, lighthouse, store)
    round_()  # warm-up: the first quorum configures torchft's process group
    return round_
