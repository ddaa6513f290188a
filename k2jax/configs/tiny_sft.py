"""SFT of the tiny model on chat data (k2jax.sft): rows long enough to hold a whole dialog with
a tool declaration and call (~780 bytes with the byte tokenizer), a short run at a gentler
learning rate."""

from k2jax.configs import tiny


def get_config():
  c = tiny.get_config()
  c.train.update(dict(steps=300, batch_size=4, seq_len=1024, log_every=10, eval_every=100,
                      checkpoint_every=100, eval_batches=4))
  c.optimizer.update(dict(learning_rate=1e-3, end_learning_rate=1e-4, warmup_steps=20,
                          decay_steps=100))
  return c
