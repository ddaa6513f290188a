"""k2jax: Kimi K2 (MLA + ultra-sparse MoE, MuonClip) in JAX.

The package, bottom to top; each part imports only parts above it in this list (its
`__init__` says which, and tests/test_imports.py holds it to that):

    configs/    ml-collections presets and their validation
    data/       tokenizers, corpora, packing, the grain pipeline, the arithmetic problems
    kernels     Pallas + XLA kernels (the repository's kernels/ folder)
    model/      the parameter table, MLA, MoE, the transformer as pure functions
    optim/      MuonClip and the other optax transforms
    parallel/   meshes, the logical-axis rules, pipeline schedules and their executor
    interop/    the published safetensors, read and written shard by shard
    training/   the train step and loop, checkpoints, a run's files (`k2jax.train`)
    serving/    generate, the batching engine, the OpenAI server, chat (`k2jax.serve`)
    sft.py      supervised fine-tuning (`k2jax.sft`)
    rl/         RL with the K1.5 loss, environments, sandbox (`k2jax.rl`)
    synth/      data synthesis over a model client (`k2jax.synth`)
    tools/      plan, compile for TPU, params, plot, convert, export

Modules that lived at the top before the grouping keep their old names (k2jax._moved).
"""

from k2jax import _moved

_moved.install()

__version__ = "0.1.0"
