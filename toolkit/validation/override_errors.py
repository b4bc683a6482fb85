"""Mistakes on the command line, found by Hydra, as gridwright's one-line errors.

A misspelt key, an unknown group option or preset, a value of the wrong type and an
override that does not parse are input mistakes like those validation refuses: one line
starting `error: `, exit code 2, nothing started. `@hydra.main` would print them as
several lines of its own (advising `+train.stpes=5` for a typo of `train.steps`) and exit
1, so `command_line_error` composes the command line once with Hydra's compose API before
`@hydra.main` runs, and words what Hydra raises. A sweep (-m) is composed once for each
value of each swept override, so that no point of it starts when one cannot compose.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from ..config.compose import strip_hydra
from ..config.schema import RunConfig

GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def command_line_error(argv: list[str], config_dir: Path) -> str | None:
    """The first mistake Hydra would find composing `argv` (launch.py's arguments), as one
    line; None when every point composes, or when the command is one that Hydra answers
    without composing this config tree (--help, --version, tab completion, --config-path)."""
    # The parser @hydra.main reads sys.argv with: flags and overrides are split as it splits them.
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.exit_on_error = False  # a malformed flag is left to Hydra to report
    try:
        args, unparsed = parser.parse_known_args(argv)
    except argparse.ArgumentError:
        return None
    if unparsed or args.help or args.hydra_help or args.shell_completion or args.config_path \
            or args.experimental_rerun:
        return None
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        try:
            overrides = parser.parse_overrides(args.overrides)
        except OverrideParseException as e:
            return unparsable_message(e)
        multirun = args.multirun or any(o.key_or_group == "hydra.mode" and o.value() == "MULTIRUN"
                                        for o in overrides)
        sweeps = [o for o in overrides if o.is_sweep_override()]
        if sweeps and not multirun:
            return (f"error: {sweeps[0].input_line} gives several values: add -m (--multirun) to run one "
                    f"job for each, or write a list value as {sweeps[0].key_or_group}=[...].")
        if any(o.is_interval_sweep() for o in sweeps):
            return None  # a sweeper plugin's search space: its points are not known before it runs
        for point in sweep_points(overrides):
            problem = composition_error(args.config_name or "config", point)
            if problem:
                return problem
    return None


def sweep_points(overrides: list[Override]) -> list[list[str]]:
    """The first point (every override at its first value), then one point for each other
    value of each sweep: every value is composed once, without composing the whole product."""
    values = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
              else [o.input_line] for o in overrides]
    first = [v[0] for v in values]
    return [first] + [first[:i] + [other] + first[i + 1:] for i, v in enumerate(values) for other in v[1:]]


def composition_error(config_name: str, point: list[str]) -> str | None:
    """Compose one point as `run` will (Hydra's composition, then the typed schema's merge)."""
    try:
        cfg = compose(config_name=config_name, overrides=point)
    except MissingConfigException as e:
        if e.options is None:  # the primary config itself
            return f"error: {joined(str(e))}"
        group, _, name = e.missing_cfg_file.rpartition("/")
        runs_here = (lambda option: _validates_with(config_name, point, group, option)) \
            if group in MACHINE_GROUPS else None
        return no_option_message(group, name, e.options, runs_here)
    except HydraException as e:
        return composition_message(e, e.__cause__, point)
    try:
        strip_hydra(cfg)
    except (ConfigKeyError, ConfigAttributeError, ValidationError) as e:  # `+key` the schema lacks, or its value
        return composition_message(None, e, point)
    except OmegaConfBaseException:
        pass  # `${hydra:...}` has no value before @hydra.main runs; `run` words any other
    return None


def composition_message(error: HydraException | None, cause: BaseException | None, point: list[str]) -> str:
    """Hydra's error and the OmegaConf error under it, worded where gridwright knows the mistake."""
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        return unknown_key_message(cause)
    if isinstance(cause, ValidationError) and cause.full_key:
        return wrong_value_message(cause, point)
    said = [joined(str(error)) if error else "", str(cause).splitlines()[0] if cause else ""]
    return "error: " + ": ".join(x for x in said if x)


def unknown_key_message(e) -> str:
    """One line for a key the schema does not have, with the nearest one it does."""
    key = getattr(e, "full_key", None) or getattr(e, "key", None) or "?"
    parent, _, leaf = str(key).rpartition(".")
    schema = OmegaConf.structured(RunConfig)
    node = OmegaConf.select(schema, parent) if parent else schema
    known = list(node.keys()) if isinstance(node, DictConfig) else []
    near = difflib.get_close_matches(leaf, known, n=1)
    hint = f" Did you mean {parent + '.' if parent else ''}{near[0]}?" if near else ""
    return f"error: {key} is not a key of the experiment's schema (gridwright.config.schema).{hint}"


# Groups whose options are what the machine can run: a misspelt one is offered only an option
# that validates here (`precision=fp8` was offered mxfp8, which runs on Blackwell only).
MACHINE_GROUPS = ("precision",)


def no_option_message(group: str, name: str, options: list[str], runs_here=None) -> str:
    """A config group's option or an experiment preset that no yaml file of the group has;
    the hint is the nearest option (by spelling, or one containing the name), and with
    `runs_here(option) -> bool`, the nearest that validates on this machine."""
    def likeness(option: str) -> float:
        return difflib.SequenceMatcher(None, name, option).ratio()

    ranked = sorted(options, key=lambda o: (likeness(o), o), reverse=True)  # difflib's order of ties
    near = [o for o in ranked if likeness(o) >= 0.6 or name in o]
    if runs_here is not None:
        near = [o for o in near if runs_here(o)]
    what = {"experiment": "experiment preset", "bench": "benchmark preset"}.get(group, f"{group} option")
    hint = f" Did you mean {near[0]}?" if near else ""
    return f"error: no {what} '{name}'.{hint} Choices: {', '.join(options)}"


def _validates_with(config_name: str, point: list[str], group: str, option: str) -> bool:
    """Whether the command line, with `option` for `group`, composes and validates for a launch here."""
    from .validate import ConfigError, validate

    swapped = [f"{o.split('=', 1)[0]}={option}" if o.lstrip("+~").split("=", 1)[0] == group else o for o in point]
    try:
        validate(strip_hydra(compose(config_name=config_name, overrides=swapped)), for_launch=True)
    except (ConfigError, HydraException, OmegaConfBaseException):
        return False
    return True


def wrong_value_message(e: ValidationError, point: list[str]) -> str:
    """A value the schema's type for its key cannot hold, as given on the command line."""
    key = e.full_key
    given = [o.input_line.split("=", 1)[1] for o in OverridesParser.create().parse_overrides(point)
             if o.key_or_group == key and not o.is_delete()]
    expected, reason = expected_type(key), e.msg.splitlines()[0]
    if expected and given:
        return f"error: {key} must be {expected}, not {given[-1]!r}."
    return f"error: {key}{'=' + given[-1] if given else ''}: {reason}."


def unparsable_message(e: OverrideParseException) -> str:
    """An override Hydra's grammar rejects; the key before `=` is the user's, so its type helps."""
    key = e.override.partition("=")[0].lstrip("~+").partition("@")[0]
    expected = expected_type(key)
    needs = f" {key} takes {expected}." if expected else ""
    return f"error: cannot parse {e.override!r}: {e.message.splitlines()[0]}.{needs} Override syntax: {GRAMMAR}"


TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
              dict: "a mapping"}


def expected_type(key: str) -> str | None:
    """The schema's type of a dotted key in words ("an integer or null"); None outside the schema."""
    hint: typing.Any = RunConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(hint):
            return None
        hint = typing.get_type_hints(hint).get(part)
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) is typing.Union and type(None) in args
    if optional:
        hint = next(a for a in args if a is not type(None))
    words = TYPE_WORDS.get(typing.get_origin(hint) or hint)
    if words is None:
        return None
    return words + (" or null" if optional else "")


def joined(text: str) -> str:
    """Hydra's message on one line, without the config search path it lists."""
    text = text.split("Config search path:")[0]
    return " ".join(line.strip() for line in text.splitlines() if line.strip())
