"""`python -m k2jax.compile --program ...`: the serving engine's programs, the RL update with
its sampler, and SFT's step, compiled by XLA:TPU to the end of code generation for small
slices on this CPU (libtpu, compile only), through the user's command.

Serving runs a K2-shaped model (K2's widths, 2 MoE layers of 16 experts, a 32K vocabulary,
as tests/test_tpu_inference.py) expert-parallel over a v5e:2x2 slice; RL the tiny_rl preset
cut to one MoE layer without PTX on one v5e chip. Each compile runs in a subprocess (a libtpu
abort must not take a pytest worker with it)."""

import pytest

pytest.importorskip("libtpu")

from tests.test_tpu_compile import compile_cli  # noqa: E402  (the same command, in a subprocess)

K2_SHAPED = ["--config", "kimi_k2", "--config.model.num_hidden_layers=2",
             "--config.model.first_k_dense_replace=0", "--config.model.n_routed_experts=16",
             "--config.model.num_experts_per_tok=4", "--config.model.vocab_size=32768",
             # the pre-training mesh is checked with the config: one a small slice takes
             "--config.mesh.pipeline=1", "--config.mesh.virtual_stages=1"]


def check_figures(fig, program):
  """XLA's executable was analysed (code generation ran), and the arguments it counts are
  the shards the engine's / trainer's shardings put on a device: at least them, and at most
  TPU's (8, 128) tiles on top (the small leaves: norms, biases) and the host's scalars."""
  assert fig["compiled"] and fig["program"] == program
  for p in fig["programs"]:
    d, plan = p["xla_device"], p["plan"]
    placed = sum(v for k, v in plan.items() if not k.startswith("plan"))
    assert placed <= d["arguments"] <= 1.06 * placed + (1 << 20), (p["program"], d, plan)
    assert d["peak"] >= d["arguments"] + d["temporaries"] - d["aliased"]
    assert p["fits"] and p["hbm"] > 0


def test_engine_decode_compiles_with_its_slots_split_over_the_experts(tmp_path):
  """k2jax.engine's steps on --mesh expert=4: 6 rows asked take 8 slots (slot_count: a
  multiple of the 4 batch devices), split 2 a device; the dispatch runs every slot and the
  donated cache comes back in place."""
  r, fig = compile_cli(tmp_path, *K2_SHAPED, "--program", "decode", "--topology", "v5e:2x2",
                       "--mesh", "expert=4", "--rows", "6", "--context", "200")
  assert r.returncode == 0, r.stderr[-3000:]
  check_figures(fig, "decode")
  (p,) = fig["programs"]
  assert p["mesh"] == "expert=4" and "8 slots x 256 (6 asked" in p["geometry"], p
  for text in ("decode (k2jax.serving.engine steps)", "slots split over expert", "peak",
               "the cache comes back placed as it went in", "HBM 16.9 GB per chip"):
    assert text in r.stdout, r.stdout
  slot = 256 * 2 * (512 + 64) * 2      # positions x layers x latent + rope x bf16
  assert p["plan"]["cache"] == 8 * slot // 4 + 8 * 4     # 2 slots a device, lengths whole
  assert p["xla_device"]["aliased"] >= p["plan"]["cache"]


def test_engine_prefill_compiles_new_rows_into_the_slots(tmp_path):
  """k2jax.engine's admit: 3 new rows (a batch of 4: one per batch device) of a 100-token
  prompt (its bucket of 128) written into the slotted cache."""
  r, fig = compile_cli(tmp_path, *K2_SHAPED, "--program", "prefill", "--topology",
                       "v5e:2x2", "--mesh", "expert=4", "--rows", "3", "--context", "200",
                       "--prompt", "100")
  assert r.returncode == 0, r.stderr[-3000:]
  check_figures(fig, "prefill")
  (p,) = fig["programs"]
  assert "3 new rows (batch 4) x 128 prompt tokens into 4 slots x 256" in p["geometry"], p
  assert "prefill (k2jax.serving.engine admit)" in r.stdout and "arguments" in r.stdout


def test_rl_update_and_its_sampler_compile(tmp_path):
  """--program rl: the update (k2jax.rl.train.step_program, the state placed as rl.train's
  loop places it, plan's step estimate beside it), then generate's prefill and decode steps
  as the rollouts call them, the steps taking the cache as the prefill returns it. With
  optimizer.host_state (K2's) the update returns the new optimizer states to host memory,
  in place of the old: the device gives back only the params (donated) and the metrics."""
  r, fig = compile_cli(tmp_path, "--config", "tiny_rl", "--program", "rl", "--topology",
                       "v5e:1x1", "--config.model.num_hidden_layers=1",
                       "--config.model.first_k_dense_replace=0", "--config.rl.ptx_weight=0",
                       "--config.optimizer.host_state=True", "--context", "64")
  assert r.returncode == 0, r.stderr[-3000:]
  check_figures(fig, "rl")
  names = [p["program"] for p in fig["programs"]]
  assert names == ["rl update (k2jax.rl.train.step_program)",
                   "rl sampler prefill (k2jax.generate)",
                   "rl sampler decode steps (k2jax.generate)"], names
  update, prefill, steps = fig["programs"]
  assert update["geometry"] == "8 prompts x 4 samples = 32 rows x 64", update
  assert update["plan"]["plan (K1.5 forward; PTX not counted)"] > update["plan"]["state"]
  host, device = update["xla_host"], update["xla_device"]
  assert host["arguments"] > 0 and host["outputs"] == host["aliased"] == host["arguments"]
  assert device["outputs"] - device["aliased"] < 1 << 16, device
  assert "x 32 prompt tokens, cache 64" in prefill["geometry"], prefill   # 64 - segment 32
  assert steps["xla_device"]["aliased"] >= steps["plan"]["cache"]    # decoded in place


def test_sft_is_the_train_step(tmp_path):
  """--program sft says SFT's step is the pre-training program and compiles that."""
  r, fig = compile_cli(tmp_path, "--config", "tiny_sft", "--program", "sft", "--topology",
                       "v5e:1x1", "--no_plan", "--config.train.seq_len=128")
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.startswith("sft: k2jax.sft trains through k2jax.training.train.train"), r.stdout
  assert "train step compiled for v5e:1x1" in r.stdout and fig["compiled"]


@pytest.mark.parametrize("args,line", [
    (["--program", "serve"], "--program 'serve': choose one of train, sft, rl, prefill, decode"),
    (["--program", "decode", "--mesh", "expert=3"],
     "--mesh expert=3: needs 3 devices and 4 are here"),
    (["--program", "decode", "--mesh", "experts=4"], "--mesh 'experts=4': expected"),
    (["--program", "decode", "--mesh", "pipeline=4"], "--mesh pipeline=4: sampling has no"),
    (["--program", "train", "--mesh", "expert=4"], "--mesh: only for the serving programs"),
    (["--program", "decode", "--rows", "0"], "--rows 0: must be >= 1"),
    (["--program", "rl"], "--config tiny has no rl group"),
])
def test_a_bad_program_or_mesh_ends_in_one_line(tmp_path, args, line):
  r, fig = compile_cli(tmp_path, "--config", "tiny", "--topology", "v5e:2x2", *args)
  assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
  lines = [ln for ln in r.stderr.splitlines() if ln.startswith("k2jax.compile")]
  assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert lines[0].startswith(f"k2jax.compile: error: {line}"), lines[0]
  assert fig is None
