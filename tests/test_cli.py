"""fabric_multimodel.cli: the averaging flags. Whatever combination the flags' check lets through, the Averager's
own checks take (a property test over every flag); what it refuses is one line naming a flag."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_multimodel.arguments import check_fragments
from fabric_multimodel.cli import COMM_DTYPES, add_averager_arguments, averager_options, check_averager_arguments
from fabric_multimodel.config import AveragerConfig


class Refused(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise Refused(message)


def parsed(argv: list[str]) -> tuple[Parser, argparse.Namespace]:
    parser = Parser()
    add_averager_arguments(parser, warmup_steps=3)
    return parser, parser.parse_args(argv)


FLAGS = {
    "--period": st.sampled_from(["0", "1", "4", "6", "8", "16", "auto", "-1"]),
    "--warmup-steps": st.integers(-1, 4).map(str),
    "--overlap-steps": st.sampled_from(["0", "1", "2", "3", "auto"]),
    "--outer": st.sampled_from(["none", "nesterov"]),
    "--outer-momentum": st.sampled_from(["0", "0.9", "1"]),
    "--comm-dtype": st.sampled_from(COMM_DTYPES),
    "--error-feedback": st.booleans(),
    "--fragments": st.integers(0, 4).map(str),
    "--mixing": st.sampled_from([None, "0", "0.5", "1", "1.5", "progress"]),
    "--pace": st.sampled_from(["steps", "speed"]),
}


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries(FLAGS))
def test_what_the_flags_let_through_the_averager_takes(values) -> None:
    argv = []
    for flag, value in values.items():
        if value is True:
            argv.append(flag)
        elif value not in (None, False):
            argv += [flag, value]
    parser, args = parsed(argv)
    try:
        check_averager_arguments(parser, args)
    except Refused as refused:
        assert "--" in str(refused)  # names a flag
        return
    options = averager_options(args, optimizers=[])
    if not options:
        assert args.period == 0
        return
    options.pop("optimizers", None)
    config = AveragerConfig(**options)  # raises on anything the Averager refuses
    if config.period != "auto":
        check_fragments(config.fragments, config.period, config.first_overlap, [])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--period", "0", "--outer", "nesterov"], "need --period N"),
        (["--period", "8", "--fragments", "3"], "--fragments F needs a --period that F divides"),
        (["--period", "8", "--overlap-steps", "8"], "--overlap-steps must be smaller than --period"),
        (["--period", "8", "--error-feedback"], "--error-feedback needs a float8 or float4 --comm-dtype"),
        (["--period", "auto", "--warmup-steps", "1"], "--period auto times the warm-up's steps"),
        (["--period", "8", "--pace", "speed", "--fragments", "2"], "--pace speed needs"),
    ],
)
def test_a_combination_the_averager_cannot_take_is_one_line_naming_the_flags(argv, message) -> None:
    parser, args = parsed(argv)
    with pytest.raises(Refused, match=message):
        check_averager_arguments(parser, args)


def test_the_options_build_what_the_flags_say() -> None:
    parser, args = parsed(["--period", "8", "--fragments", "2", "--overlap-steps", "1", "--outer", "nesterov",
                           "--comm-dtype", "float8_e4m3fn"])  # fmt: skip
    check_averager_arguments(parser, args)
    options = averager_options(args, optimizers=["adam"])
    outer = options.pop("outer_optimizer")
    assert outer.keywords == {"lr": 0.7, "momentum": 0.9, "nesterov": True, "foreach": True}
    assert str(options.pop("comm_dtype")) == "torch.float8_e4m3fn"
    assert options == {"period": 8, "warmup_steps": 3, "overlap_steps": 1, "fragments": 2, "mixing": 0.5}
    _, plain = parsed(["--period", "4"])
    assert averager_options(plain, optimizers=["adam"])["optimizers"] == ["adam"]  # blocking rounds average them
