"""fabric_multimodel.run.cli: the averaging flags. Whatever combination the flags' check lets through, the Averager's
own checks take (a property test over every flag); what it refuses is one line naming a flag. The launch and
membership flags, and the parser whose errors are one line, also in torch elastic's failure report."""

from __future__ import annotations

import argparse
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_multimodel.averaging.arguments import check_fragments
from fabric_multimodel.averaging.config import AveragerConfig
from fabric_multimodel.run import cli
from fabric_multimodel.run.cli import (
    COMM_DTYPES,
    add_averager_arguments,
    averager_options,
    check_averager_arguments,
    in_flag_words,
)


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
    "--density": st.sampled_from([None, "1", "1/64", "0.0156", "0", "2/1"]),
    "--error-decay": st.sampled_from([None, "0.95", "0.5", "1.5"]),
    "--robust": st.sampled_from(["none", "clip", "trimmed_mean"]),
    "--trim": st.sampled_from([None, "0.25", "0.4", "0.5"]),
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
    try:
        parser, args = parsed(argv)
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
        (["--period", "8", "--fragments", "3"], r"--period \(8\) must be a multiple of the number of fragments \(3\)"),
        (["--period", "8", "--overlap-steps", "8"], r"--overlap-steps \(8\) must be smaller than --period \(8\)"),
        (["--period", "8", "--error-feedback"], "--error-feedback keeps what block quantization drops; it needs a low"),
        (["--period", "auto", "--warmup-steps", "1"], "--period auto times the warm-up's steps"),
        (["--period", "8", "--pace", "speed", "--fragments", "2"], "--pace speed times .* no --fragments, --overlap"),
        (["--period", "0", "--pace", "speed"], "--pace speed needs --period N"),
        (["--period", "8", "--mixing", "progress"], "--mixing progress .* needs --overlap-steps"),
        (["--period", "8", "--mixing", "0.5"], "--mixing sets how overlapped rounds merge; set --overlap-steps too"),
        (["--period", "8", "--density", "1/64", "--comm-dtype", "float8_e4m3fn"], "combined with --comm-dtype"),
        (["--period", "8", "--error-decay", "0.5"], "--error-decay is the decay .* set --density below 1 too"),
        (["--period", "0", "--density", "1/64"], "--density, --robust and --fragments need --period N"),
        (["--period", "8", "--density", "1/0"], "argument --density: invalid fraction value"),
        (["--period", "8", "--density", "2"], "argument --density: invalid fraction value"),
        (["--period", "0", "--robust", "clip"], "--density, --robust and --fragments need --period N"),
        (["--period", "8", "--trim", "0.3"], "--trim is the trimmed mean's; set --robust trimmed_mean too"),
        (["--period", "8", "--robust", "trimmed_mean", "--trim", "0.5"], "--trim is the share trimmed from each"),
        (["--period", "8", "--robust", "clip", "--density", "1/64"], "--robust .* cannot be combined with"),
    ],
)
def test_a_combination_the_averager_cannot_take_is_one_line_naming_the_flags(argv, message) -> None:
    with pytest.raises(Refused, match=message):
        check_averager_arguments(*parsed(argv))


@given(
    st.sampled_from(["period", "overlap_steps", "error_feedback", "node_period"]), st.sampled_from(["", "=8", "='x'"])
)
def test_an_option_is_said_as_its_flag(name: str, value: str) -> None:
    said = in_flag_words(f"`{name}{value}` and `{name}`")
    flag = "--" + name.replace("_", "-")
    assert said == f"{flag}{' ' + value[1:].strip(chr(39)) if value else ''} and {flag}"


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
    _, sparse = parsed(["--period", "4", "--density", "1/64", "--error-decay", "0.9"])
    # sparse rounds keep the optimizers' state local, as DiLoCo does: averaging it would send it all, dense
    assert averager_options(sparse, optimizers=["adam"]) == {
        "period": 4, "warmup_steps": 3, "overlap_steps": 0, "density": 1 / 64, "error_decay": 0.9
    }  # fmt: skip
    _, robust = parsed(["--period", "4", "--robust", "trimmed_mean", "--trim", "0.3"])
    assert averager_options(robust, optimizers=["adam"]) == {  # each site's optimizer state stays its own
        "period": 4, "warmup_steps": 3, "overlap_steps": 0, "robust": "trimmed_mean", "trim": 0.3
    }  # fmt: skip


LAUNCHERS = {  # an environment variable each launcher sets, and the flag of its own for the processes per node
    "torchrun": ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"}, "--nproc-per-node"),
    "fabric run": ({"LT_CLI_USED": "1"}, "--devices"),
}


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("LT_CLI_USED", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--devices", "0"], "--devices must be >= 1, got 0"),
        (["--num-nodes", "0"], "--num-nodes must be >= 1, got 0"),
        (["--timeout", "nan"], "--timeout must be a positive number"),
        (["--timeout", "-1"], "--timeout must be a positive number"),
        (["--coordinator", "h:1", "--site", "a"], "--coordinator needs --period"),
        (["--coordinator", "h:1", "--period", "8", "--site", ""], "--coordinator needs --site NAME"),
        (
            ["--coordinator", "h:1", "--period", "8", "--site", "a#b"],
            "--coordinator needs --site NAME: a site's name is 1 to 64",
        ),
        (["--min-sites", "0"], "--min-sites must be >= 1"),
    ],
)
def test_launch_and_membership_flags_refused_in_one_line(argv, message, no_launcher) -> None:
    parser = Parser()
    add_averager_arguments(parser)
    cli.add_launch_arguments(parser)
    cli.add_membership_arguments(parser)
    args = parser.parse_args(argv)
    with pytest.raises(Refused, match=re.escape(message)):
        cli.check_launch_arguments(parser, args)
        cli.check_membership_arguments(parser, args)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_flag_the_launcher_owns_names_the_launchers_own(launcher, no_launcher) -> None:
    environment, theirs = LAUNCHERS[launcher]
    for name, value in environment.items():
        no_launcher.setenv(name, value)
    parser = Parser()
    cli.add_launch_arguments(parser)
    cli.add_membership_arguments(parser)
    cli.check_launch_arguments(parser, parser.parse_args([]))  # nothing given: fine
    assert cli.membership(parser.parse_args([]), device="cpu") is None  # no --coordinator: no membership
    with pytest.raises(Refused, match=f"--devices: {launcher} started the processes; give {theirs} to {launcher}"):
        cli.check_launch_arguments(parser, parser.parse_args(["--devices", "2"]))


def test_the_parser_errors_in_one_line_also_for_torch_elastic(tmp_path, monkeypatch, capsys) -> None:
    report = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(report))
    parser = cli.Parser("train.py", "a script")
    parser.add_argument("--steps", type=int, default=10, help="steps to train")
    assert "(default: 10)" in parser.format_help()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--steps", "many"])
    assert exit_info.value.code == 2
    line = "train.py: error: argument --steps: invalid int value: 'many'"
    assert capsys.readouterr().err == line + "\n"
    assert json.loads(report.read_text())["message"] == line
