"""Orbax checkpoints of a model (parameters + its ModelConfig), written atomically."""

from __future__ import annotations

import json
import os
import shutil

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxalign.files import read_json
from jaxalign.model.config import ModelConfig
from jaxalign.model.transformer import Transformer


def save_model(model: Transformer, directory: str, *, overwrite: bool = False) -> str:
    """Write `directory/config.json` and the parameters (orbax) under `directory/params`.

    The checkpoint is written into a temporary sibling directory and renamed into place, so an interrupted
    save never leaves a half-written checkpoint at `directory`."""
    directory = os.path.abspath(directory)
    if os.path.exists(directory) and not overwrite:
        raise ValueError(f"{directory} already exists; pass overwrite=True (--overwrite) to replace it")
    tmp = directory + ".tmp-save"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(model.config.to_dict(), f, indent=2)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(tmp, "params"), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    checkpointer.wait_until_finished()
    if os.path.exists(directory):
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def load_model(directory: str) -> Transformer:
    """A Transformer restored from `save_model`'s directory."""
    directory = os.path.abspath(directory)
    config_path = os.path.join(directory, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"{directory}: not a jaxalign checkpoint (no config.json)")
    content = read_json(config_path, "the jaxalign checkpoint's config")
    if not isinstance(content, dict):
        raise ValueError(f"{config_path}: expected a JSON object (a jaxalign ModelConfig)")
    config = ModelConfig.from_dict(content)
    model = Transformer(config, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    target = nnx.to_pure_dict(state)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    restored = ocp.StandardCheckpointer().restore(os.path.join(directory, "params"), abstract)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(model, state)
    return model
