"""Step time, tokens/s and per-device memory of the tiny config on 1 vs 8 simulated devices.

    python experiments/bench_parallel.py [--steps 10] [--out experiments/results/parallel]

Each mesh runs in its own subprocess (the simulated device count is fixed when JAX starts).
Memory comes from XLA's compiled memory analysis of the train step (per device); ZeRO-1 is
compared with the same mesh keeping optimizer state replicated over `data`. The optimizer
update is also timed alone, to show what the sharded Muon update costs (each device
orthogonalizes its own matrices, split over data ranks: optim.muon.on_local_matrices).
Simulated CPU devices share the machine's cores, so 8 "devices" are not 8x faster: the
ratios show the overhead of the parallel program, not a speed-up.
"""

import argparse
import csv
import functools
import json
import os
import subprocess
import sys
import time

MESHES = [(1, "1x1", True), (8, "8x1", True), (8, "8x1", False), (8, "2x4", True),
          (8, "1x8", True)]


def measure(mesh_spec, zero1, steps):
  import jax
  import numpy as np
  from k2jax import configs, data as data_lib, model, optim, parallel
  from k2jax.training.step import init_state, train_step

  cfg = configs.get_config("tiny")
  d, e = map(int, mesh_spec.split("x"))
  cfg.mesh.update(dict(data=d, expert=e))
  cfg.data.max_corpus_bytes = 2_000_000
  mesh = parallel.make_mesh(cfg.mesh)
  tx, schedule = optim.optimizer(cfg), optim.learning_rate_schedule(cfg)
  data = data_lib.build(cfg.data, cfg.train, cfg.model.vocab_size)
  with jax.set_mesh(mesh):
    abstract = jax.eval_shape(functools.partial(init_state, cfg, tx), jax.random.key(0))
    sh = parallel.state_shardings(model.param_specs(cfg.model), mesh, abstract, tx, zero1)
    bsh = parallel.batch_sharding(mesh, cfg.train.batch_size)
    state = jax.jit(functools.partial(init_state, cfg, tx), out_shardings=sh)(jax.random.key(0))
    step = jax.jit(functools.partial(train_step, cfg, tx, schedule), donate_argnums=0,
                   in_shardings=(sh, bsh), out_shardings=(sh, parallel.replicated(mesh)))
    it = data.train_iter()
    batches = [{k: jax.device_put(v, bsh) for k, v in next(it).items()} for _ in range(steps + 2)]
    t0 = time.perf_counter()
    compiled = step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    for b in batches[:2]:                       # warm up
      state, m = compiled(state, b)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for b in batches[2:]:
      state, m = compiled(state, b)
    jax.block_until_ready(state)
    step_s = (time.perf_counter() - t0) / steps

    upd = jax.jit(lambda g, s, p, ml: tx.update(g, s, p, max_logits=ml),
                  in_shardings=(sh.params, sh.opt_state, sh.params, None))
    ml = np.zeros((cfg.model.num_hidden_layers, cfg.model.num_attention_heads), np.float32)
    jax.block_until_ready(upd(state.params, state.opt_state, state.params, ml))
    t0 = time.perf_counter()
    for _ in range(steps):
      jax.block_until_ready(upd(state.params, state.opt_state, state.params, ml))
    update_s = (time.perf_counter() - t0) / steps
  opt_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.opt_state))
  return dict(mesh=mesh_spec, devices=jax.device_count(), zero1=zero1, compile_s=compile_s,
              step_ms=step_s * 1e3, tokens_per_s=cfg.train.batch_size * cfg.train.seq_len / step_s,
              optimizer_update_ms=update_s * 1e3, opt_state_bytes_per_device=opt_bytes,
              argument_bytes=mem.argument_size_in_bytes, temp_bytes=mem.temp_size_in_bytes)


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--out", default="experiments/results/parallel")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    mesh_spec, zero1 = args.child.split(":")
    print("RESULT " + json.dumps(measure(mesh_spec, zero1 == "1", args.steps)))
    return
  rows = []
  for devices, mesh_spec, zero1 in MESHES:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    r = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--child",
                        f"{mesh_spec}:{int(zero1)}"], env=env, capture_output=True, text=True)
    if r.returncode:
      sys.exit(r.stderr[-3000:])
    rows.append(json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT"))[7:]))
  base = rows[0]
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "bench_parallel.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  print(f"{'mesh (data x expert)':<22}{'ZeRO-1':>7}{'step ms':>9}{'vs 1 dev':>9}{'tokens/s':>10}"
        f"{'opt upd ms':>11}{'opt MB/dev':>11}{'args MB':>9}{'temp MB':>9}")
  for r in rows:
    print(f"{r['mesh'] + ' (' + str(r['devices']) + ' dev)':<22}{str(r['zero1']):>7}"
          f"{r['step_ms']:>9.1f}{r['step_ms'] / base['step_ms']:>8.2f}x{r['tokens_per_s']:>10.0f}"
          f"{r['optimizer_update_ms']:>11.1f}{r['opt_state_bytes_per_device'] / 1e6:>11.2f}"
          f"{r['argument_bytes'] / 1e6:>9.2f}{r['temp_bytes'] / 1e6:>9.1f}")


if __name__ == "__main__":
  main()
