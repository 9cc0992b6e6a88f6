"""One cost model of a run: what a round puts on the link between sites, how long it takes there, and how much of
the compute the run keeps. Pure Python (no torch), so that a plan costs nothing to make
(``python -m fabric_multimodel.plan``).

What it counts, per site (each site one link of ``rate`` bits per second, each way):

- **Bytes.** A round moves ``2 (W - 1) / W`` of its payload across each site's link, for ``W`` sites: a ring
  allreduce, and a low-bit round's all-to-all then all-gather alike. The payload is the parameters of a fragment in
  ``comm_dtype``, low-bit ones with one bf16 scale per block of :data:`BLOCK_SIZE` elements. A sparse round
  (``density`` below 1) sends its payload, the most :func:`~fabric_multimodel.plan.payloads.max_bytes` allows, to
  each of the ``W - 1`` other sites (an all-gather: sparse vectors do not sum in a ring). Islands (``devices``
  processes per site) send ``1/devices`` each, over the same link: the site's bytes do not change.
- **Time.** A round takes its bytes over the rate, plus ``latency_s`` per phase of its collective (``2 (W - 1)``).
- **What the run waits for.** A blocking round waits all of it; a round overlapped by ``overlap_steps`` steps
  waits for what does not fit in them; synchronous DDP sends the gradients in buckets as the backward frees them
  and waits for what is left at the backward's end. A period of ``H`` steps with ``F`` fragments holds ``F``
  rounds: the utilisation is ``H T / (H T + F wait)``.
- **Sites of different speeds** (:func:`paced`). With ``pace="steps"`` every site makes ``H`` steps a round, so
  the rounds wait on the slowest site's steps and the faster ones idle for the difference; with ``pace="speed"``
  each makes the steps its speed allows in the fastest's time, and only the link's wait is lost.

What it ignores: the warm-up and the end round (a steady state), the optimizer's own time, contention between
the rounds and the compute for the cores, and what crosses inside a site. :func:`paper` takes instead the
assumptions of the Streaming DiLoCo simulation (arXiv 2501.18512, Table 4): every round's bytes leave during
its step's backward, in one bucket per layer, and bf16 and fp4 payloads carry no scales.

Example::

    setting = Setting(params=1e9, step_s=0.1, period=100, fragments=8, overlap_steps=1, comm_dtype="bf16")
    utilisation(setting, rate=10e9)           # about 0.98 at 10 Gbit/s
    bandwidth_for(setting, target=0.95)       # bits per second for 95%
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fabric_multimodel.plan import payloads

#: Elements per block scale of a low-bit payload (the library's :mod:`~fabric_multimodel.comm.quantized` rounds).
BLOCK_SIZE = 32
#: Bytes of one block scale (bf16).
SCALE_BYTES = 2
#: Bytes per element of each payload, by the examples' ``--comm-dtype`` names and their short ones.
CODE_BYTES = {name: payload.bytes for name, payload in payloads.PAYLOADS.items()}
#: Synchronous DDP's gradient buckets (torch's default ``bucket_cap_mb``).
DDP_BUCKET_BYTES = 25 * 2**20
#: The share of a step that is its backward (the forward a third: twice the FLOPs backward).
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class Assumptions:
    """How the model treats what it cannot measure.

    Example::

        Assumptions(latency_s=0.02)  # 20 ms per phase of a round's collective
    """

    #: Seconds added per phase of a round's collective (``2 (W - 1)`` phases).
    latency_s: float = 0.0
    #: Rounds leave during their step's backward, as its gradients would (the paper's simulation), instead of after
    #: the step (the library: a round needs the step's result).
    rounds_in_backward: bool = False
    #: Buckets the backward frees its bytes in; None: DDP's 25 MiB buckets.
    buckets: int | None = None
    #: Low-bit payloads carry their block scales.
    scales: bool = True
    #: Sites the ring's ``2 (W - 1) / W`` is taken for; None: the setting's.
    ring_sites: int | None = None


#: This library's rounds: launched after a step, overlapped by ``overlap_steps``; DDP's 25 MiB buckets.
LIBRARY = Assumptions()


def paper(layers: int) -> Assumptions:
    """The Streaming DiLoCo simulation's assumptions for a model of ``layers`` layers: rounds during the backward, a
    bucket per layer, no latency, a ring of 2 (``2 (1 - 1/2) = 1``), no scales.

    Example::

        utilisation(Setting(params=1e9, step_s=0.1, period=None, comm_dtype="bf16"), 200e9, paper(layers=24))
    """
    return Assumptions(rounds_in_backward=True, buckets=layers, scales=False, ring_sites=2)


@dataclass(frozen=True)
class Setting:
    """A run: its model, its step, its sites and how it averages (``period=None``: synchronous DDP).

    Example::

        Setting(params=218_496, step_s=0.015, sites=2, period=128, fragments=4, overlap_steps=16, comm_dtype="fp8")
    """

    params: float
    step_s: float
    period: int | None
    sites: int = 2
    devices: int = 1
    fragments: int = 1
    overlap_steps: int = 0
    comm_dtype: str = "float32"
    density: float = 1.0

    def __post_init__(self) -> None:
        try:
            dtype = payloads.payload_name(self.comm_dtype)
        except ValueError as error:
            raise ValueError(f"Setting: `comm_dtype`: {error}.") from None
        object.__setattr__(self, "comm_dtype", dtype)
        if not (self.params > 0 and self.step_s > 0):
            raise ValueError(f"Setting: `params` and `step_s` must be positive, got {self.params}, {self.step_s}.")
        for name in ("sites", "devices", "fragments"):
            if getattr(self, name) < 1:
                raise ValueError(f"Setting: `{name}` must be at least 1, got {getattr(self, name)}.")
        if self.overlap_steps < 0:
            raise ValueError(f"Setting: `overlap_steps` must be at least 0, got {self.overlap_steps}.")
        if not 0 < self.density <= 1 or (self.density < 1 and (self.period is None or dtype != "float32")):
            raise ValueError(
                f"Setting: `density` must be in (0, 1], and below 1 only for averaging rounds with no `comm_dtype`"
                f" (sparse rounds code their own values); got {self.density} with {dtype}."
            )
        if self.period is not None and self.period < self.fragments * (self.overlap_steps + 1):
            raise ValueError(
                f"Setting: `period` ({self.period}) must be at least fragments x (overlap_steps + 1) ="
                f" {self.fragments * (self.overlap_steps + 1)}: each fragment's round merges before the next launches."
            )

    def replace(self, **changes: object) -> Setting:
        """This setting with ``changes``."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def payload_bytes(setting: Setting, assumptions: Assumptions = LIBRARY) -> float:
    """Bytes of one round's payload (one fragment), per site: synchronous DDP's gradients in fp32.

    Example::

        payload_bytes(Setting(params=1e6, step_s=1.0, period=8, comm_dtype="fp8"))  # 1e6 x (1 + 2/32)
    """
    if setting.period is None:
        per_element = 2.0 if assumptions.rounds_in_backward else 4.0  # the paper's DP sends bf16 gradients
        return setting.params * per_element
    if setting.density < 1:
        return payloads.max_bytes(round(setting.params / setting.fragments), payloads.SPARSE_CHUNK, setting.density)
    per_element = CODE_BYTES[setting.comm_dtype]
    if per_element < 2 and assumptions.scales:
        per_element += SCALE_BYTES / BLOCK_SIZE
    return setting.params / setting.fragments * per_element


def wire_bytes(setting: Setting, assumptions: Assumptions = LIBRARY) -> float:
    """Bytes a round puts on each site's link: ``2 (W - 1) / W`` of its payload, for ``W`` sites (rounds: a site's
    processes send their slices of one payload) or every process (synchronous DDP: one ring over all of them, each
    of its edges that leaves a site carrying that much); a sparse round's payload to each of the ``W - 1`` others."""
    ranks = assumptions.ring_sites or setting.sites * (setting.devices if setting.period is None else 1)
    if setting.density < 1:
        return payload_bytes(setting, assumptions) * (ranks - 1)
    return payload_bytes(setting, assumptions) * 2 * (ranks - 1) / ranks


def round_seconds(setting: Setting, rate: float, assumptions: Assumptions = LIBRARY) -> float:
    """Seconds one round takes on a link of ``rate`` bits per second (each way).

    Example::

        round_seconds(Setting(params=218_496, step_s=0.015, period=64, comm_dtype="fp32"), rate=10e6)
    """
    sites = assumptions.ring_sites or setting.sites
    if sites == 1:
        return 0.0
    return 8 * wire_bytes(setting, assumptions) / rate + 2 * (sites - 1) * assumptions.latency_s


def round_wait(setting: Setting, rate: float, assumptions: Assumptions = LIBRARY) -> float:
    """Seconds one round adds to the run's wall-clock: what does not hide behind the compute."""
    seconds = round_seconds(setting, rate, assumptions)
    hidden = setting.overlap_steps * setting.step_s if setting.period is not None else 0.0
    if setting.period is None or assumptions.rounds_in_backward:
        # The bytes leave in buckets as the backward frees them: what is left at its end is what the link has not
        # sent yet, and at least the last bucket.
        backward = BACKWARD_SHARE * setting.step_s
        buckets = assumptions.buckets or max(1, math.ceil(payload_bytes(setting, assumptions) / DDP_BUCKET_BYTES))
        seconds = max(seconds - backward * (1 - 1 / buckets), seconds / buckets)
    return max(0.0, seconds - hidden)


def utilisation(setting: Setting, rate: float | None, assumptions: Assumptions = LIBRARY) -> float:
    """The share of the wall-clock the run computes, in steady state (1.0 for an unlimited link, ``rate=None``).

    Example::

        utilisation(Setting(params=1e9, step_s=0.1, period=None), rate=100e9)  # synchronous DDP at 100 Gbit/s
    """
    if rate is None:
        return 1.0
    if not rate > 0:
        raise ValueError(f"utilisation: `rate` must be positive bits per second, got {rate}.")
    steps = setting.period or 1
    rounds = setting.fragments if setting.period is not None else 1
    compute = steps * setting.step_s
    # The link carries one round at a time, and never two: a round that outlasts its overlap is waited for at its
    # merge, and the next fragment's launches at least a step later.
    return compute / (compute + rounds * round_wait(setting, rate, assumptions))


def paced(setting: Setting, speeds: Sequence[float], pace: str = "speed") -> tuple[Setting, float]:
    """Sites that differ in speed: the setting whose steps the rounds wait on, and the share of the sites' compute
    the run can use. ``speeds``: each site's steps per second (any unit); ``setting.step_s`` is the fastest site's
    step. Under ``pace="steps"`` every site makes ``period`` steps a round, so a round waits on the slowest site's
    steps and the others idle for the difference: a share of ``S min(speeds) / sum(speeds)`` for ``S`` sites. Under
    ``pace="speed"`` each site makes the steps its speed allows in the fastest's time
    (:mod:`~fabric_multimodel.averaging.pacing`), so the share is 1. The run's utilisation is the share times
    :func:`utilisation` of the setting returned.

    Example::

        paced(Setting(params=1e9, step_s=0.1, period=100), [1.0, 0.5], pace="steps")  # step_s 0.2, a share of 2/3
    """
    if pace not in ("steps", "speed"):
        raise ValueError(f"paced: `pace` must be 'steps' or 'speed', got {pace!r}.")
    if not speeds or not all(math.isfinite(s) and s > 0 for s in speeds):
        raise ValueError(f"paced: `speeds` must be positive steps per second, one per site; got {list(speeds)}.")
    if pace == "speed":
        return setting, 1.0
    return setting.replace(step_s=setting.step_s * max(speeds) / min(speeds)), len(speeds) * min(speeds) / sum(speeds)


def run_seconds(
    setting: Setting,
    steps: int,
    rate: float | None,
    assumptions: Assumptions = LIBRARY,
    warmup_steps: int = 0,
    warmup_crosses: bool = False,
) -> float:
    """The wall-clock of a whole run of ``steps``: the compute; a warm-up of synchronous DDP that crosses the link
    (``warmup_crosses``: the flat layout; islands warm up inside each site); each round's wait; and the end, a
    blocking round of every fragment (nothing to hide it behind).

    Example::

        run_seconds(Setting(params=218_496, step_s=0.015, period=128, fragments=4, overlap_steps=16), 2000, 10e6)
    """
    compute = steps * setting.step_s
    if rate is None:
        return compute
    if setting.period is None:
        return compute + steps * round_wait(setting, rate, assumptions)
    warm = min(warmup_steps, steps)
    synchronous = setting.replace(period=None, overlap_steps=0, fragments=1)
    synced = warm * round_wait(synchronous, rate, assumptions) if warmup_crosses else 0.0
    rounds = (steps - warm) // setting.period * setting.fragments
    end = setting.fragments * round_seconds(setting, rate, assumptions)
    return compute + synced + rounds * round_wait(setting, rate, assumptions) + end


def period_for(step_s: float, wait_s: float, fragments: int, overlap_steps: int, target: float) -> int:
    """The smallest period (a multiple of ``fragments``, at least ``fragments * (overlap_steps + 1)``) at which
    rounds that each wait ``wait_s`` leave ``target`` of the time to compute: ``H T / (H T + F wait) >= target``.

    Example::

        period_for(step_s=0.1, wait_s=0.2, fragments=1, overlap_steps=0, target=1 / 1.05)  # 40
    """
    steps = fragments * wait_s * target / ((1 - target) * step_s)
    # A relative margin: an absolute one misjudges millions of steps (a float's last bits decide there).
    return max(fragments * (overlap_steps + 1), fragments * math.ceil(steps / fragments / (1 + 1e-9)))


def bandwidth_for(setting: Setting, target: float, assumptions: Assumptions = LIBRARY) -> float:
    """The least link rate (bits per second) at which ``setting`` computes ``target`` of the time; ``inf`` when no
    rate does (the latency alone waits too long).

    Example::

        bandwidth_for(Setting(params=1e9, step_s=0.1, period=100, comm_dtype="bf16"), target=0.95)
    """
    if not 0 < target < 1:
        raise ValueError(f"bandwidth_for: `target` must be in (0, 1), got {target}.")
    if utilisation(setting, 1e18, assumptions) < target:
        return math.inf
    low, high = 1.0, 1e18
    while high / low > 1 + 1e-6:  # geometric bisection: the answer spans bits to exabits
        middle = math.sqrt(low * high)
        if utilisation(setting, middle, assumptions) >= target:
            high = middle
        else:
            low = middle
    return high


#: Payloads in the order a recommendation tries them: the most exact first.
PAYLOADS = ("float32", "bfloat16", "float8_e4m3fn", "float4_e2m1fn_x2")
#: Sparse rounds' densities, tried, the densest first, when no payload above reaches the target.
DENSITIES = (1 / 16, 1 / 64, 1 / 256)


def recommend(
    setting: Setting, rate: float, target: float, assumptions: Assumptions = LIBRARY, max_period: int = 100_000
) -> Setting | None:
    """The settings that reach ``target`` at ``rate``: the smallest period (the replicas stay closest), then the
    most exact payload, then the shortest overlap (fewer stale steps); ``setting``'s model, step, sites and
    fragments. When no dense payload reaches it with a period up to ``max_period``, the same among sparse rounds'
    :data:`DENSITIES`. None when none does.

    Example::

        recommend(Setting(params=1e9, step_s=0.1, period=100, fragments=8), rate=1e9, target=0.95)
    """
    longest = max_period // setting.fragments - 1  # the longest overlap any period up to max_period allows
    if longest < 0:
        return None
    for payloads_tried in (
        [{"comm_dtype": payload, "density": 1.0} for payload in PAYLOADS],
        [{"comm_dtype": "float32", "density": density} for density in DENSITIES],
    ):
        best: tuple[int, int, int] | None = None
        for rank, payload in enumerate(payloads_tried):
            least, overlap = _least_period(setting.replace(**payload), rate, target, assumptions, longest)
            if least <= max_period and (best is None or (least, rank, overlap) < best):
                best = (least, rank, overlap)
        if best is not None:
            least, rank, overlap = best
            return setting.replace(period=least, overlap_steps=overlap, **payloads_tried[rank])
    return None


def _least_period(
    setting: Setting, rate: float, target: float, assumptions: Assumptions, longest: int
) -> tuple[int, int]:
    """The least period that reaches ``target`` with overlaps up to ``longest``, and the shortest overlap giving it."""
    fragments = setting.fragments

    def period(overlap: int) -> int:
        trial = setting.replace(period=fragments * (overlap + 1), overlap_steps=overlap)
        return period_for(setting.step_s, round_wait(trial, rate, assumptions), fragments, overlap, target)

    # period(overlap) is the larger of fragments * (overlap + 1), which grows, and what the wait needs, which
    # shrinks as the overlap hides more: its least is where they cross, found by bisection.
    crossing = _first(0, longest, lambda overlap: period(overlap) == fragments * (overlap + 1))
    least = min(period(overlap) for overlap in {crossing, max(crossing - 1, 0)})
    return least, _first(0, crossing, lambda overlap: period(overlap) <= least)


def _first(low: int, high: int, holds: Callable[[int], bool]) -> int:
    """The least integer in ``[low, high]`` for which ``holds`` (monotone: false, then true), or ``high``."""
    while low < high:
        middle = (low + high) // 2
        if holds(middle):
            high = middle
        else:
            low = middle + 1
    return low
