"""RL of Kimi K2 with the K1.5 loss (k2jax.rl): kimi_k2's model and optimizer with tiny_rl's
RL settings, laid out for 512 chips.

    python -m k2jax.rl --config kimi_k2_rl --workdir runs/k2_rl --init /path/to/Kimi-K2-Instruct
    python -m k2jax.compile --config kimi_k2_rl --program rl --topology v5p:8x8x8

RL's update (k2jax.rl.train.rl_step) differentiates the model's forward directly, with no
pipeline schedule, so the mesh is expert x data; a batch's rows split over all of those
devices (the MoE layers need whole rows on each), so rl.prompts x rl.samples and
rl.ptx_batch_size are multiples of them. The sampler decodes on the same chips
(rl.inference_mesh), the weights resharded to it every iteration.
"""

from k2jax.configs import kimi_k2, tiny_rl


def get_config():
  c = kimi_k2.get_config()
  c.rl = tiny_rl.get_config().rl
  # 384 experts, 3 a chip: each holds 1/128 of the bf16 weights and the float32 gradient;
  # data = 4 splits the optimizer states (host memory between steps, on the device for the
  # update) and the gradients 4 ways more: on 256 chips (data 2) the update's states alone
  # did not fit (`python -m k2jax.compile --config kimi_k2_rl --program rl`)
  c.mesh.update(dict(pipeline=1, expert=128, data=4, virtual_stages=1))
  c.rl.inference_mesh.update(dict(pipeline=1, expert=128, data=4))
  c.rl.update(dict(
      prompts=128,                # x 4 samples: one row a chip
      ptx_batch_size=512,         # one PTX row a chip
      budget=2048,                # responses within kimi_k2's 4k context
      segment_tokens=1024,        # longer ones go on next iteration (partial rollouts)
  ))
  # Without a pipeline the layers' residuals are the scan's: kimi_k2's offload of them to
  # host memory (remat.remat_policy) stops XLA:TPU's code generation ("cannot query the
  # word size without a memory space"), and kept on the device the
  # selective policy's do not fit beside the state; full recomputation keeps each layer's
  # input only.
  c.model.update(dict(remat="full", offload=False))
  c.train.steps = c.rl.iterations * c.rl.updates_per_iteration
  c.train.batch_size = 512      # not RL's batch (rl.prompts x rl.samples): kept dividing the mesh
  # kimi_k2's MuonClip with host states; the rate where K2's long-context anneal ends, the
  # schedule's length RL's (untuned: nothing here has been trained)
  c.optimizer.update(dict(learning_rate=7e-6, end_learning_rate=7e-7, warmup_steps=5,
                          decay_steps=c.train.steps))
  return c
