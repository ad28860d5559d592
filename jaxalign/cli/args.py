"""The argument groups and argument types the `jaxalign` subcommands share (model, trainer/engine policy, replay,
generation, meshes, --json), built once, and the `UsageError` every subcommand reports with exit code 2. Defaults
come from where the behaviour is defined -- the signature of the function a command calls (`compare`, `localize`,
`run_check`) or a config dataclass's field -- never from a repeated literal here."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
from typing import Any, Callable

from jaxalign import loading
from jaxalign.model.config import preset_names
from jaxalign.model.sharding import make_mesh, parse_mesh_spec
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import NumericPolicy
from jaxalign.replay_modes import REPLAY_MODES

# the pair compare and localize study by default: a typical trainer and a fast serving engine
GAP_PAIR = {"trainer": "train-bf16", "engine": "serve-bf16"}
COMMAND_MODEL = "small"  # the model preset compare and localize build by default


class UsageError(Exception):
    """A command used wrongly (an option combination, a file that is not what the command needs): reported as
    `jaxalign CMD: error: ...` with exit code 2, without a traceback."""


def ints(minimum: int, example: str):
    """An argparse type: a comma-separated list of ints, each >= minimum."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints") from None
        if not values or min(values) < minimum:
            kind = "positive" if minimum == 1 else "non-negative"
            raise argparse.ArgumentTypeError(f"{text!r}: allowed: {kind} ints, e.g. {example}")
        return values
    return parse


int_list = ints(1, "1,8,32")
int_list_nonneg = ints(0, "0,1,2")


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: a positive int")
    return value


def model_preset(name: str) -> str:
    """An argparse type: a model preset name."""
    if name not in preset_names():
        raise argparse.ArgumentTypeError(f"unknown model preset {name!r}; allowed: {', '.join(preset_names())}")
    return name


def str_list(text: str) -> tuple[str, ...]:
    """An argparse type: comma-separated strings (empty items dropped)."""
    return tuple(v.strip() for v in text.split(",") if v.strip())


def param_default(func: Callable, name: str) -> Any:
    """The default of parameter `name` of `func` (the one definition of a command's default)."""
    default = inspect.signature(func).parameters[name].default
    if default is inspect.Parameter.empty:
        raise TypeError(f"{func.__qualname__}() has no default for {name!r}")
    return default


def field_default(config_class: type, name: str) -> Any:
    """The default of field `name` of a config dataclass."""
    field = {f.name: f for f in dataclasses.fields(config_class)}[name]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise TypeError(f"{config_class.__name__}.{name} has no default")


def policy_arg(text: str) -> NumericPolicy:
    """An argparse type: a policy string (a preset, optionally with overrides), parsed once."""
    try:
        return NumericPolicy.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def model_spec(text: str) -> str:
    """An argparse type: a model preset name or a directory (a transformers or a jaxalign checkpoint, loaded by
    `jaxalign.loading.load_model`)."""
    if text in preset_names() or os.path.isdir(text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a model preset nor a directory; allowed: a transformers "
                                     f"checkpoint directory, a jaxalign checkpoint directory, or one of "
                                     f"{', '.join(preset_names())}")


def add_model_args(p: argparse.ArgumentParser, *, default: str | None, required: bool = False) -> None:
    """--model (a preset or a checkpoint directory) and --model-seed."""
    p.add_argument("--model", type=model_spec, default=default, required=required, metavar="PRESET|DIR",
                   help="a model preset (randomly initialised with --model-seed), a transformers checkpoint "
                        "directory (config.json and safetensors) or a jaxalign checkpoint directory")
    p.add_argument("--model-seed", type=int, default=0, help="parameter init seed of a preset model")


def load_model(args: argparse.Namespace) -> Transformer:
    """The model --model names (--model-seed initialises a preset)."""
    return loading.load_model(args.model, args.model_seed)


def add_policy_args(p: argparse.ArgumentParser, *, trainer: str, engine: str, trainer_help: str = "trainer policy",
                    engine_help: str = "engine policy", external_engine: bool = False) -> None:
    """--trainer and --engine: policy strings, parsed once; defaults are preset names. With `external_engine`,
    --engine also takes `vllm[:DTYPE]` (`jaxalign.engines.parse_engine`: a `VllmSpec` instead of a policy)."""
    for option, default, what in (("--trainer", trainer, trainer_help), ("--engine", engine, engine_help)):
        external = external_engine and option == "--engine"
        p.add_argument(option, type=engine_arg if external else policy_arg, default=default,
                       metavar="POLICY|vllm[:DTYPE][,sync=METHOD]" if external else "POLICY",
                       help=f"{what}: a preset or a policy string, e.g. {default},kernel=tiled:8 (see jaxalign "
                            "policies)" + ("; or vllm[:DTYPE][,sync=reload|inplace] (DTYPE bf16, fp16, fp32): vLLM "
                                           "run as a separate process (docs/vllm.md)" if external else ""))


def engine_arg(text: str):
    """An argparse type: `vllm[:DTYPE]` (a `jaxalign.engines.VllmSpec`) or a policy string (a NumericPolicy)."""
    from jaxalign.engines import parse_engine
    try:
        return parse_engine(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_replay_arg(p: argparse.ArgumentParser, *, func: Callable, choices: tuple[str, ...] = REPLAY_MODES,
                   help: str) -> None:
    """--replay, its choices from `jaxalign.replay_modes` and its default from `func`'s `replay` parameter."""
    p.add_argument("--replay", choices=choices, default=param_default(func, "replay"), help=help)


def add_generation_args(p: argparse.ArgumentParser, *, func: Callable, prompts_help: str = "number of prompts") -> None:
    """--prompts N (a count), --max-new-tokens and --seed, with `func`'s defaults (`n_prompts`, `max_new_tokens`,
    `seed`)."""
    p.add_argument("--prompts", type=positive_int, default=param_default(func, "n_prompts"), metavar="N",
                   help=prompts_help)
    p.add_argument("--max-new-tokens", type=positive_int, default=param_default(func, "max_new_tokens"),
                   help="tokens the engine generates after each prompt")
    p.add_argument("--seed", type=int, default=param_default(func, "seed"), help="prompt and sampling seed")


def add_json_arg(p: argparse.ArgumentParser, help: str = "print the result as one JSON object") -> None:
    """--json."""
    p.add_argument("--json", action="store_true", help=help)


def checked_text(validate: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type that keeps the text but refuses it, with `validate`'s ValueError message, when
    `validate(text)` raises."""
    def arg_type(text: str) -> str:
        try:
            validate(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text
    return arg_type


def _mesh_spec(text: str) -> str:
    return checked_text(parse_mesh_spec)(text)


def add_mesh_args(p: argparse.ArgumentParser) -> None:
    """--trainer-mesh, --engine-mesh and --host-devices."""
    p.add_argument("--trainer-mesh", type=_mesh_spec, default=None,
                   help="trainer-side device mesh, e.g. fsdp=4,tensor=2 (axes data, fsdp, expert, tensor; default: "
                        "none, one device)")
    p.add_argument("--engine-mesh", type=_mesh_spec, default=None,
                   help="engine-side device mesh, e.g. tensor=8 (default: none, one device)")
    p.add_argument("--host-devices", type=positive_int, default=None,
                   help="on CPU, fake this many devices (sets XLA_FLAGS before JAX starts; default: the real ones)")


def meshes(args: argparse.Namespace):
    """(trainer mesh, engine mesh) from --trainer-mesh / --engine-mesh (None where not given)."""
    return tuple(None if spec is None else make_mesh(spec) for spec in (args.trainer_mesh, args.engine_mesh))


def output_dir(path: str, option: str = "--out") -> str:
    """Create the output directory `path` (and its parents) before a long run starts; UsageError naming it when
    it is a file or cannot be created."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{option} {path}: exists and is not a directory") from None
    except OSError as err:
        raise UsageError(f"{option} {path}: cannot create the directory ({err.strerror})") from None
    return path


def default_text(value: Any) -> str:
    """How a default reads in --help: lists comma-separated, a policy by its string, None as none."""
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or '""'
    return str(value)


def finish(parser: argparse.ArgumentParser) -> None:
    """For `parser` and its subcommands: append `(default: X)` to the help of every option that takes a value, is
    not required and does not state its default already; and accept options only by their full names (with
    abbreviations, `--prompts F` would silently mean `--prompts-file F` where only that exists)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                finish(sub)
        elif (action.option_strings and action.nargs != 0 and not action.required and action.help
              and action.help is not argparse.SUPPRESS and "default" not in action.help):
            action.help += " (default: " + default_text(action.default).replace("%", "%%") + ")"
