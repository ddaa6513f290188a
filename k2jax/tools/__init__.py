"""Commands that measure, plan and convert: nothing else imports them.

    plan.py              per-device memory and schedule figures (`python -m k2jax.plan`)
    compile.py           compile a step for a TPU slice on this CPU (`python -m k2jax.compile`)
    compile_programs.py  the RL / prefill / decode programs compile.py compiles
    xla_target.py        topology devices, HBM, the finished compile's memory
    xla_heap.py          arithmetic on XLA's buffer assignments
    params.py            parameter counts and FLOPs (`python -m k2jax.params`)
    plot.py              a run's curves (`python -m k2jax.plot`)
    convert.py           a Hugging Face checkpoint -> a k2jax run (`python -m k2jax.convert`)
    export_run.py        a k2jax run -> a Hugging Face checkpoint (`python -m k2jax.export`)

May import: k2jax.configs, k2jax.data, k2jax.kernels, k2jax.model, k2jax.optim,
k2jax.parallel, k2jax.interop, k2jax.training, k2jax.serving, k2jax.sft, k2jax.rl,
k2jax.synth.
"""
