from k2jax.rl.train import main

main()
