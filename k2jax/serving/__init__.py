"""Decoding and serving: `python -m k2jax.generate` and `python -m k2jax.serve`.

    generate.py     prefill + absorbed-MLA decode over the latent cache; the generate command
    engine.py       continuous batching: slots, admission, chunked decode dispatches
    serve.py        the OpenAI-compatible HTTP server over the engine
    openai_api.py   the request formats it accepts, checked and parsed into engine jobs
    chat.py         K2's chat template, tool calls, grammar-constrained replies
    closing.py      the shortest valid ending of a partial JSON value under a schema

May import: k2jax.configs, k2jax.data, k2jax.kernels, k2jax.model, k2jax.optim,
k2jax.parallel, k2jax.interop, k2jax.training.
"""
