"""The stored layout of the pipelined stack (k2jax.parallel.layout) and what it costs per
device at K2's own size (abstract shapes, nothing allocated)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh

from k2jax import configs, model, optim, parallel
from k2jax.tools import plan
from k2jax.parallel import layout, pipeline
from k2jax.training.step import init_state


@pytest.mark.parametrize("layers,P,V", [(8, 2, 1), (8, 4, 2), (8, 2, 3), (60, 16, 2), (5, 4, 1)])
def test_stored_rows_are_the_schedule_order(layers, P, V):
  """Device p's block of stored rows holds the stages p, P + p, ... it runs, in that order;
  read stage by stage (s = v P + p), the real rows are the logical layers 0, 1, ... in order,
  at most L per stage; padding rows are zeros; and back to logical is the identity."""
  cfg = configs.get_config("tiny").model
  cfg.num_hidden_layers = layers + cfg.first_k_dense_replace
  sp = layout.split(cfg, P, V)
  L = sp.per_stage
  assert P * V * L >= layers > P * V * (L - 1) or L == 1
  x = jnp.arange(1, layers + 1)                       # layer i holds i + 1
  stored = np.asarray(layout.to_stored(sp, x)).reshape(P, V, L)
  by_stage = [stored[s % P, s // P] for s in range(P * V)]
  real = [r for st in by_stage for r in st if r]
  assert real == list(range(1, layers + 1))
  for st in by_stage:                                 # real rows first, then padding
    n = int((st > 0).sum())
    assert (st[:n] > 0).all() and (st[n:] == 0).all()
  assert ((stored > 0) == sp.real()).all()
  assert all((sp.real()[p] ).any() for p in range(P))  # no device without a layer
  np.testing.assert_array_equal(layout.to_logical(sp, jnp.asarray(stored.reshape(-1))), x)
  assert (sp.logical_rows().reshape(-1) >= 0).sum() == layers


def test_layers_per_stage_cover_the_stack_for_every_split():
  """For every split the counts are a partition of the stack into stages of at most L
  layers; a device keeps a layer whenever the split leaves it one (else validate refuses)."""
  cfg = configs.get_config("tiny").model
  for layers in (1, 3, 5, 8, 13, 60):
    cfg.num_hidden_layers = layers + cfg.first_k_dense_replace
    for P in (1, 2, 3, 4, 8, 16, 64):
      for V in (1, 2, 3):
        sp = layout.split(cfg, P, V)
        n = sp.layers_per_stage()
        assert n.sum() == layers and (n >= 0).all() and (n <= sp.per_stage).all()
        if P <= layers:
          assert all(sp.real()[p].any() for p in range(P)), (layers, P, V, n)


def test_k2_padding_goes_where_the_embedding_runs():
  """K2's 60 MoE layers over 16 x 2 stages of 2: two of the 4 padding rows go to stage 0
  (which also runs the embedding and the dense layer), two to the last stages (the head is
  split over every device), so 1F1B with 32 microbatches idles 19.8% of device time by stage
  cost with stage 0 recomputing the prefix (the best of every placement of the 4 rows, by
  brute force) instead of 32.4% with them all on the last stages (schedules.stage_costs:
  FLOPs of each stage's tasks)."""
  from k2jax.parallel import schedules
  m = configs.get_config("kimi_k2").model
  sp = layout.split(m, 16, 2)
  n = sp.layers_per_stage()
  assert n[0] == 0 and (n[1:-2] == 2).all() and (n[-2:] == 1).all()
  tab = schedules.build("1f1b", 16, 2, 32)
  tail = sp._replace(counts=())                       # the padding on the last stages
  # the placement as the balancer weighs it: stage 0 recomputing the prefix
  recompute = schedules.stage_costs(m, sp, 4096)
  assert tab.idle_fraction(recompute) < 0.199
  assert tab.idle_fraction(schedules.stage_costs(m, tail, 4096)) > 0.32
  assert abs(tab.idle_fraction() - 0.19) < 0.001      # equal stages: GPipe's (P-1)/(MV+P-1)


def test_train_state_round_trips_with_master_weights_and_qk_clip_record():
  """A bf16 muonclip state (master weights, momentum, Adam moments, QK-Clip's record) in the
  logical layout -> stored (8 MoE layers over 2 x 3 stages of 2: 4 padding rows) -> back:
  identical; the stored state has the shapes the stored config's optimizer builds."""
  c = configs.get_config("tiny")
  c.model.update(dict(num_hidden_layers=9, param_dtype="bfloat16"))
  c.mesh.update(dict(pipeline=2, virtual_stages=3))
  sp = layout.of(c)
  assert sp.padded == 4
  stored = layout.stored_config(c)
  tx, tx_stored = optim.optimizer(c), optim.optimizer(stored)
  state = init_state(c, tx, jax.random.key(0))
  ever = optax.tree_utils.tree_get(state.opt_state, "ever_clipped")
  state = state._replace(opt_state=optax.tree_utils.tree_set(
      state.opt_state, ever_clipped=jax.random.bernoulli(jax.random.key(1), 0.5, ever.shape)))
  master = optax.tree_utils.tree_get(state.opt_state, "master")
  assert master["moe_layers"]["attn"]["o"].dtype == jnp.float32
  s = layout.convert_state(sp, tx, state, layout.to_stored)
  want = jax.eval_shape(functools.partial(init_state, stored, tx_stored), jax.random.key(0))
  assert jax.tree.structure(s) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(want)):
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
  back = layout.convert_state(sp, tx_stored, s, layout.to_logical)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_master_weights_round_params_of_the_float32_trajectory():
  """bf16 params under master_weights follow the float32 run of the same chain, rounded:
  the master after 5 steps equals the float32 params exactly and the params are its bf16
  rounding."""
  tx = optax.chain(optax.sgd(1e-3, momentum=0.9), optax.add_decayed_weights(0.1))
  p32 = {"w": jax.random.normal(jax.random.key(0), (7, 5)).astype(jnp.bfloat16).astype(
      jnp.float32)}
  p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p32)
  mw = optim.master_weights(tx)
  s32, s16 = tx.init(p32), mw.init(p16)
  for i in range(5):
    g = {"w": jax.random.normal(jax.random.key(10 + i), (7, 5)).astype(jnp.bfloat16)}
    u, s32 = tx.update(jax.tree.map(lambda a: a.astype(jnp.float32), g), s32, p32)
    p32 = optax.apply_updates(p32, u)
    u, s16 = mw.update(g, s16, p16)
    p16 = optax.apply_updates(p16, u)
  assert p16["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(s16.master["w"]), np.asarray(p32["w"]))
  np.testing.assert_array_equal(np.asarray(p16["w"]), np.asarray(p32["w"].astype(jnp.bfloat16)))


K2_LAYOUT = {"pipeline": 16, "data": 8, "expert": 16}   # report 2.4: PP16 x EP16 x DP8


def _k2_counts(loop: bool = False):
  """Parameters on the fullest device, counted from the report's architecture without the
  sharding code: 4 of the 60 MoE layers (64 stored rows over 16 devices) with 24 of their
  384 experts, and every other weight of those layers split 16 ways over the expert group
  (FSDP) but the two small norms of the low-rank projections and the router bias; the dense
  first layer whole; the embedding's rows split 16 ways, the head's columns 256 ways (its
  vocabulary slices over the pipeline, each over the expert group). `loop`: as the
  pipeline's loop holds them (its float32 gradient sums): the FSDP splits and the head's
  over the expert group undone."""
  m = configs.get_config("kimi_k2").model
  d, H, ep = m.hidden_size, m.num_attention_heads, 16
  small = m.q_lora_rank + m.kv_lora_rank                       # q_a_norm, kv_a_norm
  attn = (d * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim + H * m.v_head_dim)
          + m.q_lora_rank * H * (m.qk_nope_head_dim + m.qk_rope_head_dim)
          + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim) + 2 * d)   # + layer norms
  expert = 3 * d * m.moe_intermediate_size
  fsdp = 1 if loop else ep
  moe_row = (m.n_routed_experts // ep * expert + small + m.n_routed_experts
             + (attn + m.n_shared_experts * expert + d * m.n_routed_experts) / fsdp)
  dense = small + attn + 3 * d * m.intermediate_size
  return (4 * moe_row + dense + m.vocab_size * d / ep + d / fsdp
          + m.vocab_size * d / (16 * fsdp))


def test_k2_states_per_device_from_the_trainers_shardings():
  """kimi_k2 on PP16 x EP16 x DP8 (2,048 abstract devices): bf16 params, fp32 gradient
  buffer, ZeRO-1 state with the fp32 master weights in host memory. The device holds <= 30
  GB of states (report 2.4.2), no leaf of the pipelined stack is replicated over
  `pipeline`, the params match a direct count, and plan prints the same bytes."""
  config = configs.get_config("kimi_k2")
  assert config.optimizer.host_state
  st = plan.state_bytes(config, K2_LAYOUT)
  n = _k2_counts()
  assert st["params"] == pytest.approx(2 * n, rel=1e-3)
  # the gradients as the update takes them: float32, ZeRO-1's slices over data 8
  assert st["grads"] == pytest.approx(2 * st["params"] / 8, rel=1e-5)
  # the loop's float32 sums: the weights split only for memory whole (pipeline.inner_specs)
  assert st["loop_sums"] == pytest.approx(4 * _k2_counts(loop=True), rel=1e-3)
  # ... and its bf16 copy of each weight it gathers: whole, where the state holds 1 / 16
  assert st["loop_copy"] == pytest.approx(2 * (_k2_counts(loop=True) - n) * 16 / 15, rel=1e-3)
  # ZeRO-1 in host memory: fp32 master + one fp32 moment (Muon) or two (AdamW) over 8 ranks
  assert 8 / 8 * n < st["optimizer_host"] < 12 / 8 * n
  assert st["optimizer"] < 1e6             # on the device: a few small vectors (QK-Clip record)
  assert st["optimizer_unsplit"] < 1e6
  total = st["params"] + 2 * st["params"] + st["optimizer"]   # + the report's fp32 buffer
  assert 25e9 < total <= 30e9, total / 1e9
  # with the optimizer states on the device the same layout holds 32 GB: 4 MoE layers' 24
  # experts alone are 29.6 GB at 7 bytes per parameter (the report's average device has 3.75)
  config.optimizer.host_state = False
  on_device = plan.state_bytes(config, K2_LAYOUT)
  assert on_device["optimizer"] == pytest.approx(st["optimizer_host"] + st["optimizer"])
  config.optimizer.host_state = True

  config.mesh.update(K2_LAYOUT)
  stored = layout.stored_config(config)
  tx = optim.optimizer(stored)
  abstract = jax.eval_shape(functools.partial(init_state, stored, tx), jax.random.key(0))
  mesh = AbstractMesh((16, 8, 1, 16), parallel.MESH_AXES)   # context 1
  sh = parallel.state_shardings(model.param_specs(stored.model), mesh, abstract, tx)
  for a, s in zip(jax.tree.leaves(abstract.params["moe_layers"]),
                  jax.tree.leaves(sh.params["moe_layers"])):
    assert s.spec[0] == "pipeline" and s.shard_shape(a.shape)[0] == 4

  text = plan.report("kimi_k2", K2_LAYOUT)
  for key, label in (("params", "params"), ("loop_sums", "grads / accumulation"),
                     ("optimizer", "optimizer on device"), ("optimizer_host", "host memory"),
                     ("loop_copy", "weights in the loop")):
    assert f"{label:<24}{st[key] / 1e9:>10.2f}" in text
  assert f"(reduce-scattered once a step into ZeRO-1's slices: {st['grads'] / 1e9:.2f})" in text
  in_loop = st["params"] + st["loop_sums"] + st["optimizer"]
  assert f"{'all states on device':<24}{in_loop / 1e9:>10.2f}" in text
  # One sequence per device per microbatch on the report's layout: the preset's
  # microbatch count follows mesh.data (a reference), and plan reads that geometry.
  V, M = config.mesh.virtual_stages, config.train.grad_accum
  assert M * 8 * 16 == config.train.batch_size
  assert f"micro_batch 1 (train.batch_size {config.train.batch_size} in {M} microbatches)" in text
  tab = pipeline.table(config)
  costs = pipeline.costs(config)
  idle = tab.idle_fraction(costs)
  assert idle < 0.19                  # the bound (MaxText's circular pipeline: 19%)
  assert (f"idle {idle:.1%} of device time by stage FLOPs ({tab.idle_fraction():.1%} if "
          "stages did equal work)") in text
  # more microbatches shrink the bubble, not the activations in flight (1F1B's bound)
  fewer = pipeline.schedule_table(config.model, 16, V, 32, "1f1b")
  assert fewer.idle_fraction(costs) > idle and fewer.in_flight == tab.in_flight
  # and the whole device, activations of the configured schedule included, fits an 80 GB
  # H800 (report 2.4: K2 was trained on them)
  act = plan.activation_bytes(config.model, K2_LAYOUT, config.train.seq_len,
                              virtual_stages=V, microbatches=M)[0]
  whole = in_loop + st["loop_copy"] + act
  assert whole < 80e9, whole / 1e9
  assert f"{'total':<24}{whole / 1e9:>10.2f}" in text
