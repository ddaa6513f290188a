"""Hugging Face safetensors in the published K2 / DeepSeek-V3 layout, read and written shard by
shard (FP8 and INT4 dequantized on the way in, FP8 optionally on the way out).

    hf.py              load(path, cfg, shardings): the published weights into any shardings
    hf_format.py       the published names, shapes, config.json and stored layout
    safetensors_io.py  headers checked, then positioned reads of exactly the bytes needed
    quant.py           FP8 (128 x 128 block scales) and INT4 (group 32) dequantization
    loader.py          the plan of chunks each device reads, and the programs that place them
    shards.py          per-device buffers -> global arrays
    export.py          sharded params -> a Hugging Face directory, one tensor at a time

May import: k2jax.configs, k2jax.kernels, k2jax.model, k2jax.parallel.
"""
