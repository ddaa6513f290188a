"""The memory planner against the report's numbers and a direct count."""

import subprocess
import sys

import pytest

from k2jax import configs, model
from k2jax.tools import plan


def test_k2_states_match_report_scale():
  mesh = {"pipeline": 16, "data": 1, "expert": 16}
  config = configs.get_config("kimi_k2")
  st = plan.state_bytes(config, mesh, grad_bytes=4)
  n = model.count_params(config.model)["total"]
  assert st["total_params"] + st["total_grads"] == 6 * n            # bf16 + fp32 per parameter
  assert 5.9e12 < 6 * n < 6.3e12                                     # report 2.4.2: ~6 TB
  average = 6 * n / 256
  assert 20e9 < average < 30e9                                       # ~30 GB per GPU in the report
  # The fullest device holds more than the average (4 of 60 MoE layers, the dense layer),
  # but less than 2x.
  assert average < st["params"] + st["grads"] < 2 * average
  # ZeRO-1: optimizer state shrinks with data parallelism, params and grads do not.
  st8 = plan.state_bytes(config, dict(mesh, data=8))
  assert st8["params"] == st["params"]
  assert st8["optimizer_host"] < st["optimizer_host"] / 7    # the preset keeps them on the host


def test_single_device_bytes_equal_parameter_count():
  config = configs.get_config("tiny")
  st = plan.state_bytes(config, {"pipeline": 1, "data": 1, "expert": 1}, grad_bytes=4)
  assert st["params"] == st["grads"] == 4 * model.count_params(config.model)["total"]


def test_the_weights_cast_once_are_counted_where_the_step_makes_them():
  """train.cast_once's bf16 copy: 2 bytes per parameter the forward reads in bf16 (every
  leaf but the router's and the embedding's, counted from the spec table), only with
  several microbatches and float32 parameters."""
  from k2jax.model import spec
  import jax
  config = configs.get_config("tiny")
  config.model.dtype = "bfloat16"
  config.train.grad_accum = 4
  one = {"pipeline": 1, "data": 1, "expert": 1}
  specs = jax.tree.leaves(model.param_specs(config.model), is_leaf=spec.is_spec)
  cast = sum(spec.size(s) for s in specs if s.cast)
  assert 0 < cast < sum(spec.size(s) for s in specs)
  assert plan.state_bytes(config, one)["cast_copy"] == 2 * cast
  for key, value in (("grad_accum", 1), ("cast_once", False)):
    c = config.copy_and_resolve_references()
    c.train[key] = value
    assert plan.state_bytes(c, one)["cast_copy"] == 0, key
  c = config.copy_and_resolve_references()
  c.model.param_dtype = "bfloat16"
  assert plan.state_bytes(c, one)["cast_copy"] == 0


def test_everything_with_a_model_dimension_splits_over_the_expert_axis():
  config = configs.get_config("tiny")
  one = plan.state_bytes(config, {"pipeline": 1, "data": 1, "expert": 1})
  four = plan.state_bytes(config, {"pipeline": 1, "data": 1, "expert": 4})
  c = model.count_params(config.model)
  m = config.model
  # everything but two small norms per layer and the router bias splits 4 ways: experts and
  # vocabulary, the rest over its model dimension or its heads
  whole = (m.num_hidden_layers * (m.q_lora_rank + m.kv_lora_rank)
           + (m.num_hidden_layers - m.first_k_dense_replace) * m.n_routed_experts)
  split = c["total"] - whole
  assert one["params"] - four["params"] == pytest.approx(4 * (split - split // 4), rel=1e-3)


# The table of user mistakes for `plan` and `params`: (module, argv, the fragment of the one
# error line). Every case exits 2 with one "error:" line and no traceback.
BAD_INPUTS = [
    ("plan", ["--config", "kimi_k2", "--mesh", "pipeline=16,expert=x"],
     "expected pipeline=P,expert=E,data=D"),
    ("plan", ["--config", "kimi_k2", "--mesh", "pipeline=16,expert=16", "--devices", "100"],
     "--devices 100 is not"),
    ("plan", ["--config", "tiny", "--seq_len", "0"], "--seq_len 0: must be >= 1"),
    ("plan", ["--config", "tiny", "--grad_bytes", "0"], "--grad_bytes 0: must be >= 1"),
    ("plan", ["--config", "tiny", "--virtual_stages", "0"], "--virtual_stages 0: must be >= 1"),
    ("plan", ["--config", "tiny", "--micro_batch", "-1"], "--micro_batch -1: must be >= 1"),
    ("plan", ["--config", "tiny", "--mesh", "pipeline=64"],
     "mesh.pipeline = 64 x mesh.virtual_stages = 1: the 3 layers of the pipelined stack "
     "leave 61 pipeline device(s) without a layer"),
    ("plan", ["--config", "tiny", "--mesh", "pipeline=2", "--microbatches", "1"],
     "--microbatches 1: must be >= pipeline (2)"),
    ("plan", ["--config", "kimi_k2", "--devices", "2048", "--microbatches", "48"],
     "is 2.66667 sequences per device per microbatch: pass --micro_batch N"),
    ("plan", ["--config", "tiny", "--config.model.nope=1"],
     "unknown config key in --config.model.nope=1"),
    ("plan", ["--config", "no/such/file.py"], "no/such/file.py"),
    ("params", ["--config", "tiny", "--seq_len", "-1"], "--seq_len -1: must be >= 1"),
    ("params", ["--config", "tiny", "--seq_len", "0"], "--seq_len 0: must be >= 1"),
    ("params", ["--config", "tiny", "--config.train.stepz=3"],
     "unknown config key in --config.train.stepz=3: did you mean steps?"),
    ("params", ["--config", "tiny", "--config.model.num_experts_per_tok=99"],
     "model.num_experts_per_tok = 99"),
    ("params", ["--config", "nope"], "nope"),
]


def test_cli_bad_inputs_end_in_one_line_and_exit_2():
  procs = [(case, subprocess.Popen([sys.executable, "-m", f"k2jax.{case[0]}", *case[1]],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
           for case in BAD_INPUTS]   # all at once: each is mostly interpreter start-up
  for (module, argv, fragment), p in procs:
    out, err = p.communicate(timeout=300)
    lines = [l for l in err.splitlines() if "error:" in l]
    assert p.returncode == 2 and len(lines) == 1 and fragment in lines[0], (argv, err[-2000:])
    assert "Traceback" not in err and not out


def test_cli_takes_config_files_and_overrides():
  """A config FILE and --config.* overrides, as the trainer takes them."""
  p = subprocess.run([sys.executable, "-m", "k2jax.params", "--config", "k2jax/configs/tiny.py",
                      "--config.model.num_hidden_layers=6"], capture_output=True, text=True)
  assert p.returncode == 0, p.stderr[-2000:]
  assert "6 layers (1 dense)" in p.stdout
  p = subprocess.run([sys.executable, "-m", "k2jax.plan", "--config", "k2jax/configs/tiny.py",
                      "--config.model.num_hidden_layers=6", "--mesh", "pipeline=5"],
                     capture_output=True, text=True)
  assert p.returncode == 0, p.stderr[-2000:]
  assert "pipeline (1f1b): 5 devices x 1 virtual stages of 1 layer(s)" in p.stdout


def test_zero1_falling_short_is_reported_not_hidden():
  """K2 on data = 24 (which divides none of 7168, 2048, 163,840 / 16): the routed experts'
  state still splits, over expert x data on the experts dimension (384 = 16 x 24), so it
  does not jump (before: 39.9 GB at data = 24 against 5.5 at 8); what cannot split
  (attention's, the embedding's) is named with what it costs."""
  config = configs.get_config("kimi_k2")
  config.optimizer.host_state = False   # the same split, counted on the device
  st = {d: plan.state_bytes(config, {"pipeline": 16, "data": d, "expert": 16})
        for d in (8, 16, 24, 32)}
  split = {d: s["optimizer"] - s["optimizer_unsplit"] for d, s in st.items()}
  assert split[8] > split[16] > split[24] > split[32], split
  assert st[24]["optimizer"] < 1.5 * st[8]["optimizer"]
  assert st[8]["optimizer_unsplit"] < 1e6 < st[24]["optimizer_unsplit"]
  text = plan.report(config, {"pipeline": 16, "data": 24, "expert": 16})
  assert ("GB is not split over its whole data-parallel group (data = 24): no dimension of "
          "adamw/embed" in text)


def test_cli_prints_the_comparison():
  p = subprocess.run([sys.executable, "-m", "k2jax.plan", "--config", "kimi_k2", "--mesh",
                      "pipeline=16,expert=16,data=1"], capture_output=True, text=True)
  assert p.returncode == 0
  assert "6.16 TB over a 256-device model-parallel group" in p.stdout
  assert "report 2.4.2" in p.stdout


@pytest.mark.parametrize("remat,impl", [("none", "xla"), ("selective", "xla"),
                                         ("none", "chunked")])
def test_activation_estimate_follows_the_compiled_program(remat, impl):
  """The estimate models what the configured implementation keeps: for the tiny model at
  T = 1024 it lands within 0.5-1.5x of XLA's own temporary-memory figure for forward +
  backward (materialized attention dominates with `xla`; the flash kernel's O(T) residuals
  with `chunked`), and it says which settings it used."""
  import jax
  import jax.numpy as jnp
  import optax
  cfg = configs.get_config("tiny").model
  cfg.update(dict(max_position_embeddings=1024, remat=remat, attention_impl=impl))
  T = 1024
  params = jax.eval_shape(lambda: model.init(cfg, jax.random.key(0)))

  def loss(p, t):
    logits, _ = model.forward(cfg, p, t)
    return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()

  compiled = jax.jit(jax.grad(loss)).lower(params, jax.ShapeDtypeStruct((1, T), jnp.int32)).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  acts = plan.activation_bytes(cfg, {"pipeline": 1, "data": 1, "expert": 1}, T,
                               platform="cpu")
  assert acts.settings == dict(remat=remat, attention_impl=impl, storage="model",
                               platform="cpu", offload=False) and acts.host == 0
  est = acts.device
  assert 0.5 < est / temp < 1.5, (est, temp)


def test_selective_recomputation_keeps_less_than_none():
  """Report 2.4.3's selective recomputation (norms, SwiGLU, MLA up-projections, MoE
  down-projections recomputed) must keep less than no policy and more than full
  recomputation, traced at K2's widths with the GPU kernels. The complement policy it
  replaced kept exactly what no policy keeps (1.98 GB per MoE layer and 4096 tokens)."""
  from k2jax.kernels import platform
  from k2jax.model import transformer
  cfg = configs.get_config("kimi_k2").model
  got = {}
  for remat in ("none", "selective", "full"):
    cfg.remat = remat
    with platform.target("gpu"):
      got[remat] = transformer.layer_residual_bytes(cfg, "moe", 4096)
  assert got["full"] < got["selective"] < 0.5 * got["none"], got
  # full keeps the layer input: one bf16 row per token, plus scalars
  assert got["full"] < 1.1 * 4096 * cfg.hidden_size * 2, got


def test_offload_on_one_stage_puts_what_the_policy_keeps_in_host_memory():
  """model.offload without a pipeline is the layers' offloading remat policy: traced, the
  residuals in host memory are exactly what the policy keeps beyond the layer input (the
  non-offloading policy's residuals less full recomputation's), and plan counts them on
  the host, not the device."""
  from k2jax.tools import plan
  from k2jax.kernels import platform
  from k2jax.model import transformer
  cfg = configs.get_config("tiny").model
  cfg.update(dict(max_position_embeddings=1024, remat="selective", offload=True))
  T = 1024

  def traced(remat, memory):
    c = cfg.copy_and_resolve_references()
    c.remat = remat
    with platform.target("gpu"):
      return transformer.layer_residual_bytes(c, "moe", T, memory=memory)
  kept, inputs = traced("selective", "all"), traced("full", "all")
  assert traced("selective", "device") == inputs
  assert traced("selective", "host") == kept - inputs > 0
  mesh = {"pipeline": 1, "data": 1, "expert": 1}
  on = plan.activation_bytes(cfg, mesh, T, offload=True)
  off = plan.activation_bytes(cfg, mesh, T, offload=False)
  assert off.host == 0 and on.settings["offload"] and not off.settings["offload"]
  # the same bytes, now split: nothing counted twice or lost
  assert abs(on.device + on.host - off.device) < 1e-6 * off.device, (on, off)
  layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
  assert on.host >= layers * (kept - inputs)


def test_plan_reports_the_zbh1_table_the_trainer_builds():
  """One source of truth: plan's idle figure for zbh1 is the trainer's table
  (pipeline.table) read with the trainer's stage costs (pipeline.costs, W's share traced from
  the split)."""
  from k2jax import configs
  from k2jax.tools import plan
  from k2jax.parallel import pipeline
  c = configs.get_config("kimi_k2")
  c.mesh.pipeline_schedule = "zbh1"
  mesh = {a: c.mesh[a] for a in ("pipeline", "data", "expert")}
  want = pipeline.table(c).idle_fraction(pipeline.costs(c))
  text = plan.report(c, mesh, name="kimi_k2")
  assert f"pipeline (zbh1): 16 devices x {c.mesh.virtual_stages} virtual stages" in text
  assert f"idle {want:.1%} of device time by stage FLOPs" in text
  # against 1f1b (whose stage 0 recomputes the prefix too) the split idles less
  assert want < schedules_1f1b_idle(c)


def schedules_1f1b_idle(c):
  from k2jax.parallel import layout, pipeline, schedules
  c = c.copy_and_resolve_references()
  c.mesh.pipeline_schedule = "1f1b"
  sp = layout.of(c)
  costs = schedules.stage_costs(c.model, sp, c.train.seq_len)
  return pipeline.table(c).idle_fraction(costs)


def test_plan_counts_what_zbh1_keeps_for_its_weight_gradients():
  """zbh1's extra activations over 1f1b are at least what its W tasks must read, from the
  math alone: a weight gradient x^T dy deferred to W needs at least one [tokens, hidden]
  operand per layer that 1F1B's backward drops at once (bf16), and every pipeline device
  allocates the table's cut slots of a stage's layers each (the loop's buffers have one
  shape)."""
  from k2jax import configs
  from k2jax.tools import plan
  from k2jax.parallel import pipeline
  c = configs.get_config("kimi_k2")
  mesh = {a: c.mesh[a] for a in ("pipeline", "data", "expert")}
  T = c.train.seq_len
  act = {(s, o): plan.activation_bytes(c.model, mesh, T, virtual_stages=2, microbatches=32,
                                       schedule=s, offload=o)
         for s in ("1f1b", "zbh1") for o in (False, True)}
  c.mesh.pipeline_schedule = "zbh1"
  tab = pipeline.table(c)
  per_layer = T * c.model.hidden_size * 2
  assert tab.sizes["cut"] >= 1
  extra = tab.sizes["cut"] * 2 * per_layer
  assert act["zbh1", False].device - act["1f1b", False].device > extra, (act, tab.sizes)
  # with model.offload (the preset's) the cut waits in host memory with the residuals
  assert act["zbh1", True].host - act["1f1b", True].host > extra, (act, tab.sizes)


def test_an_expert_parallel_layer_keeps_what_report_2_4_3_keeps():
  """K2's MoE layer on its expert-parallel path (16 shards, the preset's selective
  recomputation and FP8 storage, traced as plan traces it): what the backward pass keeps is
  the received rows and the SwiGLU inputs in FP8 at the smallest transport capacity (1.25x
  the balanced load), their scales and routing, plus at most what the layer keeps without
  expert parallelism. Differentiating the transport's lax.switch kept every capacity's
  residuals (8.4 GB per sequence, 15x this bound)."""
  from k2jax.kernels import platform
  from k2jax.kernels.buckets import capacities
  from k2jax.model import transformer
  c = configs.get_config("kimi_k2").model
  with platform.target("gpu"):
    ep = transformer.layer_residual_bytes(c, "moe", 4096, 1, 1, 16)
    local = transformer.layer_residual_bytes(c, "moe", 4096)
  d, f = c.hidden_size, c.moe_intermediate_size
  rows = capacities(16 * 4096 * c.num_experts_per_tok, 16)[0]
  stored = rows * ((d + 2 * f) + 4 * (-(-d // 128) + 2 * -(-f // 128)) + 8)
  assert stored <= ep <= stored + local, (ep, stored, local)


def test_long_context_on_context_devices_keeps_pretrainings_residuals_and_bubble():
  """Issue 44: kimi_k2_long_context (32k tokens) on its layout, PP16 x EP16 x CP8, keeps in
  host memory no more stage residuals per device than the 4k preset on PP16 x EP16 x DP8
  (each device holds 4k tokens of a sequence either way) and idles <= 10% by stage FLOPs
  (128 microbatches); the same 32k on DP8, without context, holds over 5x more."""
  from k2jax import configs
  from k2jax.tools import plan
  from k2jax.parallel import pipeline
  long = configs.get_config("kimi_k2_long_context")
  mesh = {a: long.mesh[a] for a in ("pipeline", "data", "context", "expert")}
  assert mesh == {"pipeline": 16, "data": 1, "context": 8, "expert": 16}
  est = plan.estimate(long, mesh)
  short = plan.estimate("kimi_k2", {"pipeline": 16, "data": 8, "context": 1, "expert": 16})
  assert est.acts.host <= short.acts.host * 1.001, (est.acts.host, short.acts.host)
  assert est.cfg.train.grad_accum == 128
  assert pipeline.table(est.cfg).idle_fraction(pipeline.costs(est.cfg)) <= 0.10
  no_cp = plan.estimate(long, {"pipeline": 16, "data": 8, "context": 1, "expert": 16})
  assert no_cp.acts.host > 5 * est.acts.host


def test_the_loop_holds_a_third_layer_of_experts_only_where_the_exchange_runs_in_rounds():
  """The working set's layer weights: twice the layer (its weights and their gradient), plus
  the routed experts once more where the exchange's worst case runs in rounds (ragged, off
  CPU, expert > model.ep_round_load: the rounds' scan sums their gradient in its carry beside
  the round's own). The experts' share by hand: E / expert experts of gate, up [d, f] and
  down [f, d] in bf16. At K2's expert 16 on TPU: rounds of 2x the balanced load, none when a
  round may take all 16x."""
  c = configs.get_config("kimi_k2")
  m, T = c.model, c.train.seq_len
  d, f, E = m.hidden_size, m.moe_intermediate_size, m.n_routed_experts
  mesh = {"pipeline": 16, "data": 8, "expert": 16}

  def device(round_load, platform="tpu"):
    k = m.copy_and_resolve_references()
    k.ep_round_load = round_load
    return plan.activation_bytes(k, mesh, T, virtual_stages=2, microbatches=32,
                                 platform=platform).device

  experts = E // 16 * 3 * d * f * 2
  assert plan.stack_layer_bytes(m, "moe_layers", mesh, only="experts") == experts
  assert device(2.0) - device(16.0) == pytest.approx(experts, rel=1e-6)
  assert device(2.0, "cpu") == pytest.approx(device(16.0, "cpu"), rel=1e-9)   # no rounds


def test_loading_is_sized_per_host_by_the_loader_itself():
  """plan's loading figures (k2jax.interop.hf.load_plan, the loader's own blocks counted):
  for K2's FP8 release on PP16 x EP16 in hosts of 8 devices, the slice reads the files'
  bytes once, but for what every stage holds a copy of (the embedding, the dense first
  layer: under 6% more); on PP16 x DP2 x EP8
  with the replicas on other hosts, each host reads half its share and the slice still
  reads the files once, not twice (without that split each host would read twice what it
  reads on PP16 x EP16); the figures reach the CLI."""
  import jax
  import numpy as np
  from jax.sharding import AbstractMesh

  from k2jax.interop import hf
  from k2jax.parallel import MESH_AXES, layout, param_shardings
  config = configs.get_config("kimi_k2")
  sp = layout.of(config)
  stored = layout.stored_model(config.model, sp)

  def reads(mesh):
    amesh = AbstractMesh(tuple(mesh.get(a, 1) for a in MESH_AXES), MESH_AXES)
    specs = {tuple(k.key for k in p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(
        param_shardings(model.param_specs(stored), amesh))[0]}
    hosts = (np.arange(256) // 8).reshape(amesh.axis_sizes)
    return hf.load_plan(config.model, specs, dict(amesh.shape), hosts, layout=sp, fp8=True)

  one = reads({"pipeline": 16, "expert": 16})
  total = sum(one["read"].values())
  assert one["file"] <= total <= 1.06 * one["file"], (total, one["file"])
  two = reads({"pipeline": 16, "data": 2, "expert": 8})
  assert one["file"] <= sum(two["read"].values()) <= 1.06 * one["file"]
  # a host there holds a whole stage's experts, twice what it holds on EP16, and reads half
  assert max(two["read"].values()) <= 1.1 * max(one["read"].values())
  p = subprocess.run([sys.executable, "-m", "k2jax.plan", "--config", "kimi_k2", "--mesh",
                      "pipeline=16,expert=16,data=1", "--chips_per_host", "8"],
                     capture_output=True, text=True)
  assert p.returncode == 0, p.stderr[-2000:]
  line = next(l for l in p.stdout.splitlines() if l.strip().startswith("FP8 linears"))
  assert f"{one['file'] / 1e12:.2f} TB of files" in line
  assert f"each host reads {max(one['read'].values()) / 1e9:.2f} GB" in line
