"""The training loop and what a run keeps: `python -m k2jax.train --config ...`.

    train.py        the command: config, mesh, data, the loop, checkpoints, metrics
    step.py         the jitted train step (forward, loss, MuonClip update) and TrainState
    checkpoint.py   orbax checkpoints of a run: save, restore onto any mesh, load a run's params
    resume.py       which checkpoint a restarted run continues from, and what it must match
    runlock.py      one writer per run directory
    metrics.py      metrics.jsonl and TensorBoard
    weights.py      weights to start from: a Hugging Face directory or a k2jax run, sharded
    console.py      the commands' console logging
    interrupt.py    Ctrl-C / SIGTERM for commands without a train loop

May import: k2jax.configs, k2jax.data, k2jax.kernels, k2jax.model, k2jax.optim,
k2jax.parallel, k2jax.interop.
"""
