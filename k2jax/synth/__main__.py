from k2jax.synth.cli import main

main()
