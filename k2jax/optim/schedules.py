"""Learning-rate schedules. WSD (warmup-stable-decay) is the K2 recipe (report 2.5):
linear warmup to the peak, hold it, then a cosine decay to a floor, held afterwards."""

import optax


def wsd(peak_value: float, total_steps: int, warmup_steps: int, decay_steps: int,
        end_value: float) -> optax.Schedule:
  """0 -> peak over warmup_steps, peak until total - decay_steps, cosine to end_value.

  K2: peak 2e-4, 500 warmup steps, ~10T tokens stable, cosine to 2e-5 over ~5.5T tokens.
  With decay_steps = 0 it is warmup + constant.

  Args:
    peak_value: the stable learning rate.
    total_steps: steps of the whole run (the decay ends here).
    warmup_steps: linear warmup from 0.
    decay_steps: cosine decay length at the end of the run (0 = none).
    end_value: the floor the decay reaches and keeps.
  Returns:
    An optax.Schedule (step -> learning rate).
  """
  warmup_steps = min(warmup_steps, total_steps)
  decay_steps = min(decay_steps, max(total_steps - warmup_steps, 0))
  stable_steps = max(total_steps - warmup_steps - decay_steps, 0)
  warmup = optax.linear_schedule(0.0, peak_value, max(warmup_steps, 1))
  stable = optax.constant_schedule(peak_value)
  decay = optax.cosine_decay_schedule(peak_value, max(decay_steps, 1),
                                      alpha=end_value / peak_value if peak_value else 0.0)
  return optax.join_schedules([warmup, stable, decay],
                              boundaries=[warmup_steps, warmup_steps + stable_steps])
