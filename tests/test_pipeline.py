"""k2jax.parallel.pipeline in-process (one device; the multi-device meshes are in
test_pipeline_meshes): host residual slots, and a stage 0 of padding rows whose backward
recomputes the prefix, every gradient still the model's."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import configs, model
from k2jax.parallel import executor, layout, pipeline, schedules
from k2jax.training.step import lm_loss, microbatches
from tests.numerics import replay, seed_and_rng


def test_host_slots_give_back_what_was_put_narrow_leaves_as_rows_of_128():
  """Slots with host memory: each leaf read back from its slot is the value written there,
  bit for bit, for small (device) leaves, wide ones, and ones narrower than a TPU tile's
  128 lanes in their last dimension, which host memory keeps as rows of 128 (XLA:TPU padded
  a [tokens, 16] float32 leaf to 128 lanes)."""
  store = executor.Slots(True)
  rng = np.random.default_rng(0)
  avals = [jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((3, 7), jnp.int32),
           jax.ShapeDtypeStruct((20000, 16), jnp.float32),
           jax.ShapeDtypeStruct((2, 300, 1024), jnp.bfloat16)]
  assert [store.on_host(a) for a in avals] == [False, False, True, True]
  buf = store.zeros(4, avals)
  assert buf[2].shape == (5, 2500, 128) and buf[3].shape == (5, 2, 300, 1024)
  values = [[jnp.asarray(rng.normal(size=a.shape).astype(np.float32)).astype(a.dtype)
             for a in avals] for _ in range(2)]
  put = jax.jit(lambda buf, slot, v: store.put(buf, slot, v))
  get = jax.jit(lambda buf, slot: store.get(buf, slot, avals))
  buf = put(buf, 3, values[0])
  buf = put(buf, 1, values[1])
  buf = put(buf, -1, values[1])      # an idle tick writes the spare slot
  for slot, want in ((3, values[0]), (1, values[1])):
    for g, w in zip(get(buf, slot), want):
      assert g.shape == w.shape and g.dtype == w.dtype
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _batch(cfg, rng, B=4, T=32):
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
  return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:],
              positions=jnp.broadcast_to(jnp.arange(T), (B, T)),
              segment_ids=jnp.ones((B, T), jnp.int32), loss_mask=jnp.ones((B, T), bool))


def _assert_grads_are_the_models(cfg, params, batch, M, sp, tab, skip, seed, caplog=None):
  """pipeline.loss_and_grads on one pipeline device under table `tab` against jax.grad of
  the unpipelined model's summed loss over the same M microbatches: every leaf, rel 1e-5."""
  plain = cfg.copy_and_resolve_references()
  plain.offload = False

  def reference(p):
    def one(mb):
      ce, n, aux = lm_loss(plain, p, mb)
      return ce + aux.aux_loss * n
    return sum(one(jax.tree.map(lambda a: a[i], microbatches(batch, M))) for i in range(M))
  want = jax.grad(reference)(params)
  stored = layout.convert_params(sp, params, layout.to_stored)
  mesh = jax.make_mesh((1, 1, 1), ("pipeline", "data", "expert"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  with jax.set_mesh(mesh):
    _, _, _, _, g = jax.jit(lambda p: pipeline.loss_and_grads(
        cfg, p, microbatches(batch, M), tab, skip=skip))(stored)
  got = dict((jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_leaves_with_path(
      layout.convert_params(sp, g, layout.to_logical)))
  for path, a in jax.tree_util.tree_leaves_with_path(want):
    scale = float(jnp.max(jnp.abs(a))) or 1.0
    np.testing.assert_allclose(got[jax.tree_util.keystr(path)], a, rtol=0, atol=1e-5 * scale,
                               err_msg=f"{jax.tree_util.keystr(path)} ({replay(seed)})")


@pytest.mark.parametrize("skip,offload", [("device", False), ("tick", False), ("device", True)])
def test_a_stage_of_padding_only_and_every_gradient_is_the_models(caplog, skip, offload):
  """1 dense + 8 MoE layers in 5 stages of 2 on one pipeline device: stage 0 holds padding
  only (its layers skipped), and its backward recomputes the embedding and dense layer.
  Every gradient equals jax.grad of the unpipelined model (rel 1e-5, float32), per-device
  and per-tick skipping, and the cost model counts 3 forwards of the prefix in stage 0's
  backward. With
  model.offload the residual slots are in host memory (one more slot absorbs idle ticks'
  writes; on CPU the transfers are no-ops, the slot logic runs)."""
  cfg = configs.get_config("tiny").model
  cfg.num_hidden_layers = 9
  cfg.offload = offload
  sp = layout.split(cfg, 1, 5)
  assert tuple(sp.layers_per_stage()) == (0, 2, 2, 2, 2)
  seed, rng = seed_and_rng()
  params = model.init(cfg, jax.random.key(int(rng.integers(2 ** 31))))
  T, M = 32, 2
  batch = _batch(cfg, rng, T=T)
  with caplog.at_level(logging.INFO, "k2jax.parallel"):
    _assert_grads_are_the_models(cfg, params, batch, M, sp, schedules.build("1f1b", 1, 5, M),
                                 skip, seed)
  assert ("slots per device in host memory" in caplog.text) == offload
  costs = schedules.stage_costs(cfg, sp, T)
  assert costs["B"][0] == pytest.approx(3 * costs["F"][0])


def test_a_schedule_added_as_one_registry_entry_trains_as_the_model():
  """A new pipeline schedule is one schedules.register entry and nothing else: a depth-first
  order (each microbatch forward through every virtual stage, then back), built by the same
  simulator and run by the same loop, gives every gradient of the unpipelined model, and
  the trainer's config check takes its name."""
  def depth_first(P, V, M):
    return {"F": [(v, m) for m in range(M) for v in range(V)],
            "B": [(V - 1 - v, m) for m in range(M) for v in range(V)]}
  name = "depth_first_test"
  schedules.register(name, schedules.Schedule(depth_first, lambda P, V, M, p: V))
  try:
    cfg = configs.get_config("tiny").model
    cfg.num_hidden_layers = 4
    sp = layout.split(cfg, 1, 3)
    M = 2
    tab = schedules.build(name, 1, 3, M)
    assert tab.in_flight == 3 < schedules.build("gpipe", 1, 3, M).in_flight
    first_f = [(int(v), int(m)) for v, m in tab.task["F"][:, 0] if v >= 0]
    assert first_f == [(v, m) for m in range(M) for v in range(3)]   # its order, not 1f1b's
    seed, rng = seed_and_rng()
    params = model.init(cfg, jax.random.key(int(rng.integers(2 ** 31))))
    _assert_grads_are_the_models(cfg, params, _batch(cfg, rng), M, sp, tab, "device", seed)
    full = configs.get_config("tiny")
    full.mesh.pipeline_schedule, full.train.grad_accum = name, M
    schedules.validate(full)
    full.mesh.pipeline_schedule = "no_such_schedule"
    with pytest.raises(ValueError, match="must be one of 1f1b, gpipe, zbh1, depth_first_test"):
      schedules.validate(full)
  finally:
    del schedules.SCHEDULES[name]
    schedules.build.cache_clear()
