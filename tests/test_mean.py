"""``rounds.mean_``: a summed payload becomes its mean, checked for NaN and Inf in the same pass.

It takes the ``device`` fixture, so ``--device cuda`` runs it on the GPU's fused kernel.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_multimodel.rounds.round import mean_

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@settings(max_examples=60)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    dtype_index=st.integers(0, len(DTYPES) - 1),
    world=st.integers(1, 8),
    bad=st.sampled_from([None, float("nan"), float("inf"), float("-inf")]),
    where=st.floats(0, 1, exclude_max=True),
    seed=st.integers(0, 2**16),
)
def test_a_sum_becomes_its_mean_and_any_nan_or_inf_is_found(device, sizes, dtype_index, world, bad, where, seed):
    dtype = DTYPES[dtype_index]
    g = torch.Generator().manual_seed(seed)
    sums = [(torch.randn(n, generator=g) * world).to(dtype).to(device) for n in sizes]
    if bad is not None and sum(sizes):
        flat = [(t, i) for t in sums for i in range(t.numel())]
        t, i = flat[int(where * len(flat))]
        t[i] = bad
    before = [t.clone() for t in sums]
    finite = mean_(sums, world)
    assert finite == (bad is None or not sum(sizes))
    for after, summed in zip(sums, before):
        assert after.dtype == dtype and after.shape == summed.shape
        if world & (world - 1) == 0:  # a power of two: exactly the division, NaN and Inf included
            assert torch.equal(after.isnan(), summed.isnan())
            ok = ~summed.isnan()
            assert torch.equal(after[ok], (summed / world)[ok])
        else:  # one rounding of the reciprocal's product, in the dtype
            ok = summed.isfinite()
            wanted = summed.double() / world
            tolerance = {torch.float32: 2**-22, torch.float64: 2**-50}.get(dtype, 2**-7)
            assert ((after[ok].double() - wanted[ok]).abs() <= tolerance * wanted[ok].abs() + 1e-30).all()
