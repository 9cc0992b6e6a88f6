"""`AveragerConfig`: what an Averager does, as one checked value; the keyword shorthand builds the same one."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lightning_fabric import Fabric
from torch import nn

from fabric_multimodel import Averager, AveragerConfig, setup_models

DTYPES = [None, torch.bfloat16, torch.float8_e4m3fn, torch.float4_e2m1fn_x2]


@st.composite
def configs(draw):
    """A valid config: period a multiple of the fragments, overlap below the spacing, mixing only with overlap."""
    fragments = draw(st.sampled_from([1, 2, 4]))
    period = fragments * draw(st.integers(1, 8))
    overlap = draw(st.integers(0, period // fragments - 1))
    comm_dtype = draw(st.sampled_from(DTYPES))
    return AveragerConfig(
        period=period,
        warmup_steps=draw(st.integers(0, 5)),
        outer_optimizer=draw(st.sampled_from([None, functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9)])),
        comm_dtype=comm_dtype,
        error_feedback=draw(st.booleans()) and comm_dtype in (torch.float8_e4m3fn, torch.float4_e2m1fn_x2),
        overlap_steps=overlap,
        fragments=fragments,
        mixing=draw(st.sampled_from([None, 0.5])) if overlap else None,
        check_finite=draw(st.booleans()),
    )


@given(config=configs())
def test_the_keyword_shorthand_builds_the_same_config(config):
    fields = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    assert AveragerConfig.build(None, fields, "Averager") == config
    replaced = AveragerConfig.build(config, {"warmup_steps": config.warmup_steps + 1}, "Averager")
    assert replaced.warmup_steps == config.warmup_steps + 1
    assert dataclasses.replace(replaced, warmup_steps=config.warmup_steps) == config  # the original is unchanged


@given(config=configs())
def test_ranks_agree_on_configs_whose_factories_differ_only_in_identity(config):
    # Each rank builds its own factory object (a lambda's repr holds its address): only its presence counts.
    def own(params):
        return torch.optim.SGD(params, lr=0.7)

    if config.outer_optimizer is None:
        assert config.agreement() == dataclasses.replace(config).agreement()
        assert config.agreement() != dataclasses.replace(config, outer_optimizer=own).agreement()
    else:
        assert config.agreement() == dataclasses.replace(config, outer_optimizer=own).agreement()
    assert repr(config.agreement()) == repr(dataclasses.replace(config).agreement())


@given(config=configs(), steps=st.integers(0, 20))
def test_an_averager_from_a_config_or_from_keywords_does_the_same(config, steps):
    fabric = Fabric(accelerator="cpu", devices=1)
    (m,) = setup_models(fabric, m=nn.Sequential(nn.Linear(3, 8), nn.Linear(8, 2)))
    fields = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    by_config, by_keywords = Averager(fabric, m, config), Averager(fabric, m, **fields)
    assert by_config.config == by_keywords.config == config
    for step in range(1, steps + 1):
        assert by_config.schedule.at(step) == by_keywords.schedule.at(step)


@pytest.mark.parametrize(
    ("fields", "error", "words"),
    [
        ({"period": 0}, ValueError, "`period` must be >= 1"),
        ({"period": 4, "comm_dtype": torch.int8}, TypeError, "`comm_dtype`"),
        ({"period": 4, "error_feedback": True}, ValueError, "`error_feedback`"),
        ({"period": 4, "mixing": 0.5}, ValueError, "`mixing`"),
        ({"period": 4, "mixing": 2.0, "overlap_steps": 1}, ValueError, "`mixing`"),
        ({"period": 4, "outer_optimizer": torch.optim.SGD([torch.zeros(1)], lr=1)}, TypeError, "factory"),
        ({"period": 4, "node_period": 3}, ValueError, "multiple of `node_period`"),
        ({"period": 4, "node_period": 2, "fragments": 2}, ValueError, "two-level averaging"),
    ],
)
def test_a_bad_config_is_an_error_naming_the_field(fields, error, words):
    with pytest.raises(error, match=re.escape(words)):
        AveragerConfig(**fields)


def test_the_trainer_callback_takes_the_same_config():
    from fabric_multimodel.lightning import ModelAveraging

    config = AveragerConfig(period=8, warmup_steps=4, comm_dtype=torch.bfloat16)
    assert ModelAveraging(config=config).config == config
    assert ModelAveraging(period=8, warmup_steps=4, comm_dtype=torch.bfloat16).config == config
    with pytest.raises(TypeError, match="unknown option"):
        ModelAveraging(config=config, perod=2)
    with pytest.raises(ValueError, match="node_period"):
        ModelAveraging(period=8, node_period=4)


@given(config=configs())
def test_a_config_prints_on_one_line_what_differs_from_the_defaults(config):
    printed = str(config)
    assert "\n" not in printed and printed.startswith(f"period={config.period}")
    for field in dataclasses.fields(config):
        differs = field.default is dataclasses.MISSING or getattr(config, field.name) != field.default
        assert (f"{field.name}=" in printed) == differs, (field.name, printed)
    if config.outer_optimizer is not None:
        assert "outer_optimizer=SGD(lr=0.7, momentum=0.9)" in printed
