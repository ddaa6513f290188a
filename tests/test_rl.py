"""RL: the K1.5 loss against float64 brute force, environments' scorers, the sandbox's limits
(as root and as an unprivileged user), multi-turn tool rollouts, the trainer end to end with
partial rollouts and resume."""

import json
import os
import random
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import configs
from k2jax.serving import chat
from k2jax.data import ByteTokenizer
from k2jax.rl import budget_rewards, envs, k15_loss, sandbox, sequence_logprobs, temperature_at

try:
  sandbox.check("namespaces")
  sandbox_unavailable = ""
except sandbox.SandboxUnavailable as e:
  sandbox_unavailable = str(e)


def k15_float64(logp, logp_old, rewards, tau, mask):
  """The formula, written out per prompt and sample in float64."""
  total, groups = 0.0, 0
  for p in range(rewards.shape[0]):
    idx = [i for i in range(rewards.shape[1]) if mask[p, i]]
    if not idx:          # an empty (padded) group is not a prompt
      continue
    groups += 1
    base = sum(rewards[p, i] for i in idx) / len(idx)
    total += sum((rewards[p, i] - base - tau * (logp[p, i] - logp_old[p, i])) ** 2
                 for i in idx) / len(idx)
  return total / groups


@pytest.mark.parametrize("P,K,tau", [(1, 2, 0.1), (3, 5, 1.0), (4, 3, 0.37)])
def test_k15_loss_matches_float64_and_its_gradient(P, K, tau):
  rng = np.random.default_rng(P * 10 + K)
  logp = rng.normal(-20, 5, (P, K))
  logp_old = logp + rng.normal(0, 0.5, (P, K))
  rewards = rng.uniform(0, 1, (P, K))
  mask = rng.uniform(size=(P, K)) < 0.8
  mask[:, :2] = True                      # every group keeps >= 2 samples
  f = lambda lp: k15_loss(lp, jnp.asarray(logp_old, jnp.float32),
                          jnp.asarray(rewards, jnp.float32), tau, jnp.asarray(mask))
  got = float(f(jnp.asarray(logp, jnp.float32)))
  want = k15_float64(logp, logp_old, rewards, tau, mask)
  assert abs(got - want) <= 1e-5 * max(1.0, abs(want))
  grad = np.asarray(jax.grad(f)(jnp.asarray(logp, jnp.float32)))
  eps = 1e-4
  for p in range(P):
    for i in range(K):
      hi, lo = logp.copy(), logp.copy()
      hi[p, i] += eps
      lo[p, i] -= eps
      fd = (k15_float64(hi, logp_old, rewards, tau, mask)
            - k15_float64(lo, logp_old, rewards, tau, mask)) / (2 * eps)
      assert abs(grad[p, i] - fd) <= 1e-4 * max(1.0, abs(fd)), (p, i, grad[p, i], fd)
  # no gradient reaches the sampling policy or the rewards (they are data)
  g_old = jax.grad(lambda lo: k15_loss(jnp.asarray(logp, jnp.float32), lo,
                                       jnp.asarray(rewards, jnp.float32), tau))(
                                           jnp.asarray(logp_old, jnp.float32))
  assert not np.any(np.asarray(g_old))


def test_k15_loss_averages_over_the_groups_that_exist():
  """Empty (padded) groups of a partial-rollout batch change neither the loss nor its
  gradient: 1 real group among 8 gives that group's loss, not an eighth of it."""
  rng = np.random.default_rng(3)
  lp, lo = rng.normal(-20, 5, (1, 4)), rng.normal(-20, 5, (1, 4))
  r = rng.uniform(0, 1, (1, 4))
  pad = lambda a: np.concatenate([a, np.zeros((7, 4))])
  mask = np.zeros((8, 4), bool)
  mask[0] = True
  one = lambda lp: k15_loss(lp, jnp.asarray(lo, jnp.float32), jnp.asarray(r, jnp.float32), 0.3)
  eight = lambda lp: k15_loss(lp, jnp.asarray(pad(lo), jnp.float32),
                              jnp.asarray(pad(r), jnp.float32), 0.3, jnp.asarray(mask))
  want = k15_float64(lp, lo, r, 0.3, np.ones((1, 4), bool))
  assert abs(float(eight(jnp.asarray(pad(lp), jnp.float32))) - want) <= 1e-5 * max(1, want)
  np.testing.assert_allclose(np.asarray(jax.grad(eight)(jnp.asarray(pad(lp), jnp.float32)))[0],
                             np.asarray(jax.grad(one)(jnp.asarray(lp, jnp.float32)))[0],
                             rtol=1e-5)


def test_k15_loss_is_zero_at_the_baseline_and_unmasked_by_default():
  r = jnp.asarray([[0.3, 0.3, 0.3]])
  lp = jnp.asarray([[-5.0, -6.0, -7.0]])
  assert float(k15_loss(lp, lp, r, 0.5)) == 0.0
  r2 = np.asarray([[1.0, 0.0]])
  # without a mask: residuals +-0.5 -> mean 0.25
  assert abs(float(k15_loss(lp[:, :2], lp[:, :2], jnp.asarray(r2), 0.5)) - 0.25) < 1e-7


def test_sequence_logprobs_brute_force():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 7))
  targets = rng.integers(0, 7, (2, 5))
  mask = rng.uniform(size=(2, 5)) < 0.6
  got = np.asarray(sequence_logprobs(jnp.asarray(logits, jnp.float32), jnp.asarray(targets),
                                     jnp.asarray(mask, jnp.float32)))
  ls = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  want = [sum(ls[b, t, targets[b, t]] for t in range(5) if mask[b, t]) for b in range(2)]
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("mode,level", [("tis", "token"), ("icepop", "token"),
                                        ("tis", "sequence"), ("icepop", "sequence"),
                                        ("none", "token")])
def test_rollout_weights_brute_force(mode, level):
  """Each counted token's (or sequence's) ratio pi_old / pi_sampler, truncated or masked by
  its definition, one element at a time in float64; tokens without a sampler
  log-probability (NaN) or outside the mask keep weight 1 and are not counted."""
  from k2jax.rl.loss import rollout_weights
  rng = np.random.default_rng(7)
  B, T = 5, 9
  trainer = rng.normal(-2, 1, (B, T))
  sampler = trainer + rng.normal(0, 0.6, (B, T))
  mask = rng.uniform(size=(B, T)) < 0.7
  sampler[0, :3] = np.nan                 # tokens of a trajectory kept before logp was
  cap, low, high = 1.5, 0.6, 1.4
  w, stats = rollout_weights(trainer, sampler, mask, mode=mode, level=level, cap=cap,
                             low=low, high=high)
  ratios, want = [], np.ones((B, T))
  for b in range(B):
    counted = [t for t in range(T) if mask[b, t] and not np.isnan(sampler[b, t])]
    seq = float(np.exp(sum(trainer[b, t] - sampler[b, t] for t in counted)))
    if level == "sequence" and counted:
      ratios.append(seq)
    for t in counted:
      rho = seq if level == "sequence" else float(np.exp(trainer[b, t] - sampler[b, t]))
      if level == "token":
        ratios.append(rho)
      want[b, t] = (min(rho, cap) if mode == "tis" else
                    (rho if low <= rho <= high else 0.0) if mode == "icepop" else 1.0)
  np.testing.assert_allclose(w, want, rtol=1e-6)
  assert stats["ratio_mean"] == pytest.approx(np.mean(ratios), rel=1e-9)
  cut = np.mean([r > cap for r in ratios]) if mode == "tis" else 0.0
  out = np.mean([not low <= r <= high for r in ratios]) if mode == "icepop" else 0.0
  assert stats["truncated_frac"] == pytest.approx(cut) and stats["masked_frac"] == pytest.approx(out)
  assert (0 < cut < 1) or (0 < out < 1) or mode == "none"     # the cases are exercised
  with pytest.raises(ValueError, match="modes none, tis, icepop"):
    rollout_weights(trainer, sampler, mask, mode="clip")


def test_weighted_sequence_logprobs_give_the_k15_gradient_each_token_weighted():
  """With importance weights the K1.5 loss keeps its value, and its gradient in the logits
  is the float64 derivative with each token's term scaled by its weight:
  dL/dz[b,t,v] = dL/dlogp_b * mask[b,t] * w[b,t] * (onehot(y[b,t])_v - softmax(z[b,t])_v),
  dL/dlogp_b = -2 tau resid_b m_b / n_p / groups."""
  rng = np.random.default_rng(11)
  P, K, T, V, tau = 2, 3, 4, 6, 0.3
  z = rng.normal(size=(P * K, T, V))
  y = rng.integers(0, V, (P * K, T))
  mask = (rng.uniform(size=(P * K, T)) < 0.8).astype(np.float64)
  w = rng.uniform(0, 2, (P * K, T))
  old = rng.normal(-8, 1, (P, K))
  r = rng.uniform(0, 1, (P, K))

  def loss(zz, weights):
    lp = sequence_logprobs(zz, jnp.asarray(y), jnp.asarray(mask, jnp.float32), weights)
    return k15_loss(lp.reshape(P, K), jnp.asarray(old, jnp.float32),
                    jnp.asarray(r, jnp.float32), tau)
  zj = jnp.asarray(z, jnp.float32)
  assert float(loss(zj, jnp.asarray(w, jnp.float32))) == pytest.approx(float(loss(zj, None)),
                                                                       rel=1e-6)
  got = np.asarray(jax.grad(loss)(zj, jnp.asarray(w, jnp.float32)))
  ls = z - np.log(np.exp(z).sum(-1, keepdims=True))
  logp = (np.take_along_axis(ls, y[..., None], -1)[..., 0] * mask).sum(-1).reshape(P, K)
  resid = r - r.mean(-1, keepdims=True) - tau * (logp - old)
  dlogp = (-2 * tau * resid / K / P).reshape(-1)
  soft = np.exp(ls)
  onehot = np.eye(V)[y]
  want = dlogp[:, None, None] * (mask * w)[..., None] * (onehot - soft)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-7)
  unweighted = np.asarray(jax.grad(loss)(zj, None))
  assert np.abs(got - unweighted).max() > 1e-3 * np.abs(unweighted).max()   # weights matter


def test_budget_penalty_and_temperature_decay():
  np.testing.assert_array_equal(
      budget_rewards(jnp.asarray([1.0, 0.0, 1.0]), jnp.asarray([False, True, True]), -0.5),
      [1.0, -0.5, -0.5])
  assert temperature_at(0, 10, 1.0, 0.5) == 1.0 and temperature_at(10, 10, 1.0, 0.5) == 0.5
  assert temperature_at(5, 10, 1.0, 0.5) == 0.75 and temperature_at(99, 10, 1.0, 0.5) == 0.5


# ------------------------------------------------------------------------- environments

def test_arithmetic_scores_the_last_integer():
  env = envs.Arithmetic(max_operand=9)
  tasks = env.tasks(random.Random(1), 20)
  assert tasks == env.tasks(random.Random(1), 20)           # deterministic from the rng
  for t in tasks:
    a = t.data["answer"]
    q = t.messages[0]["content"][len("What is "):-1]
    assert a == eval(q)  # noqa: S307 - our own two-digit expression
    assert env.score(t, f"{q} = {a}") == 1.0
    assert env.score(t, f"{q} = {a + 1}") == 0.0
    assert env.score(t, "no idea") == 0.0


def test_arithmetic_held_out_problems_are_never_drawn_for_training():
  """The one-digit space holds only 300 problems, so evaluation draws were seen in training:
  the held-out part (a fixed partition) is drawn by no training source - RL's tasks, SFT's
  dialogs (and the PTX data, which are SFT dialogs) - and evaluation takes only it."""
  from k2jax import sft
  train_env, held = envs.Arithmetic(max_operand=9), envs.Arithmetic(max_operand=9,
                                                                    split="heldout")
  question = lambda t: t.messages[0]["content"]   # noqa: E731
  held_out = {question(t) for t in held.all_tasks()}
  train_part = {question(t) for t in train_env.all_tasks()}
  everything = {question(t) for t in envs.Arithmetic(max_operand=9, split="all").all_tasks()}
  assert len(everything) == 300 and held_out | train_part == everything
  assert not held_out & train_part and 60 <= len(held_out) <= 90
  assert {question(t) for t in train_env.tasks(random.Random(0), 2000)} == train_part
  assert {question(t) for t in held.tasks(random.Random(0), 500)} == held_out
  # the same partition in a fresh process (a stable hash, not Python's salted one)
  code = ("from k2jax.rl import envs; print(sorted(t.messages[0]['content'] for t in "
          "envs.Arithmetic(max_operand=9, split='heldout').all_tasks()))")
  env = dict(os.environ, PYTHONHASHSEED="12345")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
  assert out.stdout.strip() == repr(sorted(held_out)), out.stderr[-2000:]
  for dialogs in (sft.default_dialogs(max_operand=9, tool_fraction=0.0),
                  sft.default_dialogs(n=512, seed=1)):   # SFT's, and RL's default PTX data
    asked = {m["content"] for d in dialogs for m in d["messages"] if m["role"] == "user"}
    assert asked & train_part and not asked & held_out
  with pytest.raises(ValueError, match="arithmetic split 'test'"):
    envs.Arithmetic(split="test")


def test_arithmetic_draws_only_its_operators_and_two_digit_addition_is_split_the_same_way():
  """ops picks the operators (two-digit addition: "+" at max_operand 99); tasks, every-problem
  lists and SFT dialogs hold no other operator, and the held-out part is the same partition
  (a problem's part depends on its text alone)."""
  from k2jax import sft
  add = envs.Arithmetic(max_operand=99, ops="+", split="all").all_tasks()
  assert len(add) == 100 * 100
  assert all(" + " in t.messages[0]["content"] for t in add)
  held = {t.messages[0]["content"] for t in
          envs.Arithmetic(max_operand=99, ops="+", split="heldout").all_tasks()}
  assert held == {t.messages[0]["content"] for t in add
                  if envs.arithmetic_split(t.messages[0]["content"][8:-1]) == "heldout"}
  assert 0.2 < len(held) / len(add) < 0.3
  drawn = envs.Arithmetic(max_operand=99, ops="+-").tasks(random.Random(0), 400)
  assert {t.messages[0]["content"].split()[3] for t in drawn} == {"+", "-"}
  assert not {t.messages[0]["content"] for t in drawn} & held
  dialogs = sft.default_dialogs(n=300, max_operand=99, ops="+", conversions=0.0,
                                tool_fraction=0.0)
  asked = [d["messages"][0]["content"] for d in dialogs]
  assert all(" + " in q for q in asked) and not set(asked) & held
  for bad in ("", "/", "++", "+x"):
    with pytest.raises(ValueError, match="arithmetic ops"):
      envs.Arithmetic(ops=bad)


def test_dropped_carry_teacher_slips_only_on_carries_at_its_rate():
  """dropped_carry: the verifier (envs.Arithmetic.score) rejects the demonstration exactly
  where the ones digits carry, at about the set rate, and its answer is one ten short; at 0
  the dialogs are the clean teacher's, draw for draw."""
  from k2jax import sft
  kw = dict(n=3000, max_operand=99, ops="+", conversions=0.0, tool_fraction=0.0)
  env = envs.Arithmetic(max_operand=99, ops="+", split="all")
  task_of = {t.messages[0]["content"]: t for t in env.all_tasks()}
  wrong, carries = 0, 0
  for d in sft.default_dialogs(dropped_carry=0.6, **kw):
    q, answer = d["messages"][0]["content"], d["messages"][1]["content"]
    a, b = (int(x) for x in q[len("What is "):-1].split(" + "))
    ok = env.score(task_of[q], answer) > 0
    carry = a % 10 + b % 10 >= 10
    carries += carry
    if not ok:
      assert carry and answer.endswith(f"= {a + b - 10}"), (q, answer)
      wrong += 1
  assert carries > 500 and abs(wrong / carries - 0.6) < 0.05, (wrong, carries)
  assert sft.default_dialogs(dropped_carry=0.0, **kw) == sft.default_dialogs(**kw)
  with pytest.raises(ValueError, match="dropped_carry"):
    sft.default_dialogs(dropped_carry=1.5)


def test_rollout_seed_depends_on_the_run_seed_and_is_a_pure_function():
  """Seeded by the iteration alone, runs of every seed drew the same samples; a pure function
  of (train.seed, iteration) keeps a resumed run's samples the uninterrupted run's."""
  from k2jax.rl.train import decode_seed
  seeds = {(s, it): decode_seed(s, it) for s in range(3) for it in range(50)}
  assert len(set(seeds.values())) == len(seeds)
  assert all(decode_seed(s, it) == v and 0 <= v < 2 ** 32 for (s, it), v in seeds.items())


def test_the_trainer_samples_with_the_run_seed(tmp_path, monkeypatch):
  from k2jax.rl import train as rl_train
  got = []

  class Stop(Exception):
    pass

  def decode(self, cfg, params, temperature, seed):
    got.append(seed)
    raise Stop   # the seed is all this test needs

  monkeypatch.setattr(rl_train.Rollouts, "decode", decode)
  for s in (0, 1):
    c = rl_config(ptx_weight=0.0)
    c.train.seed = s
    with pytest.raises(Stop):
      rl_train.run(c, str(tmp_path / f"seed{s}"))
  assert got == [rl_train.decode_seed(0, 0), rl_train.decode_seed(1, 0)]


def test_expression_parser_is_exact_and_refuses_code():
  assert envs.evaluate("8 / (3 - 8 / 3)", [8, 3, 8, 3]) == 24      # needs exact rationals
  for bad in ("__import__('os').system('true')", "2 ** 3", "x + 1", "1.5 * 16", "[1]",
              "(lambda: 1)()"):
    with pytest.raises(ValueError):
      envs.evaluate(bad, None)
  with pytest.raises(ValueError):
    envs.evaluate("1 / (2 - 2)", None)


def test_game24_scorer_and_solver():
  env = envs.Game24()
  t = envs.Task("game24", [], 64, {"numbers": [4, 7, 8, 8]})
  assert env.score(t, "(7 - 8 / 8) * 4") == 1.0
  assert env.score(t, "Let me think.\nAnswer: (7 - 8 / 8) * 4 = 24") == 1.0
  assert env.score(t, "(7 - 8 / 8) * 4 * 1") == 0.0         # a number not given
  assert env.score(t, "4 * 7 - 8 + 8") == 0.0               # 28: wrong value
  assert env.score(t, "(7 - 7 / 8) * 4") == 0.0             # 7 used twice
  assert env.score(t, "8 / (8 - 8) + 4 + 7") == 0.0         # division by zero
  assert envs.solvable_24([4, 7, 8, 8]) and envs.solvable_24([3, 3, 8, 8])
  assert not envs.solvable_24([1, 1, 1, 1])
  assert all(envs.solvable_24(t.data["numbers"]) for t in env.tasks(random.Random(0), 5))


def test_rank_rewards_share_ties():
  assert envs.rank_rewards([0.1, 0.9, 0.5]) == [0.0, 1.0, 0.5]
  assert envs.rank_rewards([1.0, 1.0, 0.0, 2.0]) == pytest.approx([0.5, 0.5, 0.0, 1.0])
  assert envs.rank_rewards([3.0]) == [0.5]


def test_self_critique_ranks_with_a_pluggable_judge():
  judge = lambda q, rs, rubrics: [len(r) for r in rs]       # a stand-in judge: longer = better
  env = envs.SelfCritique(judge=judge)
  t = env.tasks(random.Random(0), 1)[0]
  assert env.score_group(t, ["ab", "abcd", "a"]) == [0.5, 1.0, 0.0]
  with pytest.raises(ValueError, match="judge"):
    envs.SelfCritique().score_group(t, ["a", "b"])


def test_code_environment_runs_unit_tests_in_the_sandbox():
  env = envs.Code(problems=[("reverse", [("abc\n", "cba"), ("xy\n", "yx")])], timeout_s=3)
  t = env.tasks(random.Random(0), 1)[0]
  assert env.score(t, "Here:\n```python\nprint(input()[::-1])\n```") == 1.0
  assert env.score(t, "```python\ns = input()\nprint('cba' if s == 'abc' else s)\n```") == 0.5
  assert env.score(t, "```python\nwhile True: pass\n```") == 0.0
  assert env.score(t, "```python\nraise SystemExit(1)\n```") == 0.0
  assert env.score(t, "print(input()[::-1])") == 1.0                # no block: the whole text


# ------------------------------------------------------------------------------ sandbox

def test_sandbox_runs_and_limits():
  r = sandbox.run("print(input()[::-1])", stdin="abc\n", timeout_s=5)
  assert r.ok and r.stdout == "cba\n" and r.reason == "ok", r
  r = sandbox.run("while True: pass", timeout_s=1)
  assert not r.ok and r.reason == "timeout" and r.wall_s < 4
  r = sandbox.run("x = bytearray(400 << 20)", memory_mb=128)
  assert not r.ok and r.reason == "memory", r
  r = sandbox.run("import sys; sys.exit(3)")
  assert not r.ok and r.reason == "exit code 3"
  r = sandbox.run("open('/big', 'w').write('x')")        # outside its temp dir: denied
  assert not r.ok and not os.path.exists("/big")
  r = sandbox.run("open('out.txt', 'w').write('x' * (4 << 20))", file_mb=1)
  assert not r.ok                                         # file-size limit


def _escape_cases(host):
  """(name, program, run() options, check(result, host)) for what untrusted code tries.
  host: the caller's paths and pid, set up by _escape_host."""
  def no_marker_left(r, h):
    left = []
    for pid in os.listdir("/proc"):
      try:
        if pid.isdigit() and h["marker"] in open(f"/proc/{pid}/cmdline").read():
          left.append(pid)
      except OSError:
        pass
    return not left
  return [
      ("read host files", f"""
for p in [{host['secret']!r}, {host['readme']!r}, "/etc/passwd", "/root/.bashrc"]:
    try:
        print("read", p, open(p).read(64))
    except OSError as e:
        print("denied", p, e.errno)
""", {}, lambda r, h: r.ok and "read " not in r.stdout and "TOPSECRET" not in r.stdout),
      ("list /proc", """
import os
pids = [p for p in os.listdir("/proc") if p.isdigit()]
print(len(pids), [open(f"/proc/{p}/cmdline").read() for p in pids])
""", {}, lambda r, h: r.ok and int(r.stdout.split()[0]) <= 3 and "pytest" not in r.stdout
         and "sandbox_child" not in r.stdout),
      ("signal the caller", f"""
import os, signal
for pid in ({host['pid']}, os.getppid()):
    try:
        os.kill(pid, signal.SIGTERM); print("sent", pid)
    except OSError as e:
        print("denied", pid, e.errno)
""", {}, lambda r, h: f"denied {h['pid']}" in r.stdout),
      ("delete the caller's file", f"""
import os
try:
    os.remove({host['victim']!r}); print("deleted")
except OSError as e:
    print("denied", e.errno)
""", {}, lambda r, h: "deleted" not in r.stdout and os.path.exists(h["victim"])),
      ("fill /dev/shm and /tmp", """
for path in ("/dev/shm/fill", "/tmp/fill", "fill"):
    n = 0
    try:
        with open(path, "wb") as f:
            for _ in range(64):
                f.write(b"x" * (1 << 20)); f.flush(); n += 1
    except OSError as e:
        pass
    print(n)
""", dict(scratch_mb=4, file_mb=128, memory_mb=256),
       lambda r, h: r.ok and all(int(x) <= 4 for x in r.stdout.split())
       and sorted(os.listdir("/dev/shm")) == h["shm"]),
      ("write in a world-writable subdirectory", f"""
try:
    open({host['public']!r} + "/planted", "w").write("x"); print("wrote")
except OSError as e:
    print("denied", e.errno)
""", {}, lambda r, h: "wrote" not in r.stdout and os.listdir(h["public"]) == []),
      ("fork bomb", f"""
import os, sys
n = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)",
                                  {host['marker']!r}])
    n += 1
print(n)
""", dict(max_procs=8, timeout_s=10),
       # bounded (not 200); zombies of earlier runs count against the limit until the
       # host's init reaps them, which may free a few slots mid-run: hence 2 x max_procs
       lambda r, h: r.ok and int(r.stdout) <= 16 and no_marker_left(r, h)),
      ("memory bomb", "x = bytearray(1 << 31)", dict(memory_mb=256),
       lambda r, h: r.reason == "memory"),
      ("endless loop", "while True: pass", dict(timeout_s=1),
       lambda r, h: r.reason == "timeout" and r.wall_s < 4),
      ("network", """
import socket
s = socket.socket(); s.settimeout(2)
try:
    s.connect(("1.1.1.1", 80)); print("connected")
except OSError as e:
    print("blocked", e.errno)
""", {}, lambda r, h: r.ok and "blocked" in r.stdout and r.network_isolated),
  ]


def _escape_host(tmp_path, owner_uid):
  import uuid
  os.chmod(tmp_path, 0o755)
  (tmp_path / "secret.txt").write_text("TOPSECRET checkpoint bytes")
  os.chmod(tmp_path / "secret.txt", 0o644)
  victim = tmp_path / "victim.txt"
  victim.write_text("the caller's")
  os.chown(victim, owner_uid, owner_uid)
  public = tmp_path / "public"
  public.mkdir()
  os.chmod(public, 0o1777)
  readme = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
  return dict(secret=str(tmp_path / "secret.txt"), readme=readme, victim=str(victim),
              public=str(public), marker=f"k2jax-escape-{uuid.uuid4().hex}",
              shm=sorted(os.listdir("/dev/shm")), pid=os.getpid())


@pytest.mark.skipif(bool(sandbox_unavailable), reason=f"namespaces cannot start here: "
                    f"{sandbox_unavailable}")
def test_sandbox_contains_escapes_as_the_caller(tmp_path):
  """Each escape, run by this process (root in CI: the program runs as SANDBOX_UID)."""
  host = _escape_host(tmp_path, os.getuid())
  for name, code, kw, ok in _escape_cases(host):
    r = sandbox.run(textwrap.dedent(code), **{"timeout_s": 5, **kw})
    assert r.isolation == "namespaces" and ok(r, host), (name, r)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to an unprivileged user")
@pytest.mark.skipif(bool(sandbox_unavailable), reason=f"namespaces cannot start here: "
                    f"{sandbox_unavailable}")
def test_sandbox_contains_escapes_as_an_unprivileged_caller(tmp_path):
  """The same escapes from a trainer that is not root (uid 65534): it keeps its uid, so only
  the namespaces stand between the program and the trainer's files and process."""
  host = _escape_host(tmp_path, 65534)
  script = tmp_path / "sandbox_child.py"
  cases = [(name, textwrap.dedent(code), kw) for name, code, kw, _ in _escape_cases(host)]
  # the bwrap that uid can run: ours, or (our install in a 0700 home or clone) root's copy,
  # which this process removes at exit
  bwrap = sandbox._bwrap(True)
  script.write_text(textwrap.dedent(f"""
      import importlib.util, json, os, sys
      spec = importlib.util.spec_from_file_location("sandbox", {sandbox.__file__!r})
      sandbox = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(sandbox)     # while the repository may be out of its reach
      sandbox._bwrap = lambda as_root: {bwrap!r}
      os.setgroups([]); os.setgid(65534); os.setuid(65534)
      os.chdir("/tmp")
      out = []
      for name, code, kw in json.loads(sys.argv[1]):
          code = code.replace("{host['pid']}", str(os.getpid()))
          r = sandbox.run(code, **{{"timeout_s": 5, **kw}})
          out.append(dict(r.__dict__, pid=os.getpid()))
      print(json.dumps(out))
  """))
  os.chmod(script, 0o644)
  p = subprocess.run([sys.executable, str(script), json.dumps(cases)], capture_output=True,
                     text=True, timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  results = json.loads(p.stdout.strip().splitlines()[-1])
  for (name, _, _, ok), r in zip(_escape_cases(host), results):
    host["pid"] = r.pop("pid")       # the child is the caller the program may not signal
    r = sandbox.SandboxResult(**r)
    assert r.isolation == "namespaces" and ok(r, host), (name, r)


def test_sandbox_limits_only_is_an_explicit_opt_in():
  """isolation="limits" (where namespaces cannot start) still runs with its limits and says
  so; an unknown isolation is a result with a reason, not an exception."""
  r = sandbox.run("print(6 * 7)", isolation="limits")
  assert r.ok and r.stdout == "42\n" and r.isolation == "limits"
  r = sandbox.run("while True: pass", timeout_s=1, isolation="limits")
  assert r.reason == "timeout"
  r = sandbox.run("print(1)", isolation="chroot")
  assert not r.ok and r.reason.startswith("error:") and "namespaces, limits" in r.reason


@pytest.fixture
def namespaces_cannot_start(monkeypatch):
  """sandbox's namespaces probe fails as it does where unprivileged user namespaces are off
  (bwrap exits before the program starts); "limits" runs for real."""
  real = sandbox._run

  def probe_fails(*args):
    if args[-1] == "namespaces":
      return sandbox.SandboxResult(False, "", "bwrap: setting up uid map: Permission denied\n",
                                   "exit code 1", 1, 0.01, False)
    return real(*args)

  monkeypatch.setattr(sandbox, "_run", probe_fails)
  sandbox._check.cache_clear()
  yield
  sandbox._check.cache_clear()    # later tests get this machine's own answer


def test_code_environment_is_refused_without_namespaces_unless_limits_opted_in(
    tmp_path, capsys, namespaces_cannot_start):
  from k2jax.rl import train as rl_train
  workdir = tmp_path / "run"
  with pytest.raises(SystemExit) as e:
    rl_train.main(["k2jax.rl", "--config", "tiny_rl", "--config.rl.envs=arithmetic,code",
                   f"--workdir={workdir}"])
  err = capsys.readouterr().err
  lines = [l for l in err.splitlines() if l.startswith("k2jax.rl: error:")]
  assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
  assert ("rl.envs=code: bubblewrap could not start here (bwrap: setting up "
          "uid map: Permission denied)" in lines[0] and "--config.rl.sandbox=limits" in lines[0])
  assert not workdir.exists()
  with pytest.raises(sandbox.SandboxUnavailable, match="--config.rl.sandbox=limits"):
    envs.Code()
  # the opt-in: the config passes and the environment scores under limits
  c = configs.get_config("tiny_rl")
  c.rl.update(dict(envs="code", sandbox="limits"))
  rl_train.configs_validate(c)
  (env,) = rl_train.make_environments(c, None)
  assert env.isolation == "limits"
  t = env.tasks(random.Random(0), 1)[0]
  tests = t.data["tests"]
  answers = "\n".join(f"if s == {i!r}: print({o!r})" for i, o in tests)
  assert env.score(t, f"```python\nimport sys\ns = sys.stdin.read()\n{answers}\n```") == 1.0


# ------------------------------------------------------------------- rollouts and trainer

def rl_config(**rl):
  c = configs.get_config("tiny_rl")
  c.model.update(dict(hidden_size=64, num_hidden_layers=2, n_routed_experts=4,
                      moe_intermediate_size=32, intermediate_size=96, q_lora_rank=32,
                      kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                      num_attention_heads=2))
  # no greedy evaluation unless a test asks (its compile and decoding cost seconds)
  c.rl.update({**dict(prompts=2, samples=2, iterations=2, segment_tokens=4, budget=6,
                      updates_per_iteration=1, ptx_batch_size=2, checkpoint_every=1,
                      eval_every=0), **rl})
  c.train.update(dict(seq_len=256, steps=8))
  return c


def test_tool_calls_continue_the_trajectory():
  from k2jax.rl.train import Rollouts
  c = rl_config(tools=True, max_operand=9)
  tok = ByteTokenizer()
  env = envs.Arithmetic(max_operand=9, use_tools=True)
  ro = Rollouts(c, tok, [env], random.Random(0))
  ro.refill()
  traj = ro.groups[0][0]
  answer = traj.task.data["answer"]
  expr = traj.task.messages[0]["content"][len("What is "):-1]
  n0 = len(traj.ids)
  call = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0'
          '<|tool_call_argument_begin|>{"expression": "%s"}<|tool_call_end|>'
          '<|tool_calls_section_end|>' % expr)
  ro._end_turn(traj, call)
  assert not traj.done and traj.turns == 1
  appended = tok.decode(traj.ids[n0:])
  assert f"## Return of functions.calculator:0\n{answer}<|im_end|>" in appended
  assert appended.endswith(chat.GENERATION_PROMPT) and not any(traj.policy[n0:])
  ro._end_turn(traj, f"{expr} = {answer}")
  assert traj.done and traj.final_text == f"{expr} = {answer}"
  assert env.score_group(traj.task, [traj.final_text]) == [1.0]


def test_rl_trains_with_partial_rollouts_and_resumes(tmp_path):
  """Partial rollouts, resume, and what RL logs while it runs: greedy accuracy on each
  environment's fixed eval set (at iteration 1: the initial policy), the sampled responses
  with their rewards and lengths (samples.jsonl), the fraction truncated, the sampler's
  log pi against the trainer's over the tokens sampled this iteration (one policy in two
  programs: float rounding apart), the KL to the initial policy; `k2jax.plot` draws them."""
  from k2jax.tools import plot
  from k2jax.rl import train as rl_train
  c = rl_config(eval_every=1, eval_tasks=2, samples_every=1, kl_to_init=True)
  out = rl_train.run(c, str(tmp_path))
  hist = out["history"]
  # 4-token segments against a 6-token budget: nothing finishes in iteration 1 (paused),
  # iteration 2 resumes every trajectory and trains the finished groups
  assert hist[0]["groups_trained"] == 0 and hist[0]["in_flight"] == 2
  assert hist[1]["resumed_trajectories"] == 4 and hist[1]["groups_trained"] == 2
  assert np.isfinite(hist[1]["k15_loss"]) and np.isfinite(hist[1]["ptx_loss"])
  assert -0.5 <= hist[1]["mean_reward"] <= 1.0
  rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2]
  evals = {"eval_reward/arithmetic", "eval_accuracy/arithmetic", "eval_truncated/arithmetic"}
  assert evals <= set(rows[0]) and 0 <= rows[0]["eval_accuracy/arithmetic"] <= 1
  assert evals | {"truncated_frac", "mean_response_tokens", "logp_gap_sampler_trainer",
                  "logp_gap_max", "logp_gap_tokens", "kl_to_init"} <= set(rows[1])
  # the resumed trajectories' second segments (2 tokens each) were sampled by these weights
  assert rows[1]["logp_gap_tokens"] == 8 and rows[1]["logp_gap_max"] < 1e-4, rows[1]
  assert rows[1]["kl_to_init"] == pytest.approx(0, abs=1e-6)   # nothing trained before
  samples = [json.loads(x) for x in open(tmp_path / "samples.jsonl")]
  assert [s["iteration"] for s in samples] == [2] * 4
  assert set(samples[0]) == {"iteration", "env", "group", "sample", "prompt", "response",
                             "reward", "tokens", "truncated", "turns"}
  assert samples[0]["prompt"].startswith("What is ") and samples[0]["tokens"] == 6
  assert plot.plot(str(tmp_path)).endswith("curves.png")
  # killed after iteration 1 (trajectories paused mid-answer), resumed: iteration 2 is the
  # uninterrupted run's, paused trajectories, sampler state and weights included
  c.rl.iterations = 1
  rl_train.run(c, str(tmp_path / "split"))
  c.rl.iterations = 2
  again = rl_train.run(c, str(tmp_path / "split"))["history"]
  assert len(again) == 1 and again[0]["resumed_trajectories"] == 4
  for k in ("mean_reward", "k15_loss", "ptx_loss", "mean_response_tokens",
            "eval_accuracy/arithmetic", "logp_gap_tokens"):
    assert again[0][k] == pytest.approx(hist[1][k], rel=1e-5), k
  rows = [json.loads(x) for x in open(tmp_path / "split" / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2]
  assert (tmp_path / "split" / "samples.jsonl").read_text() == \
      (tmp_path / "samples.jsonl").read_text()
  # init builds the starting weights into the trainer's shardings, which the run then owns
  # (its steps donate them): two runs from the same weights are the same run
  start = out["state"].params
  c.rl.update(dict(eval_every=0, samples_every=0, kl_to_init=False))   # (shorter)
  asked = []

  def init(cfg, shardings):
    asked.append(jax.tree.leaves(shardings))
    return jax.device_put(start, shardings, may_alias=False)
  runs = [rl_train.run(c, str(tmp_path / name), init=init) for name in ("a", "b")]
  assert all(s.is_equivalent_to(x.sharding, x.ndim)
             for s, x in zip(asked[0], jax.tree.leaves(start)))
  for a, b in zip(*(jax.tree.leaves(r["state"].params) for r in runs)):
    np.testing.assert_array_equal(a, b)
  assert [h.get("k15_loss") for h in runs[0]["history"]] == [h.get("k15_loss") for h in
                                                             runs[1]["history"]]


TINY_RL_FLAGS = [
    "--config", "tiny_rl", "--config.model.hidden_size=64", "--config.model.num_hidden_layers=2",
    "--config.model.n_routed_experts=4", "--config.model.moe_intermediate_size=32",
    "--config.model.intermediate_size=96", "--config.model.q_lora_rank=32",
    "--config.model.kv_lora_rank=16", "--config.model.num_attention_heads=2",
    "--config.train.seq_len=256", "--config.rl.prompts=2", "--config.rl.samples=2",
    "--config.rl.segment_tokens=4", "--config.rl.budget=6", "--config.rl.updates_per_iteration=2",
    "--config.rl.ptx_batch_size=2", "--config.rl.iterations=6", "--config.rl.checkpoint_every=2",
    "--config.rl.eval_every=0"]


def _rl_rows(workdir):
  rows = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
  return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def test_a_bf16_sampler_differs_and_the_rollout_correction_sees_it(tmp_path):
  """rl.sampler_dtype bfloat16 (weights and activations, as a serving engine runs them)
  against the float32 trainer: the logged gap between the sampler's and the trainer's log
  pi is far above float rounding (the float32 sampler's is < 1e-4), and icepop's ratios,
  their mean and the fraction masked are logged; the run trains (finite losses)."""
  from k2jax.rl import train as rl_train
  c = rl_config(sampler_dtype="bfloat16", rollout_correction="icepop", mask_low=0.9,
                mask_high=1.1)
  rows = rl_train.run(c, str(tmp_path))["history"]
  last = rows[-1]
  assert last["logp_gap_tokens"] > 0 and last["logp_gap_max"] > 1e-3, last
  assert np.isfinite(last["k15_loss"]) and last["rollout_ratio_mean"] > 0
  assert 0 <= last["rollout_masked_frac"] <= 1 and last["rollout_truncated_frac"] == 0
  with pytest.raises(ValueError, match="rl.rollout_correction"):
    rl_train.configs_validate(rl_config(rollout_correction="clip"))


def test_rl_resumes_exactly_after_kill_9(tmp_path):
  """Killed with SIGKILL after iteration 3, once the checkpoint of iteration 2 is committed
  (groups trained with PTX batches before and after it, trajectories paused across it), the
  rerun's iterations equal the uninterrupted run's bit for bit: losses, gradient norm,
  rewards, tokens decoded."""
  import signal
  import time
  cmd = [sys.executable, "-m", "k2jax.rl", *TINY_RL_FLAGS]
  whole = subprocess.Popen(cmd + [f"--workdir={tmp_path / 'whole'}"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
  killed = tmp_path / "killed"
  p = subprocess.Popen(cmd + [f"--workdir={killed}"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
  metrics = killed / "metrics.jsonl"
  deadline = time.time() + 300
  while p.poll() is None and time.time() < deadline:
    steps = [json.loads(x)["step"] for x in (metrics.read_text().splitlines()
                                             if metrics.exists() else []) if x.endswith("}")]
    if 3 in steps and (killed / "checkpoints" / "2").is_dir():   # orbax renames on commit
      os.kill(p.pid, signal.SIGKILL)
      break
    time.sleep(0.02)
  assert p.wait() == -signal.SIGKILL, "the run ended before it could be killed"
  out = subprocess.run(cmd + [f"--workdir={killed}"], capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  resumed = [int(x.split("resumed RL at iteration ")[1].split()[0])
             for x in out.stderr.splitlines() if "resumed RL at iteration" in x]
  assert resumed and 2 <= resumed[0] < 6, out.stderr[-3000:]
  assert whole.wait(timeout=300) == 0, whole.stdout.read()[-3000:]
  a, b = _rl_rows(tmp_path / "whole"), _rl_rows(killed)
  assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
  trained = [r for r in a[resumed[0]:] if r["groups_trained"] > 0]
  assert trained and all("ptx_loss" in r for r in trained)
  assert any(r["resumed_trajectories"] > 0 for r in a[resumed[0]:])
  assert b == a


def _signal_when(cmd, marker, signum):
  """Run cmd, send signum once a stderr line holds marker; -> (returncode, stderr)."""
  p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  lines = []
  for line in p.stderr:
    lines.append(line)
    if marker in line:
      p.send_signal(signum)
      break
  rest = p.communicate(timeout=300)[1]
  return p.returncode, "".join(lines) + rest


def test_rl_sigint_and_sigterm_save_where_they_stop_and_the_rerun_resumes(tmp_path):
  """Ctrl-C once the loop has started: the iteration under way ends, its checkpoint is
  saved (checkpoint_every would not have), one line, exit 130; the rerun resumes there and
  SIGTERM does the same with 143. A signal while it sets up stops it before the first
  iteration (k2jax.rl.train.run); the loop's first line marks the point. (The budget leaves
  every trajectory unfinished, so no update is compiled: the test stays short.)"""
  import signal
  flags = [f for f in TINY_RL_FLAGS if "iterations=" not in f and "budget=" not in f]
  cmd = [sys.executable, "-m", "k2jax.rl", *flags, "--config.rl.budget=64",
         "--config.rl.iterations=4", "--config.rl.checkpoint_every=4", f"--workdir={tmp_path}"]
  for signum, resumed_at, stop_at in ((signal.SIGINT, None, 1), (signal.SIGTERM, 1, 2)):
    rc, err = _signal_when(cmd, "RL: iterations", signum)   # the loop's first line
    assert rc == 128 + signum, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    stops = [l for l in err.splitlines() if "stopped by" in l]
    assert len(stops) == 1 and f"stopped by {signal.Signals(signum).name}: checkpoint at " \
        f"iteration {stop_at} of 4; run the same command to resume" in stops[0], err[-3000:]
    assert max(int(d) for d in os.listdir(tmp_path / "checkpoints")) == stop_at
    assert [r["step"] for r in _rl_rows(tmp_path)] == list(range(1, stop_at + 1))
    assert resumed_at is None or f"resumed RL at iteration {resumed_at}" in err


def test_rl_cli_bad_input(tmp_path):
  """The table of mistakes for `python -m k2jax.rl` (its own and the trainer's flags): one
  error line each, exit 2, no traceback, nothing written to the workdir."""
  (tmp_path / "afile").write_text("")
  cases = [
      (["--config", "tiny_rl", "--init", str(tmp_path / "x")], "--init"),
      (["--config", "tiny_rl", "--config.rl.envs=chess"], "chess"),
      (["--config", "tiny_rl", "--config.rl.samples=1"], "rl.samples"),
      (["--config", "tiny"], "tiny_rl"),
      (["--config", "tiny_rl", "--config.train.stepz=3"],
       "unknown config key in --config.train.stepz=3: did you mean steps?"),
      (["--config", "tiny_rl", "--config.model.num_experts_per_tok=99"],
       "model.num_experts_per_tok = 99"),
      (["--config", "tiny_rl", "--bogus"], "Unknown command line flag 'bogus'"),
      (["--config", "tiny_rl", "--config.mesh.data=3"], "mesh"),
      (["--config", "tiny_rl", "--config.rl.temperature_end=-1"], "rl.temperature_end = -1"),
      (["--config", "tiny_rl", "--config.rl.tau=0"], "rl.tau = 0"),
      (["--config", "tiny_rl", "--config.rl.eval_every=-1"], "rl.eval_every = -1 must be >= 0"),
      (["--config", "tiny_rl", "--config.rl.ptx_weight=nan"], "rl.ptx_weight = nan"),
      (["--config", "tiny_rl", "--config.rl.ops=/"], "rl.ops: arithmetic ops '/'"),
      (["--config", "tiny_rl", "--config.rl.envs=code", "--config.rl.sandbox=chroot"],
       "rl.sandbox: sandbox isolation 'chroot'"),
  ]
  # Workdirs holding other runs: an SFT run (config.json without an rl group, a checkpoint
  # directory), and an RL run of another model shape. Neither may be touched.
  runs = {}
  sft_dir = tmp_path / "sft_run"
  (sft_dir / "checkpoints" / "8").mkdir(parents=True)
  (sft_dir / "config.json").write_text(configs.get_config("tiny_sft").to_json_best_effort())
  runs[sft_dir] = (["--config", "tiny_rl"], "holds a training run (k2jax.train / k2jax.sft), "
                   "not an RL run")
  rl_dir = tmp_path / "rl_run"
  (rl_dir / "checkpoints").mkdir(parents=True)
  other = configs.get_config("tiny_rl")
  other.model.hidden_size = 96
  (rl_dir / "config.json").write_text(other.to_json_best_effort())
  runs[rl_dir] = (["--config", "tiny_rl"], "model.hidden_size: 96 -> 128")
  # A directory of something else (no config.json): taken for a new run, it got our files
  # and then a KeyError from reading its checkpoints/8 as an RL checkpoint.
  other_dir = tmp_path / "not_a_run"
  (other_dir / "checkpoints" / "8").mkdir(parents=True)
  (other_dir / "notes.txt").write_text("mine")
  runs[other_dir] = (["--config", "tiny_rl"], "is not a k2jax run: it holds checkpoints, "
                     "notes.txt but no config.json")
  before = {d: {f: f.read_bytes() for f in d.rglob("*") if f.is_file()} for d in runs}
  dirs = [tmp_path / f"w{i}" for i in range(len(cases))] + list(runs)
  cases += list(runs.values())
  procs = [subprocess.Popen([sys.executable, "-m", "k2jax.rl", *argv, f"--workdir={d}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for d, (argv, _) in zip(dirs, cases)]
  for d, (argv, fragment), p in zip(dirs, cases, procs):
    _, err = p.communicate(timeout=300)
    lines = [l for l in err.splitlines() if l.startswith("k2jax.rl: error:")]
    assert p.returncode == 2 and len(lines) == 1 and fragment in lines[0], (argv, err[-2000:])
    assert "Traceback" not in err
    if d in runs:    # byte for byte as it was, nothing added (no lock, no log)
      assert {f: f.read_bytes() for f in d.rglob("*") if f.is_file()} == before[d], argv
    else:
      assert not (d / "config.json").exists()
  p = subprocess.run([sys.executable, "-m", "k2jax.rl", "--config", "tiny_rl",
                      f"--workdir={tmp_path / 'afile'}"], capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 2 and "is a file, not a directory" in p.stderr


def test_an_end_marker_split_across_segments_ends_the_turn(monkeypatch):
  """Partial rollouts: '<|im_en' at the end of one segment and 'd|>' in the next end the turn
  (a decoder that only looked at the new segment would run on to the budget)."""
  import k2jax.serving.generate
  from k2jax.rl.train import Rollouts
  tok = ByteTokenizer()
  script = iter(["7 + 1 = 8<|im_en", "d|>garbage after the end"])

  def fake_generate(cfg, params, prompts, *, max_new_tokens, on_token, **kw):
    text = next(script)
    outs = [[] for _ in prompts]
    for ch in tok.encode(text)[:max_new_tokens]:
      alive = [i for i in range(len(prompts)) if i not in ended]
      if not alive:
        break
      for i in alive:
        outs[i].append(int(ch))
      ended.update(on_token([int(ch) if i in alive else None for i in range(len(prompts))])
                   or set())
    return outs, [[0.0] * len(o) for o in outs]     # (ids, log probabilities)

  ended = set()
  monkeypatch.setattr(k2jax.serving.generate, "generate", fake_generate)
  c = rl_config(prompts=1, samples=2, segment_tokens=16, budget=64)
  ro = Rollouts(c, tok, [envs.Arithmetic(max_operand=9)], random.Random(0))
  ro.refill()
  ro.decode(None, None, 1.0, seed=0)
  assert not any(t.done for t in ro.groups[0])
  ended.clear()
  ro.decode(None, None, 1.0, seed=1)
  for t in ro.groups[0]:
    assert t.done and not t.truncated and t.final_text == "7 + 1 = 8" and t.generated == 19


def test_policy_judge_scores_equal_the_unpadded_forward():
  """The self-critique judge left-pads questions to a length bucket (one compile per bucket):
  the padding is masked, so each score equals log p(Yes) - log p(No) from the forward of the
  question alone."""
  from k2jax.model import forward, init
  from k2jax.rl.train import PolicyJudge
  cfg = rl_config().model
  tok = ByteTokenizer()
  judge = PolicyJudge(cfg, tok)
  judge.params = jax.tree.map(lambda a: a * 3 if a.ndim >= 3 else a, init(cfg, jax.random.key(6)))
  responses = ["4", "the answer is 4 because 2 + 2 = 4", ""]
  scores = judge("What is 2 + 2?", responses, ["states 4", "is brief"])
  yes, no = chat._encode_text("Yes", tok)[0], chat._encode_text("No", tok)[0]
  for r, s in zip(responses, scores):
    q = ("Question: What is 2 + 2?\nResponse: " + r + "\nRubrics:\n- states 4\n- is brief"
         "\nDoes the response meet every rubric? Answer Yes or No.")
    ids = chat.encode([{"role": "user", "content": q}], tokenizer=tok)
    logits = np.asarray(forward(cfg, judge.params, jnp.asarray([ids]))[0][0, -1], np.float64)
    logp = logits - np.logaddexp.reduce(logits)
    assert s == pytest.approx(logp[yes] - logp[no], abs=1e-4)


def test_the_measured_rl_setting_is_the_tiny_rl_preset():
  """README's RL claim names the tiny_rl preset: the experiment's setting that learns must be
  the preset itself (it once overrode temperature_start to 0.8), seed 0 being the preset's."""
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "experiments"))
  import rl_arithmetic
  from k2jax.training import resume
  measured = resume.flatten(rl_arithmetic.rl_config(
      rl_arithmetic.FIXED, 0, None, configs.get_config("tiny_sft").model))
  preset = resume.flatten(configs.get_config("tiny_rl"))
  diff = {k: (preset.get(k), measured.get(k)) for k in set(preset) | set(measured)
          if preset.get(k) != measured.get(k)}
  assert diff == {}

