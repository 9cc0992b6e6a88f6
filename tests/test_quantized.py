"""The block-quantized mean (fabric_multimodel.comm.quantized): the codes alone, then rounds in real gloo worlds.

The tests of the codes alone and of one process take the ``device`` fixture: ``--device cuda`` runs them
with CUDA tensors (``-m device`` selects them alone); the worlds are CPU/gloo.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.common import profile_call
from fabric_multimodel.comm import collectives
from fabric_multimodel.comm.codec import CODE_DTYPES, FLOAT4_E2M1, Quantized, dequantize, quantize, relative_error
from fabric_multimodel.comm.quantized import QuantizedMean
from tests.worlds import errors_of, in_step

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX_CODE = {E4M3: 448.0, E5M2: 57344.0, FLOAT4_E2M1: 6.0}
SLOTS = 13  # a round's header: rounds.Header.SLOTS per rank


def blockwise_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element, the largest magnitude in its block (blocks of ``block`` from the start, zero-padded)."""
    padded = torch.nn.functional.pad(x.abs(), (0, -x.numel() % block))
    return padded.view(-1, block).amax(1).repeat_interleave(block)[: x.numel()]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern, so that NaN compares equal to itself."""
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.uint8)


def e2m1_reference(values: torch.Tensor) -> torch.Tensor:
    """The OCP E2M1 rule written out, independent of any torch version: each value's nearest code (ties to the even
    code, magnitudes past 6 saturating), its sign bit kept, two codes per byte with the first in the low nibble."""
    grid = [e2m1_value(n) for n in range(8)]
    codes = []
    for value in values.tolist():
        magnitude = min(abs(value), 6.0)
        nearest = min(range(8), key=lambda n: (abs(grid[n] - magnitude), n & 1))
        codes.append(nearest | (8 if math.copysign(1.0, value) < 0 else 0))
    pairs = torch.tensor(codes, dtype=torch.uint8).view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


# --- the codes alone ------------------------------------------------------------------------------


def e2m1_value(nibble: int) -> float:
    """OCP MX E2M1: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal."""
    sign, exponent, mantissa = nibble >> 3, (nibble >> 1) & 3, nibble & 1
    magnitude = 0.5 * mantissa if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


def test_e2m1_decoding_follows_the_ocp_layout_with_the_first_element_in_the_low_nibble(device):
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(256, 1).to(device)
    codes = Quantized(every_byte.view(FLOAT4_E2M1), torch.ones(256, dtype=torch.bfloat16, device=device))
    values = dequantize(codes, 512).view(256, 2)
    expected = torch.tensor([[e2m1_value(b & 15), e2m1_value(b >> 4)] for b in range(256)], device=device)
    assert torch.equal(values, expected)
    assert codes.codes.dtype == FLOAT4_E2M1  # the bytes are usable as torch's packed fp4 dtype as they are


def test_e2m1_encoding_is_the_ocp_rule_ties_included(device):
    grid = torch.tensor([e2m1_value(n) for n in range(8)])
    midpoints = (grid[1:] + grid[:-1]) / 2
    ties = torch.cat([midpoints, midpoints.nextafter(torch.tensor(0.0)), midpoints.nextafter(torch.tensor(9.0))])
    rest = torch.rand(4000, generator=torch.Generator().manual_seed(0)) * 12.1 - 6.05
    values = torch.cat([grid, ties, -ties, rest])
    values = torch.cat([values, torch.zeros(-values.numel() % 31)]).view(-1, 31)
    # 6.0 leads each block of 32, so its scale is exactly 1 and the codes are those of the values themselves.
    blocks = torch.cat([torch.full((values.shape[0], 1), 6.0), values.clamp(-6, 6)], dim=1).reshape(-1)
    codes, scales = quantize(blocks.to(device), FLOAT4_E2M1, 32)
    assert torch.equal(scales, torch.ones_like(scales))
    assert torch.equal(codes.view(torch.uint8).cpu(), e2m1_reference(blocks).view(-1, 16))


@pytest.mark.parametrize("code", [E4M3, E5M2], ids=str)
def test_fp8_decoding_is_torchs_cast_of_every_byte(device, code):
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    scale = torch.ones(1, dtype=torch.bfloat16, device=device)
    values = dequantize(Quantized(every_byte.view(1, 256).view(code), scale), 256)
    cast = every_byte.view(code).float()  # torch's own cast, on the same device
    if code == E4M3:  # its NaN code decodes as 480: quantize writes it only into blocks with a NaN or Inf scale
        nan_codes = cast.isnan()
        assert nan_codes.sum() == 2
        assert torch.equal(values[nan_codes].abs(), torch.tensor([480.0, 480.0], device=device))
        values, cast = values[~nan_codes], cast[~nan_codes]
    else:  # e5m2's six NaN codes decode to NaN; which NaN (sign, payload) a cast gives differs by device
        nan_codes = cast.isnan()
        assert nan_codes.sum() == 6 and values[nan_codes].isnan().all()
        values, cast = values[~nan_codes], cast[~nan_codes]
    assert torch.equal(bits(values), bits(cast))


@pytest.mark.parametrize("code", CODE_DTYPES, ids=str)
def test_representable_values_round_trip_exactly(device, code):
    """Values on the code grid times a power of two, with the top code in every block: exact round trip."""
    g = torch.Generator().manual_seed(1)
    if code == FLOAT4_E2M1:
        grid = torch.tensor([e2m1_value(n) for n in range(16)])
    else:
        grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(code).float()
        grid = grid[grid.isfinite()]
    blocks = grid[torch.randint(grid.numel(), (40, 32), generator=g)]
    blocks[:, 0] = MAX_CODE[code]
    x = (blocks * 2.0 ** torch.randint(-100, 100, (40, 1), generator=g).float()).reshape(-1).to(device)
    assert torch.equal(dequantize(quantize(x, code), x.numel()), x)


@pytest.mark.parametrize("code", CODE_DTYPES, ids=str)
def test_zeros_round_trip_to_zeros_and_a_nan_or_inf_spoils_its_own_block(device, code):
    x = torch.zeros(5 * 32, device=device)
    assert torch.equal(dequantize(quantize(x, code), x.numel()), x)
    x = torch.randn(5 * 32, generator=torch.Generator().manual_seed(2))
    x[40], x[100] = math.nan, -math.inf  # blocks 1 and 3
    finite = dequantize(quantize(x.to(device), code), x.numel()).view(5, 32).isfinite().cpu()
    assert finite.all(1).tolist() == [True, False, True, False, True]
    assert not finite[1].any() and not finite[3].any()  # the whole block, through the scale


# Per-block magnitudes span 1e-30..1e30; some blocks are zero, some hold one huge value.
styles = st.fixed_dictionaries(
    {
        "lo": st.integers(-30, 29),
        "span": st.integers(0, 30),
        "zero_blocks": st.booleans(),
        "huge": st.booleans(),
    }
)


def make_payload(n: int, block: int, seed: int, rank: int, style: dict) -> torch.Tensor:
    """Rank ``rank``'s payload: deterministic in its arguments, so the test can rebuild every rank's."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    blocks = -(-n // block)
    hi = min(style["lo"] + style["span"], 30)
    magnitude = 10.0 ** torch.empty(blocks, dtype=torch.float64).uniform_(style["lo"], hi, generator=g)
    x = torch.randn(blocks, block, generator=g, dtype=torch.float64) * magnitude[:, None]
    if style["zero_blocks"]:
        x[torch.rand(blocks, generator=g) < 0.3] = 0
    if style["huge"]:  # one value per block 1e4 times the others (capped below fp32's max)
        where = torch.randint(block, (blocks,), generator=g)
        x[torch.arange(blocks), where] = (magnitude * 1e4).clamp(max=1e34)
    return x.reshape(-1)[:n].float()


@given(
    n=st.integers(1, 2000),
    code=st.sampled_from(CODE_DTYPES),
    block=st.sampled_from([2, 8, 32, 64, 256]),
    seed=st.integers(0, 2**16),
    style=styles,
)
def test_one_quantization_is_within_its_bound_and_deterministic(device, n, code, block, seed, style):
    x = make_payload(n, block, seed, 0, style)
    q = quantize(x.to(device), code, block)
    again = quantize(x.to(device), code, block)
    assert torch.equal(bits(q.codes.view(torch.uint8)), bits(again.codes.view(torch.uint8)))
    assert torch.equal(bits(q.scales.float()), bits(again.scales.float()))
    error = (dequantize(q, n).cpu().double() - x.double()).abs()
    bound = relative_error(code) * blockwise_amax(x.double(), block) * (1 + 1e-6)
    assert (error <= bound).all(), (error - bound).max()


def test_quantize_and_the_constructor_refuse_bad_arguments_with_the_argument_and_the_fix(device):
    x = torch.zeros(8, device=device)
    errors = errors_of(
        {
            "code dtype": lambda: quantize(x, torch.float16),
            "payload dtype": lambda: quantize(x.double(), E4M3),
            "block": lambda: quantize(x, E4M3, 0),
            "odd fp4 block": lambda: QuantizedMean(8, FLOAT4_E2M1, device, block_size=31),
            "numel": lambda: QuantizedMean(0, E4M3, device),
            "exact_numel": lambda: QuantizedMean(8, E4M3, device, exact_numel=-1),
            "block of the mean": lambda: QuantizedMean(8, E4M3, device, block_size=-32),
            "scale dtype": lambda: quantize(x, E4M3, 32, torch.float16),
        }
    )
    expected = {
        "code dtype": ("TypeError", "`code_dtype`"),
        "payload dtype": ("TypeError", "`x` must be torch.float32"),
        "block": ("ValueError", "`block_size`"),
        "odd fp4 block": ("ValueError", "must be even"),
        "numel": ("ValueError", "`numel`"),
        "exact_numel": ("ValueError", "`exact_numel`"),
        "block of the mean": ("ValueError", "`block_size`"),
        "scale dtype": ("TypeError", "`scale_dtype`"),
    }
    for case, (kind, words) in expected.items():
        assert errors[case] is not None and errors[case][0] == kind and words in errors[case][1], (case, errors[case])
    assert "torch.float8_e4m3fn" in errors["code dtype"][1]  # the message lists what is accepted


# --- one process, no process group -----------------------------------------------------------------


@pytest.mark.parametrize("code", CODE_DTYPES, ids=str)
def test_without_a_process_group_a_round_quantizes_twice_and_sends_nothing(device, code):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3)).to(device)
    exact = torch.arange(7.0, device=device)
    mean = QuantizedMean(1000, code, device, exact_numel=7, block_size=64)
    payload = x.clone().view(10, 100)  # any contiguous shape
    mean.all_reduce_mean(payload, exact)
    twice = dequantize(quantize(dequantize(quantize(x, code, 64), 1000), code, 64), 1000)
    assert torch.equal(payload.view(-1), twice)
    assert torch.equal(exact, torch.arange(7.0, device=device))  # the sum over one rank
    assert mean.traffic.bytes == 0 and not mean.pending


def test_misordered_phases_and_bad_round_arguments_are_clear_errors(device):
    mean = QuantizedMean(100, E4M3, device, exact_numel=3)
    payload, exact = torch.zeros(100, device=device), torch.zeros(3, device=device)
    errors = {}
    for case, call in {
        "exchange first": mean.exchange,
        "finish first": mean.finish,
        "payload dtype": lambda: mean.start(payload.bfloat16(), exact),
        "payload size": lambda: mean.start(torch.zeros(99, device=device), exact),
        "not contiguous": lambda: mean.start(torch.zeros(200, device=device)[::2], exact),
        "exact missing": lambda: mean.start(payload),
        "exact size": lambda: mean.start(payload, torch.zeros(4, device=device)),
    }.items():
        with pytest.raises((TypeError, ValueError, RuntimeError)) as info:
            call()
        errors[case] = (info.type.__name__, str(info.value))
    assert errors["exchange first"][0] == errors["finish first"][0] == "RuntimeError"
    assert "start(payload" in errors["exchange first"][1]
    assert errors["payload dtype"][0] == "TypeError" and "`payload` must be torch.float32" in errors["payload dtype"][1]
    assert "`payload` has 99 elements" in errors["payload size"][1] and "built for 100" in errors["payload size"][1]
    assert "contiguous" in errors["not contiguous"][1]
    assert "`exact` is required" in errors["exact missing"][1] and "`exact` has 4" in errors["exact size"][1]
    mean.start(payload, exact)
    with pytest.raises(RuntimeError, match="in flight"):
        mean.start(payload, exact)
    with pytest.raises(RuntimeError, match="in flight"):
        mean.state_dict()
    mean.finish()  # exchanges first
    assert not mean.pending


@pytest.mark.parametrize("code", CODE_DTYPES, ids=str)
@pytest.mark.parametrize("error_feedback", [False, True])
def test_a_round_allocates_nothing_in_proportion_to_the_payload(code, error_feedback):
    n = 100_000
    mean = QuantizedMean(n, code, "cpu", exact_numel=52, error_feedback=error_feedback, chunk_elements=1 << 16)
    payload, exact = torch.randn(n), torch.zeros(52)
    mean.all_reduce_mean(payload, exact)
    peak = profile_call(lambda: mean.all_reduce_mean(payload, exact))["peak_extra_bytes"]
    assert peak < 1024, peak  # scalars wrapped into tensors, nothing per block or element


# --- rounds in real worlds --------------------------------------------------------------------------


class Counted:
    """Wraps the collectives for the duration of a ``with``: each call as (name, input bytes, output bytes, dtype).
    The all-to-all and all-gather of a payload are the library's (messages on gloo), the rest torch's."""

    PLACES = ((collectives, "all_to_all_messages"), (collectives, "all_gather_messages"))
    PLACES += tuple((dist, name) for name in ("all_gather", "all_reduce", "broadcast"))

    def __enter__(self) -> list:
        self.calls: list = []
        self.saved = {(module, name): getattr(module, name) for module, name in self.PLACES}
        for (module, name), original in self.saved.items():
            setattr(module, name, self._wrap(name, original))
        return self.calls

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            output, tensor = args[0], args[1] if len(args) > 1 else args[0]
            if isinstance(output, torch.Tensor) and isinstance(tensor, torch.Tensor):
                nbytes = [t.numel() * t.element_size() for t in (tensor, output)]
                self.calls.append((name, *nbytes, str(tensor.dtype)))
            else:
                self.calls.append((name, None, None, None))
            return original(*args, **kwargs)

        return counted

    def __exit__(self, *exc) -> None:
        for (module, name), original in self.saved.items():
            setattr(module, name, original)


def header_for(rank: int, world: int, seed: int) -> torch.Tensor:
    """This rank's digits (0..15) in its own slots, zeros elsewhere, like rounds.Header."""
    header = torch.zeros(SLOTS * world)
    digits = torch.randint(16, (SLOTS,), generator=torch.Generator().manual_seed(seed + 7 * rank))
    header[rank * SLOTS : (rank + 1) * SLOTS] = digits.float()
    return header


def quantized_round(fabric, n, code, block, seed, style, shape, chunk):
    """One round with every phase apart (the collectives counted) and one blocking; both results, the sums."""
    rank, world = fabric.global_rank, fabric.world_size
    x = make_payload(n, block, seed, rank, style)
    mean = QuantizedMean(n, code, "cpu", block_size=block, exact_numel=SLOTS * world, chunk_elements=chunk)
    payload, exact = x.clone().view(shape), header_for(rank, world, seed)
    with Counted() as calls:
        mean.start(payload, exact)
        untouched = torch.equal(payload.view(-1), x)  # start only reads
        mean.exchange()
        mean.finish()
    blocking, blocking_exact = x.clone(), header_for(rank, world, seed)
    mean.all_reduce_mean(blocking, blocking_exact)
    same = torch.equal(bits(blocking), bits(payload.view(-1))) and torch.equal(blocking_exact, exact)
    return payload.view(-1), exact, calls, tuple(mean.traffic), untouched and same


def check_round(results, world, n, code, block, seed, style):
    xs = torch.stack([make_payload(n, block, seed, r, style).double() for r in range(world)])
    exact_mean = xs.mean(0)
    c = relative_error(code)
    a_bar = torch.stack([blockwise_amax(x, block) for x in xs]).mean(0)
    bound = c * (a_bar + blockwise_amax(exact_mean, block) + c * a_bar) * (1 + 1e-5)
    first = results[0][0]
    expected_exact = sum(header_for(r, world, seed) for r in range(world))
    for result, exact, calls, traffic, consistent in results:
        assert consistent  # phases apart and blocking agree bitwise; start left the payload alone
        assert torch.equal(bits(result), bits(first))  # every replica holds bitwise the same mean
        error = (result.double() - exact_mean).abs()
        assert (error <= bound).all(), (error - bound).max()
        assert torch.equal(exact, expected_exact)  # the exact channel sums exactly
        elements, sent = traffic
        assert elements == n + SLOTS * world
        assert calls == [
            ("all_to_all_messages", sent, sent, "torch.uint8"),
            ("all_gather_messages", sent // world, sent, "torch.uint8"),
        ]


round_cases = dict(
    n=st.integers(1, 3000),
    code=st.sampled_from(CODE_DTYPES),
    block=st.sampled_from([2, 32, 64]),
    seed=st.integers(0, 2**16),
    style=styles,
    rows=st.sampled_from([1, 2, 3]),
    chunk=st.sampled_from([64, 1 << 20]),  # many tiles per round, or one
)


def _run_round_case(worlds, size, n, code, block, seed, style, rows, chunk):
    shape = (rows, n // rows) if n % rows == 0 else (n,)
    results = worlds(size).run(quantized_round, n, code, block, seed, style, shape, chunk)
    check_round(results, size, n, code, block, seed, style)


@given(**round_cases)
def test_two_ranks_get_the_same_mean_within_the_bound_and_the_exact_sum(
    worlds, n, code, block, seed, style, rows, chunk
):
    _run_round_case(worlds, 2, n, code, block, seed, style, rows, chunk)


@settings(max_examples=3)
@given(**round_cases)
def test_four_ranks_get_the_same_mean_within_the_bound_and_the_exact_sum(
    worlds, n, code, block, seed, style, rows, chunk
):
    _run_round_case(worlds, 4, n, code, block, seed, style, rows, chunk)


@pytest.mark.parametrize("size", [2, 4])
def test_small_payloads_fewer_blocks_than_ranks(worlds, size):
    for n in (1, 5, 33):  # one element; fewer blocks than ranks; a block and one more element
        style = {"lo": -3, "span": 3, "zero_blocks": False, "huge": False}
        _run_round_case(worlds, size, n, FLOAT4_E2M1, 32, n, style, 1, 1 << 20)


def nonfinite_round(fabric, code, value, at):
    """The last rank puts ``value`` at ``at``; returns which blocks of 32 came back finite."""
    rank, world = fabric.global_rank, fabric.world_size
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    if rank == world - 1:
        x[at] = value
    mean = QuantizedMean(1000, code, "cpu", exact_numel=SLOTS * world)
    mean.all_reduce_mean(x, header_for(rank, world, 0))
    return torch.nn.functional.pad(x, (0, 24), value=1.0).view(-1, 32).isfinite().all(1)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("code", CODE_DTYPES, ids=str)
def test_a_nan_or_inf_on_one_rank_is_non_finite_on_every_rank(worlds, size, code):
    for value, at in ((math.nan, 500), (math.inf, 999), (-math.inf, 0)):
        for finite in worlds(size).run(nonfinite_round, code, value, at):
            assert not finite[at // 32] and finite.sum() == finite.numel() - 1, (value, finite)


def error_feedback_rounds(fabric, code, seed):
    """Two rounds with error feedback, the residual after each, and a second object resumed after round 1."""
    rank = fabric.global_rank
    g = torch.Generator().manual_seed(seed + rank)
    xs = [torch.randn(777, generator=g) * 10.0 ** (rank - i) for i in range(2)]
    mean = QuantizedMean(777, code, "cpu", block_size=32, error_feedback=True)
    assert torch.equal(mean.state_dict()["residual"], torch.zeros(777))
    results, residuals = [], []
    for i, x in enumerate(xs):
        payload = x.clone()
        mean.all_reduce_mean(payload)
        results.append(payload)
        residuals.append(mean.state_dict()["residual"])
        if i == 0:
            saved = mean.state_dict()
    resumed = QuantizedMean(777, code, "cpu", block_size=32, error_feedback=True)
    resumed.load_state_dict(saved)
    payload = xs[1].clone()
    resumed.all_reduce_mean(payload)
    return xs, results, residuals, payload, resumed.state_dict()["residual"]


@pytest.mark.parametrize("code", CODE_DTYPES, ids=str)
def test_error_feedback_carries_exactly_what_quantization_dropped_and_resumes_bitwise(worlds, code):
    for xs, results, residuals, resumed, resumed_residual in worlds(2).run(error_feedback_rounds, code, 5):
        carried = torch.zeros(777)
        for x, residual in zip(xs, residuals):
            sent = x + carried
            assert torch.equal(residual, sent - dequantize(quantize(sent, code, 32), 777))
            carried = residual
        assert torch.equal(bits(resumed), bits(results[1])) and torch.equal(resumed_residual, residuals[1])
        assert residuals[1].abs().max() > 0


def bad_round_arguments(fabric):
    """Bad arguments on every rank: each a clear error before any collective; then the world is still in step."""
    mean = QuantizedMean(64, E4M3, "cpu", exact_numel=4)
    errors = errors_of(
        {
            "code dtype": lambda: QuantizedMean(64, torch.bfloat16, "cpu"),
            "block": lambda: QuantizedMean(64, E5M2, "cpu", block_size=0),
            "payload dtype": lambda: mean.start(torch.zeros(64, dtype=torch.float64), torch.zeros(4)),
            "payload size": lambda: mean.start(torch.zeros(65), torch.zeros(4)),
            "exact dtype": lambda: mean.start(torch.zeros(64), torch.zeros(4, dtype=torch.int64)),
            "state": lambda: mean.load_state_dict({"residual": torch.zeros(64)}),
        }
    )
    return errors, mean.pending, in_step()


@pytest.mark.parametrize("size", [2, 4])
def test_bad_arguments_are_errors_on_every_rank_before_any_collective(worlds, size):
    for errors, pending, check in worlds(size).run(bad_round_arguments):
        assert check == size and not pending
        assert errors["code dtype"][0] == "TypeError" and "`code_dtype`" in errors["code dtype"][1]
        assert errors["block"][0] == "ValueError" and "`block_size`" in errors["block"][1]
        assert errors["payload dtype"][0] == "TypeError" and "`payload`" in errors["payload dtype"][1]
        assert errors["payload size"][0] == "ValueError" and "65 elements" in errors["payload size"][1]
        assert errors["exact dtype"][0] == "TypeError" and "`exact`" in errors["exact dtype"][1]
        assert errors["state"][0] == "ValueError" and "error_feedback" in errors["state"][1]


def round_memory(fabric, code):
    n = 100_000
    mean = QuantizedMean(n, code, "cpu", exact_numel=SLOTS * fabric.world_size, error_feedback=True)
    payload, exact = torch.randn(n), header_for(fabric.global_rank, fabric.world_size, 0)
    mean.all_reduce_mean(payload, exact)
    return profile_call(lambda: mean.all_reduce_mean(payload, exact))["peak_extra_bytes"], mean.traffic.bytes


def warned_by_a_round(fabric):
    """The warnings a quantized round and the pacing agreement raise (both gather into one tensor)."""
    import warnings

    from fabric_multimodel.averaging.pacing import gather_step_times

    mean = QuantizedMean(1000, E4M3, "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mean.all_reduce_mean(torch.randn(1000))
        gather_step_times(0.01, fabric.device, None)
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_a_round_uses_the_all_gather_this_torch_does_not_deprecate(worlds):
    # torch 2.13 warns at every call of all_gather_into_tensor: a user would see it at every low-bit round.
    assert worlds(2).run(warned_by_a_round) == [[], []]


@pytest.mark.parametrize("size", [2, 4])
def test_in_a_world_a_round_allocates_nothing_beyond_its_buffers(worlds, size):
    for peak, sent in worlds(size).run(round_memory, FLOAT4_E2M1):
        # On gloo the messages land in the object's buffers (gloo's all-gather allocated a copy of its output).
        assert sent > 0 and peak < 1024, (peak, sent)


def traffic_of(fabric, sizes):
    return {(n, code): tuple(QuantizedMean(n, code, "cpu").traffic) for n in sizes for code in CODE_DTYPES}


@pytest.mark.parametrize("size", [2, 4])
def test_a_round_sends_at_most_027x_fp32_bytes_with_fp8_and_015x_with_fp4(worlds, size):
    targets = {E4M3: 0.27, E5M2: 0.27, FLOAT4_E2M1: 0.15}
    header = SLOTS * size
    for (n, code), (elements, sent) in worlds(size).run(traffic_of, [200_000, 6_000_000])[0].items():
        assert elements == n and sent / (4 * (n + header)) <= targets[code], (n, code, sent)


class _FailingWait:
    """A work handle that waits for the real collective (every rank stays in step), then fails like a lost peer."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def wait(self) -> None:
        self.handle.wait()
        raise RuntimeError("Connection reset by peer (simulated)")


def failing_collective(fabric, name, when):
    """``collectives.<name>`` fails on every rank, at launch or at its wait; what the caller sees, and a round after."""
    original = getattr(collectives, name)

    def failing(*args, **kwargs):
        if when == "launch":
            raise RuntimeError("Connection closed by peer (simulated)")
        return _FailingWait(original(*args, **kwargs))

    mean = QuantizedMean(1000, E4M3, "cpu", error_feedback=True)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(fabric.global_rank))
    payload = x.clone()
    setattr(collectives, name, failing)
    try:
        mean.all_reduce_mean(payload)
        error = None
    except RuntimeError as raised:
        error = str(raised)
    finally:
        setattr(collectives, name, original)
    pending, untouched = mean.pending, torch.equal(payload, x)
    mean.all_reduce_mean(payload)  # the object is usable again
    return error, pending, untouched, in_step()


@pytest.mark.parametrize("name", ["all_to_all_messages", "all_gather_messages"])
@pytest.mark.parametrize("when", ["launch", "wait"])
def test_a_failing_collective_raises_its_runtime_error_and_leaves_the_object_idle(worlds, name, when):
    for error, pending, untouched, check in worlds(2).run(failing_collective, name, when):
        assert error is not None and "(simulated)" in error and not pending and check == 2
        assert untouched  # only finish() writes the payload
