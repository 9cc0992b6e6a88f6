"""The 8-Gaussian ring's metric, on point sets whose answer is known by construction."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fabric_multimodel.ring import N_MODES, RADIUS, STD, ring_modes, ring_quality, sample_ring

MODES = ring_modes()


def at_mode(mode: int, n: int = 1, offset: tuple[float, float] = (0.0, 0.0)) -> torch.Tensor:
    return (MODES[mode] + torch.tensor(offset)).repeat(n, 1)


def test_modes_lie_on_the_ring() -> None:
    assert MODES.shape == (N_MODES, 2)
    torch.testing.assert_close(MODES.norm(dim=1), torch.full((N_MODES,), RADIUS))
    angles = torch.atan2(MODES[:, 1], MODES[:, 0]).remainder(2 * math.pi)
    torch.testing.assert_close(angles, torch.arange(N_MODES) * (2 * math.pi / N_MODES))


def test_points_at_every_mode_capture_all_modes() -> None:
    assert ring_quality(MODES) == (N_MODES, 1.0)
    assert ring_quality(MODES.repeat(10, 1)) == (N_MODES, 1.0)


@pytest.mark.parametrize("mode", range(N_MODES))
def test_all_points_at_one_mode_capture_one(mode: int) -> None:
    assert ring_quality(at_mode(mode, 50)) == (1, 1.0)


@pytest.mark.parametrize(
    "points",
    [torch.zeros(10, 2), 10.0 * MODES, MODES * 0.5, torch.tensor([[100.0, -100.0]])],
    ids=["origin", "radius-10", "radius-1", "far"],
)
def test_points_far_from_the_ring_capture_nothing(points: torch.Tensor) -> None:
    assert ring_quality(points) == (0, 0.0)


def test_mixture_has_the_known_fraction_and_modes() -> None:
    good = torch.cat([at_mode(0, 3), at_mode(2, 5, (0.1, 0.0)), at_mode(5, 2, (0.0, -0.12))])  # 10 good, 3 modes
    bad = torch.cat([torch.zeros(20, 2), at_mode(1, 10, (0.2, 0.2))])  # 30 near nothing
    quality = ring_quality(torch.cat([bad, good]))
    assert quality.modes_captured == 3
    assert quality.high_quality == pytest.approx(10 / 40)


def test_low_quality_points_capture_no_mode() -> None:
    # Nearest to mode 4 but 4 std away: neither high quality nor a capture of mode 4.
    quality = ring_quality(torch.cat([at_mode(4, 5, (0.0, 4 * STD)), at_mode(0)]))
    assert quality.modes_captured == 1
    assert quality.high_quality == pytest.approx(1 / 6)


@pytest.mark.parametrize("std", [STD, 0.1])
def test_boundary_is_three_standard_deviations(std: float) -> None:
    inside = at_mode(3, 1, (3 * std * 0.99, 0.0))
    outside = at_mode(3, 1, (0.0, 3 * std * 1.01))
    assert ring_quality(inside, std=std) == (1, 1.0)
    assert ring_quality(outside, std=std) == (0, 0.0)
    assert ring_quality(torch.cat([inside, outside]), std=std) == (1, 0.5)


def test_other_rings() -> None:
    square = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    assert ring_quality(square, n_modes=4, radius=1.0) == (4, 1.0)
    assert ring_quality(square, n_modes=N_MODES, radius=RADIUS) == (0, 0.0)


def test_accepts_generator_output() -> None:
    points = MODES.double().requires_grad_()
    assert ring_quality(points * 1) == (N_MODES, 1.0)


def test_empty_sample_set() -> None:
    assert ring_quality(torch.zeros(0, 2)) == (0, 0.0)


@pytest.mark.parametrize("shape", [(10,), (10, 3), (10, 1), (2, 5, 2), ()])
def test_bad_shape_raises(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="shape"):
        ring_quality(torch.zeros(shape))


@given(seed=st.integers(0, 2**31 - 1))
def test_real_samples_score_as_the_gaussian_predicts(seed: int) -> None:
    n = 20_000
    quality = ring_quality(sample_ring(n, generator=torch.Generator().manual_seed(seed)))
    assert quality.modes_captured == N_MODES
    # P(|N(0, std^2 I_2)| <= 3 std) = 1 - exp(-9/2); 6 binomial standard deviations of slack.
    expected = 1 - math.exp(-4.5)
    assert abs(quality.high_quality - expected) <= 6 * math.sqrt(expected * (1 - expected) / n)


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 300), spread=st.sampled_from([0.02, 0.1, 0.5]))
def test_invariant_to_permuting_the_samples(seed: int, n: int, spread: float) -> None:
    g = torch.Generator().manual_seed(seed)
    points = sample_ring(n, generator=g, std=spread)
    shuffled = points[torch.randperm(n, generator=g)]
    assert ring_quality(shuffled) == ring_quality(points)


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 300))
def test_adding_far_points_only_dilutes(seed: int, n: int) -> None:
    points = sample_ring(n, generator=torch.Generator().manual_seed(seed), std=0.1)
    base = ring_quality(points)
    diluted = ring_quality(torch.cat([points, torch.zeros(n, 2)]))
    assert diluted.modes_captured == base.modes_captured
    assert diluted.high_quality == pytest.approx(base.high_quality / 2)
