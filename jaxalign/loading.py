"""Loading a model from what a user names: a preset, a transformers checkpoint directory or a jaxalign (orbax)
checkpoint. Every command loads through here (`jaxalign.cli.args.load_model`); `jaxalign.check.load_model` is this
function, kept importable there.

Loading is where bad input arrives: a directory without a config.json, a config.json that is not an object, or
one that parses but lacks a field its family needs is a `ValueError` naming the file and the field (the `jaxalign`
command reports it with exit code 2), never a `KeyError` traceback.
"""

from __future__ import annotations

import os

from jaxalign.model.transformer import Transformer


def is_transformers_dir(path: str) -> bool:
    """Whether `path` is a directory holding a transformers checkpoint (a config.json, not a jaxalign `params/`)."""
    return (os.path.isdir(path) and not os.path.isdir(os.path.join(path, "params"))
            and os.path.exists(os.path.join(path, "config.json")))


def check_transformers_config(path: str) -> dict:
    """The config.json of the transformers checkpoint directory `path`, checked: it must parse to an object whose
    `model_type` is a supported family and which has every field that family reads. Returns the dict; raises
    ValueError naming the file and the missing or unsupported field."""
    from jaxalign.files import read_json
    from jaxalign.interop import hf

    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"{path}: no config.json; expected a transformers checkpoint directory")
    content = read_json(config_path, "the transformers config")
    if not isinstance(content, dict):
        raise ValueError(f"{config_path}: expected a JSON object (a transformers config)")
    model_type = content.get("model_type")
    try:
        hf.config_from_hf(content)
    except KeyError as err:  # the family read a field the file does not have
        field = err.args[0] if err.args else "?"
        raise ValueError(f"{config_path}: model_type {model_type!r} needs the field {field!r}, which this "
                         f"config.json lacks") from None
    return content


def load_model(spec: str, seed: int = 0) -> Transformer:
    """A model from a preset name (randomly initialised with `seed`), a transformers checkpoint directory or a
    jaxalign (orbax) checkpoint directory. ValueError naming what is wrong and what is allowed otherwise."""
    if os.path.isdir(spec):
        if os.path.isdir(os.path.join(spec, "params")):
            from jaxalign.checkpoint import load_model as load_checkpoint
            return load_checkpoint(spec)
        from jaxalign.interop import hf
        check_transformers_config(spec)
        return hf.load(spec)
    from jaxalign.model.config import ModelConfig, preset_names
    if spec not in preset_names():
        raise ValueError(f"model {spec!r} is neither a directory nor a preset; allowed: a transformers checkpoint "
                         f"directory, a jaxalign checkpoint directory, or one of {', '.join(preset_names())}")
    from flax import nnx
    return Transformer(ModelConfig.preset(spec), rngs=nnx.Rngs(seed))
