"""Flat storage (fabric_multimodel.comm.flat) in one process: tensors re-homed into one buffer per dtype, and parts.

Every test takes the ``device`` fixture, so ``--device cuda`` runs them with CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch

from fabric_multimodel.comm.flat import FlatStorage


def tensors_on(device: torch.device) -> list[torch.Tensor]:
    """Two fp32 tensors, an fp64 one, then fp32 and bf16 again: three buffers, fp32's tensors not all adjacent."""
    g = torch.Generator().manual_seed(0)
    specs = [((3, 4), torch.float32), ((5,), torch.float32), ((2, 2), torch.float64), ((7,), torch.float32)]
    made = [torch.randn(shape, generator=g, dtype=dtype) for shape, dtype in specs]
    made.append(torch.randn(6, generator=g).bfloat16())
    return [torch.nn.Parameter(t.to(device)) for t in made]


def test_each_tensor_becomes_a_view_of_its_dtypes_buffer_keeping_its_identity_and_values(device):
    tensors = tensors_on(device)
    before = [t.detach().clone() for t in tensors]
    storage = FlatStorage(tensors, [f"t{i}" for i in range(5)], spare=3)
    assert [b.dtype for b in storage.buffers] == [torch.float32, torch.float64, torch.bfloat16]
    assert all(b.device == device for b in storage.buffers)
    assert storage.sizes == [12 + 5 + 7, 4, 6] and storage.buffers[0].numel() == 24 + 3
    # The storage holds them buffer by buffer: its positions (what parts and slots use) are in that order.
    order = [0, 1, 3, 2, 4]
    assert all(s is tensors[i] for s, i in zip(storage.tensors, order))
    assert storage.names == [f"t{i}" for i in order]
    assert storage.slots == [(0, 0, 12), (0, 12, 5), (0, 17, 7), (1, 0, 4), (2, 0, 6)]
    for t, i, (b, offset, numel) in zip(storage.tensors, order, storage.slots):
        assert torch.equal(t.detach(), before[i]) and t.shape == before[i].shape and t.numel() == numel
        assert t.data_ptr() == storage.buffers[b][offset:].data_ptr()
    assert torch.equal(storage.spare, torch.zeros(3, device=device))
    assert [d.numel() for d in storage.data] == storage.sizes and storage.intact()


def test_writing_a_buffer_writes_every_tensor_and_an_optimizer_step_writes_the_buffer(device):
    tensors = tensors_on(device)
    storage = FlatStorage(tensors)
    before = [t.detach().clone() for t in tensors]
    for flat in storage.buffers:
        flat.mul_(2)
    assert all(torch.equal(t.detach(), 2 * old) for t, old in zip(tensors, before))
    for t in tensors:
        t.grad = torch.ones_like(t)
    torch.optim.SGD(tensors, lr=0.5).step()
    assert torch.equal(storage.buffers[1], (2 * before[2] - 0.5).reshape(-1))
    assert storage.intact()


def test_new_storage_detaches_a_tensor_and_intact_says_so(device):
    tensors = tensors_on(device)
    storage = FlatStorage(tensors)
    tensors[3].data = tensors[3].data.clone()
    assert not storage.intact()


def test_a_part_is_one_range_of_each_buffer_and_cuts_mirrors_alike(device):
    storage = FlatStorage(tensors_on(device))
    part = storage.part([1, 2, 3])  # storage positions: t1 and t3 (fp32), t2 (fp64)
    assert part.ranges == [(12, 24), (0, 4), (0, 0)] and part.sizes == [12, 4, 0] and not part.whole
    assert part.data[0].data_ptr() == storage.tensors[1].data_ptr()
    anchor = storage.mirror()
    assert [a.shape for a in anchor] == [d.shape for d in storage.data]
    assert all(a.device == device and not a.any() for a in anchor)
    for cut, flat in zip(part.of(anchor), part.data):
        cut.copy_(flat)
    assert torch.equal(anchor[0][12:], storage.data[0][12:]) and not anchor[0][:12].any()
    assert storage.part(range(5)).whole
    with pytest.raises(ValueError, match="consecutive"):
        storage.part([0, 2])  # t0 and t3 have t1 between them in the fp32 buffer


def test_views_and_nonfinite_name_the_tensors_of_a_mirror(device):
    storage = FlatStorage(tensors_on(device), ["w", "b", "double", "v", "half"])
    mirror = storage.mirror()
    views = storage.views(mirror, [0, 4])
    assert [v.shape for v in views] == [(3, 4), (6,)] and views[1].dtype == torch.bfloat16
    assert storage.nonfinite(mirror) == []
    views[1][2] = float("nan")
    storage.views(mirror, [3])[0][1, 1] = float("inf")  # storage position 3: the fp64 tensor
    assert storage.nonfinite(mirror) == ["double", "half"]
