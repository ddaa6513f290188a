"""Weights to start from, at any size: a Hugging Face directory or a k2jax run, loaded
straight into the shardings of whoever asked (the trainer's, the RL sampler's, the server's).

    src = weights.open_source(path)             # config only: nothing of the weights read
    cfg = src.model                             # the model config to build shardings from
    params = src.load(cfg, shardings)           # each process reads only its shards

A Hugging Face directory (config.json + safetensors in the published K2 / DeepSeek-V3 names,
FP8 or INT4 or neither) is read by k2jax.interop.hf.load; a k2jax.train / sft / rl run by
k2jax.training.checkpoint.load_run (orbax restores its params, no optimizer state, into the
shardings). Either way `cfg.param_dtype` is the dtype the weights are stored in once loaded.
"""

import json
import os
from typing import NamedTuple

import numpy as np


class Source(NamedTuple):
  path: str
  kind: str              # "hf" | "run"
  model: object          # model config of the weights (param_dtype: the source's default)
  config: object = None  # a run's full config (None for a Hugging Face directory)

  def load(self, cfg, shardings, layout=None, stats: dict | None = None):
    """The params, built into `shardings` (a params tree of Shardings), stored as
    `cfg.param_dtype`; `cfg` is `self.model` with computation settings (and the stored
    dtype) possibly changed, never the shapes. With `layout` (a
    k2jax.parallel.layout.Split) the pipelined stack comes as the trainer stores it and
    `shardings` are the stored ones: a Hugging Face directory is read straight into that
    layout, a run restored in its own (logical) one and laid out on the devices."""
    if self.kind == "hf":
      from k2jax.interop import hf
      return hf.load(self.path, cfg, shardings, layout=layout, stats=stats)
    from k2jax.training.checkpoint import load_run
    dtype = np.dtype(cfg.param_dtype)
    if layout is None:
      return load_run(self.path, shardings, param_dtype=dtype)[1]
    import jax

    from k2jax import model, parallel
    from k2jax.parallel import layout as layouts
    mesh = jax.tree.leaves(shardings)[0].mesh
    logical = parallel.param_shardings(model.param_specs(cfg), mesh, spread_layers=True)
    params = load_run(self.path, logical, param_dtype=dtype)[1]
    return jax.jit(lambda p: layouts.convert_params(layout, p, layouts.to_stored),
                   out_shardings=shardings, donate_argnums=0)(params)

  def check(self) -> None:
    """ValueError (one line) unless the weights can be loaded: a Hugging Face directory's
    file headers match its config (no tensor read), a run has a checkpoint."""
    if self.kind == "hf":
      from k2jax.interop import hf
      hf.check(self.path, self.model)
    elif not os.path.isdir(os.path.join(self.path, "checkpoints")) or not any(
        n.isdigit() for n in os.listdir(os.path.join(self.path, "checkpoints"))):
      raise ValueError(f"{self.path} has no checkpoint yet: train longer, or with "
                       "train.checkpoint_every > 0")

  def tokenizer(self) -> str:
    """The tokenizer the weights were trained with: a run's data.tokenizer, a Hugging Face
    directory's tiktoken.model, else the byte tokenizer."""
    if self.config is not None:
      return self.config.data.tokenizer
    path = os.path.join(self.path, "tiktoken.model")
    return path if os.path.exists(path) else "byte"


def is_run(path: str) -> bool:
  """A k2jax run's config.json has the trainer's groups; a Hugging Face one is flat."""
  try:
    with open(os.path.join(path, "config.json")) as f:
      saved = json.load(f)
  except (OSError, ValueError):
    return os.path.isdir(os.path.join(path, "checkpoints"))
  return isinstance(saved, dict) and "train" in saved and "model" in saved


def open_source(path: str, kind: str | None = None) -> Source:
  """The weights in `path` ("run" or "hf" as `kind` says, else as its config.json says),
  their config read and nothing else. ValueError / OSError (one line) for a directory that
  holds no such weights."""
  if (kind or ("run" if is_run(path) else "hf")) == "run":
    from k2jax.training.checkpoint import run_config
    config = run_config(path)
    return Source(path, "run", config.model, config)
  from k2jax.interop import hf
  return Source(path, "hf", hf.read_config(path))
