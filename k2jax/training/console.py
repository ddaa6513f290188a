"""Console logging of the commands: k2jax's own INFO lines, only warnings from libraries.

At INFO, orbax (through absl) logs ~30 lines per checkpoint it reads, jax that it found no
TPU, the HTTP client every request: the lines a user needs (what loaded, where it serves,
what was dropped) drown in them.
"""

import logging

NOISY = ("absl", "jax._src", "orbax", "grain", "httpx", "httpx2", "httpcore", "openai")


def quiet_libraries() -> None:
  for name in NOISY:
    logging.getLogger(name).setLevel(logging.WARNING)


def setup() -> None:
  """INFO to stderr with the time and the logger's name; libraries at WARNING."""
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  quiet_libraries()
