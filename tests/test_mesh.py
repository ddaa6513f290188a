"""Sharding rules: what each parameter is split over, and clear errors when sizes don't divide."""

import jax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from k2jax import configs, model, parallel


def mesh(pipeline=1, data=1, expert=1, context=1):
  return AbstractMesh((pipeline, data, context, expert), parallel.MESH_AXES)


def test_rules_split_experts_layers_vocabulary_and_the_model_dimension_over_the_expert_group():
  cfg = configs.get_config("tiny").model
  sh = parallel.param_shardings(model.param_specs(cfg), mesh(data=2, expert=4))
  moe = sh["moe_layers"]["moe"]
  assert moe["experts"]["gate"].spec == P("pipeline", "expert", None, None)   # experts keep d whole
  assert moe["experts"]["down"].spec == P("pipeline", "expert", None, None)
  assert moe["router"].spec == P("pipeline", "expert", None)   # FSDP over the expert group
  assert moe["shared"]["down"].spec == P("pipeline", None, "expert")
  assert sh["moe_layers"]["attn"]["o"].spec == P("pipeline", None, None, "expert")
  assert sh["moe_layers"]["attn"]["q_b"].spec == P("pipeline", None, "expert", None)  # heads
  assert sh["moe_layers"]["attn"]["q_a_norm"].spec == P("pipeline", None)
  # under a pipeline the dense stack (1 layer, run by stage 0) is whole on every device
  piped = parallel.param_shardings(model.param_specs(cfg), mesh(pipeline=3, expert=4))
  assert piped["dense_layers"]["attn"]["o"].spec == P(None, None, None, None)
  assert piped["moe_layers"]["attn"]["o"].spec == P("pipeline", None, None, "expert")
  assert sh["embed"].spec == P("expert", None)             # vocabulary rows over the expert group
  # the head's columns over pipeline x expert: each pipeline device runs its vocabulary slice
  assert sh["lm_head"].spec == P(None, ("pipeline", "expert"))
  assert piped["lm_head"].spec == P(None, ("pipeline", "expert"))
  assert sh["final_norm"].spec == P("expert")
  # sizes the expert axis does not divide stay whole instead of failing (memory-only splits)
  odd = configs.get_config("tiny").model
  odd.vocab_size, odd.hidden_size = 262, 66
  sh = parallel.param_shardings(model.param_specs(odd), mesh(expert=4))
  assert sh["embed"].spec[0] is None and sh["final_norm"].spec == P(None)
  assert sh["moe_layers"]["attn"]["o"].spec == P("pipeline", None, None, None)
  assert all("data" not in str(s.spec) for s in parallel.param_shardings(
      model.param_specs(cfg), mesh(data=8)).values() if hasattr(s, "spec"))


def test_indivisible_expert_count_names_the_parameter_axis_and_divisor():
  cfg = configs.get_config("tiny").model  # 16 experts
  with pytest.raises(ValueError, match=r"moe_layers/moe/experts/\w+: dim 1 of size 16 is "
                                       r"sharded over mesh axes expert = 3, which does not "
                                       r"divide it: change the mesh"):
    parallel.param_shardings(model.param_specs(cfg), mesh(expert=3))


def test_batch_must_divide_over_data_times_expert():
  with pytest.raises(ValueError, match=r"train.batch_size: dim 0 of size 12 is sharded over "
                                       r"mesh axes data x expert = 8"):
    parallel.batch_sharding(mesh(data=2, expert=4), 12)


def test_zero1_splits_states_over_data_where_it_divides():
  """ZeRO-1 adds `data` to a state's sharding on the largest free dimension it divides,
  compounding a dimension already split when no free one takes it (K2's 384 experts over
  expert = 16 x data = 24), and leaves the state whole over data only when nothing divides."""
  m = mesh(pipeline=2, data=3, expert=4)
  z = lambda pspec, shape: parallel.zero1(jax.sharding.NamedSharding(m, pspec), shape).spec
  assert z(P("pipeline", "expert", None, None), (4, 16, 63, 32)) == P(
      "pipeline", "expert", "data", None)
  assert z(P("pipeline", "expert", None), (4, 24, 8)) == P("pipeline", ("expert", "data"), None)
  assert z(P(None, None), (8, 4)) == P(None, None)                    # nothing divides
  # spread places several axes where each fits (the checkpoint view moves pipeline this way)
  assert parallel.mesh.spread(P(None, None), (6, 4), ("data", "expert"), m.shape) == P(
      "data", "expert")


def test_muon_state_takes_data_on_the_stack_where_its_matrices_are_orthogonalized():
  """A Muon stack's ZeRO-1 state takes `data` on its layers / experts dimensions where data
  divides the device's slice, the same split Muon's Newton-Schulz works in (matrices whole),
  so each data rank orthogonalizes the matrices whose momentum it holds; where data divides
  no such dimension both fall back (the state as before, the work whole over data)."""
  from k2jax.configs import sharding_rules as rules
  m = mesh(pipeline=2, data=2, expert=4)
  z = lambda pspec, shape, batch: parallel.zero1(jax.sharding.NamedSharding(m, pspec), shape,
                                                 batch).spec
  experts = (("layers", "experts", "embed", "mlp"), (4, 16, 128, 40))
  assert z(P("pipeline", "expert", None, None), experts[1], 2) == P(
      "pipeline", ("expert", "data"), None, None)
  assert rules.muon_work_spec(*experts, m, 2) == P("pipeline", ("expert", "data"), None, None)
  attn = (("layers", "embed", "q_lora"), (4, 128, 64))      # split over expert on embed (FSDP)
  assert z(P("pipeline", "expert", None), attn[1], 1) == P(("pipeline", "data"), "expert", None)
  assert rules.muon_work_spec(*attn, m, 1) == P(("pipeline", "data"), None, None)
  odd = (("layers", "embed", "q_lora"), (2, 128, 64))       # one layer per pipeline device
  assert z(P("pipeline", "expert", None), odd[1], 1) == P("pipeline", "expert", "data")
  assert rules.muon_work_spec(*odd, m, 1) == P("pipeline", None, None)
  assert z(P("pipeline", "expert", None), attn[1], 0) == P("pipeline", "expert", "data")
