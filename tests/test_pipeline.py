"""k2jax.parallel.pipeline in-process (one device; the multi-device meshes are in
test_parallel): stage 0 keeps its prefix's residuals as bytes in the slot its padding rows
leave unused, and every gradient is still the model's."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import configs, model
from k2jax.parallel import layout, pipeline, schedules
from k2jax.step import lm_loss, microbatches
from tests.numerics import replay, seed_and_rng


def test_host_slots_give_back_what_was_put_narrow_leaves_as_rows_of_128():
  """_Slots with host memory: each leaf read back from its slot is the value written there,
  bit for bit, for small (device) leaves, wide ones, and ones narrower than a TPU tile's
  128 lanes in their last dimension, which host memory keeps as rows of 128 (XLA:TPU padded
  a [tokens, 16] float32 leaf to 128 lanes)."""
  store = pipeline._Slots(True)
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


def test_overlay_bytes_round_trip_every_dtype():
  """Prefix leaves of mixed dtypes and batch axes written into stage leaves of other dtypes
  and batch axes, read back bit for bit (NaN payloads, FP8 and bool included); a leaf with
  no batch axis rides in `side`; other stages keep their own leaves; a prefix larger than
  the bins, or a stage leaf with no batch axis as the only bin, refused. On G = 2 row
  groups (the byte views are global here: one device)."""
  G = 2
  _, rng = seed_and_rng()

  def raw(shape, dt):
    k = jnp.dtype(dt).itemsize
    u = jnp.asarray(rng.integers(0, 256, shape + ((k,) if k > 1 else ()), np.uint8))
    return jax.lax.bitcast_convert_type(u, dt)
  pre = [raw((4, 5), jnp.float32), raw((3, 4, 7), jnp.bfloat16), raw((4, 2), jnp.int32),
         raw((4, 4), jnp.float8_e4m3fn), jnp.asarray(rng.random((4, 3)) > 0.5),
         raw((6,), jnp.float32)]
  pre_axes = (0, 1, 0, 0, 0, None)
  stage = [raw((3, 4, 8), jnp.bfloat16), raw((2, 18), jnp.float32),
           raw((4, 4), jnp.float8_e4m3fn)]
  stage_axes = (1, 0, 0)
  aval = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  ov = pipeline._Overlay.plan([aval(a) for a in pre], pre_axes, [aval(a) for a in stage],
                              stage_axes, G)
  assert ov is not None and ov.bins == (0, 1)     # 192 + 144 bytes hold the prefix's 308
  bits = [pipeline._bits(a) for a in stage]       # how the schedule's buffers hold them
  mesh = jax.make_mesh((1, 1, 1), ("pipeline", "data", "expert"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  with jax.set_mesh(mesh):
    stored = ov.write(jnp.asarray(True), pre, bits)
    read = ov.read(stored)
    kept = ov.write(jnp.asarray(False), pre, bits)   # any other stage keeps its own leaves
  assert len(stored) == len(stage) + 1 and np.array_equal(stored[2], bits[2])
  for got, want in zip(read, pre):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
  for got, want, a in zip(kept, bits, stage):
    assert np.array_equal(got, want)
    back = np.asarray(pipeline._unbits(got, a)).view(np.uint8)
    assert np.array_equal(back, np.asarray(a).view(np.uint8))
  assert pipeline._Overlay.plan([aval(a) for a in pre], pre_axes, [aval(stage[2])], (0,),
                                G) is None
  assert pipeline._Overlay.plan([aval(a) for a in pre[:1]], pre_axes[:1], [aval(stage[0])],
                                (None,), G) is None


def test_batch_axes_take_whole_sequences_only():
  """The axis that doubles with the microbatch and holds whole sequences; None for a leaf
  that does not grow, or grows by a capacity that is not a multiple of the sequences."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  small = [s(3, 4, 5), s(4 * 7, 2), s(9), s(3, 10), s(4, 4)]
  large = [s(3, 8, 5), s(8 * 7, 2), s(9), s(3, 20), s(8, 8)]
  assert pipeline._batch_axes(small, large, 4) == (1, 0, None, None, None)


@pytest.mark.parametrize("skip,offload", [("device", False), ("tick", False), ("device", True)])
def test_stage_zero_keeps_its_prefix_and_every_gradient_is_the_models(caplog, skip, offload):
  """1 dense + 8 MoE layers in 5 stages of 2 on one pipeline device: stage 0 holds padding
  only, so it keeps the embedding and dense layer's vjp residuals (as bytes in its unused
  residual slot) and its backward does not recompute them. Loss, max logits, expert load
  and every gradient equal jax.grad of the unpipelined model (rel 1e-5, float32), and the
  cost model counts 2 forwards of the prefix in stage 0's backward, not 3. With
  model.offload the residual slots are in host memory (one more slot absorbs idle ticks'
  writes; on CPU the transfers are no-ops, the slot logic runs)."""
  cfg = configs.get_config("tiny").model
  cfg.num_hidden_layers = 9
  cfg.offload = offload
  sp = layout.split(cfg, 1, 5)
  assert sp.prefix_kept and tuple(sp.layers_per_stage()) == (0, 2, 2, 2, 2)
  seed, rng = seed_and_rng()
  params = model.init(cfg, jax.random.key(int(rng.integers(2 ** 31))))
  B, T, M = 4, 32, 2
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
  batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:],
               positions=jnp.broadcast_to(jnp.arange(T), (B, T)),
               segment_ids=jnp.ones((B, T), jnp.int32), loss_mask=jnp.ones((B, T), bool))

  plain = cfg.copy_and_resolve_references()
  plain.offload = False

  def reference(p):
    def one(mb):
      ce, n, aux = lm_loss(plain, p, mb)
      return ce + aux.aux_loss * n
    return sum(one(jax.tree.map(lambda a: a[i], microbatches(batch, M))) for i in range(M))
  want = jax.grad(reference)(params)

  tab = schedules.build("1f1b", 1, 5, M)
  stored = layout.convert_params(sp, params, layout.to_stored)
  mesh = jax.make_mesh((1, 1, 1), ("pipeline", "data", "expert"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  with caplog.at_level(logging.INFO, "k2jax.parallel"), jax.set_mesh(mesh):
    _, _, _, _, g = jax.jit(lambda p: pipeline.loss_and_grads(
        cfg, p, microbatches(batch, M), tab, skip=skip))(stored)
  # per-device skipping (GPU / TPU) keeps it; CPU's per-tick mode recomputes (pipeline.py)
  assert ("keeps its prefix" in caplog.text) == (skip == "device")
  assert "do not fit" not in caplog.text
  assert ("slots per device in host memory" in caplog.text) == offload
  got = layout.convert_params(sp, g, layout.to_logical)
  for path, a in jax.tree_util.tree_leaves_with_path(want):
    b = jax.tree_util.tree_leaves_with_path(got)
    b = dict((jax.tree_util.keystr(k), v) for k, v in b)[jax.tree_util.keystr(path)]
    scale = float(jnp.max(jnp.abs(a))) or 1.0
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * scale,
                               err_msg=f"{jax.tree_util.keystr(path)} ({replay(seed)})")
  costs = schedules.stage_costs(cfg, sp, T)
  assert costs["B"][0] == pytest.approx(2 * costs["F"][0])
