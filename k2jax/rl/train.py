"""RL with the K1.5 loss (report 3.2.3): `python -m k2jax.rl --config tiny_rl --init RUN`.

    python -m k2jax.sft --config tiny_sft --workdir runs/sft --init runs/tiny
    python -m k2jax.rl --config tiny_rl --workdir runs/rl --init runs/sft
    python -m k2jax.rl --config tiny_rl --workdir runs/rl --init runs/sft \\
        --config.rl.envs=arithmetic,game24,code,self_critique

One iteration:
  1. hand the weights to the inference layout (jax.device_put onto rl.inference_mesh; a
     no-op copy when it equals the training mesh);
  2. roll out: keep rl.prompts groups of rl.samples trajectories in flight; every unfinished
     trajectory decodes at most rl.segment_tokens more tokens at the current temperature
     (rl.temperature_start -> rl.temperature_end over training). A trajectory that ends its
     turn with tool calls gets the environment's results and goes on (multi-turn); one that
     reaches its task's budget is truncated (reward rl.truncation_penalty); one that is
     still running is paused and resumed next iteration with the newer weights (partial
     rollouts: long answers do not hold a whole iteration back);
  3. score complete groups (all K samples done) with their environment, compute
     log pi_old(y|x) with the weights that sampled the last segment, and take
     rl.updates_per_iteration optimizer steps on k15_loss + rl.ptx_weight x the language-model
     loss on curated chat data (k2jax.sft's dialogs), MuonClip fed by this forward's max logits.
Logs (DIR/metrics.jsonl, per iteration): reward, fraction truncated, losses, the mean
|log pi_sampler - log pi_trainer| over the tokens sampled, every rl.eval_every iterations
greedy accuracy on a fixed eval set per environment, optionally the KL to the initial
policy; every rl.samples_every iterations the sampled responses (DIR/samples.jsonl).
Checkpoints hold the train state and the paused trajectories; a killed run resumes from the
last one. SIGINT / SIGTERM let the iteration under way finish, save a checkpoint and exit 130 /
143; the same command resumes from there.
"""

import dataclasses
import functools
import json
import logging
import os
import random
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from k2jax import kernels, model, optim, parallel
from k2jax.serving import chat
from k2jax import data as data_lib
from k2jax.rl import envs as envs_lib
from k2jax.rl.loss import (CORRECTIONS, LEVELS, k15_loss, rollout_weights, sequence_logprobs,
                           temperature_at)
from k2jax.training.step import (TrainState, _gate, fresh_state, init_state, lm_loss, on_device,
                        split_as_stored)

log = logging.getLogger("k2jax.rl")


@dataclasses.dataclass
class Trajectory:
  """One sample of a group: token ids so far, which of them the policy produced, and where
  it stands (active, paused mid-turn, done)."""
  group: int
  sample: int
  task: envs_lib.Task
  ids: list[int]
  policy: list[bool]
  generated: int = 0          # policy tokens so far (against the task's budget)
  turn_start: int = 0         # index in ids where the current assistant turn began
  turns: int = 0
  done: bool = False
  truncated: bool = False
  final_text: str = ""
  segments: int = 0           # iterations it has decoded in (> 1: resumed partial rollout)
  logp: list = dataclasses.field(default_factory=list)   # the sampler's log pi per policy token
  fresh: int = 0              # logp index where this iteration's segment began

  def to_json(self):
    d = dataclasses.asdict(self)
    return d

  @classmethod
  def from_json(cls, d):
    d = dict(d)
    d["task"] = envs_lib.Task(**d["task"])
    return cls(**d)


class PolicyJudge:
  """The self-critique judge (report 3.2.2) run by a model - the policy by default: a response
  scores log p("Yes") - log p("No") for a question that lists the rubrics; the environment
  turns scores into ranks within the group."""

  def __init__(self, cfg, tokenizer):
    self.cfg, self.tok, self.params = cfg, tokenizer, None
    self._fwd = jax.jit(lambda p, x, pos, seg: model.forward(
        cfg, p, x, positions=pos, segment_ids=seg)[0][:, -1].astype(jnp.float32))

  def __call__(self, question, responses, rubrics):
    yes = chat._encode_text("Yes", self.tok)[0]
    no = chat._encode_text("No", self.tok)[0]
    rows = []
    for r in responses:
      q = (f"Question: {question}\nResponse: {r}\nRubrics:\n" +
           "\n".join(f"- {x}" for x in rubrics) +
           "\nDoes the response meet every rubric? Answer Yes or No.")
      rows.append(chat.encode([{"role": "user", "content": q}], tokenizer=self.tok))
    from k2jax.serving.generate import bucket
    # left-padded to a power-of-two length (one compile per bucket, not per question) so
    # the last position is every row's next-token prediction; padding is segment 0, which
    # the question (segment 1, positions from 0) does not attend to
    T = bucket(max(len(x) for x in rows), minimum=64)
    x = np.asarray([[self.tok.pad_id] * (T - len(r)) + r for r in rows], np.int32)
    seg = np.asarray([[0] * (T - len(r)) + [1] * len(r) for r in rows], np.int32)
    pos = np.asarray([[0] * (T - len(r)) + list(range(len(r))) for r in rows], np.int32)
    logits = np.asarray(self._fwd(self.params, x, pos, seg))
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    return list(logp[:, yes] - logp[:, no])


def _pad_rows(seqs, masks, pad_id, length):
  n = len(seqs)
  tok = np.full((n, length + 1), pad_id, np.int32)
  msk = np.zeros((n, length + 1), np.float32)
  seg = np.zeros((n, length + 1), np.int32)
  for i, (s, m) in enumerate(zip(seqs, masks)):
    s, m = s[:length + 1], m[:length + 1]
    tok[i, :len(s)], msk[i, :len(s)], seg[i, :len(s)] = s, m, 1
  pos = np.broadcast_to(np.arange(length, dtype=np.int32), (n, length)).copy()
  return dict(inputs=tok[:, :-1], targets=tok[:, 1:], mask=msk[:, 1:],
              segment_ids=seg[:, :-1], positions=pos)


def rl_loss(config, params, batch, ptx):
  """-> (k15 + ptx_weight x ptx loss + aux, (k15, ptx, ForwardStats)).

  batch: inputs / targets / mask / segment_ids / positions [P*K, T], logp_old / rewards /
  sample_mask [P, K]. ptx: a chat batch (lm_loss's keys) or None.
  """
  r, mcfg = config.rl, config.model
  P, K = batch["rewards"].shape
  logits, aux = model.forward(mcfg, params, batch["inputs"], positions=batch["positions"],
                              segment_ids=batch["segment_ids"])
  # (weights: the rollout correction's per-token importance weights, `rollout_weights`)
  logp = sequence_logprobs(logits, batch["targets"], batch["mask"],
                           batch.get("weights")).reshape(P, K)
  k15 = k15_loss(logp, batch["logp_old"], batch["rewards"], r.tau, batch["sample_mask"])
  loss, stats = k15 + aux.aux_loss, aux
  ptx_loss = jnp.zeros(())
  if ptx is not None:
    ce, n, aux2 = lm_loss(mcfg, params, ptx)
    ptx_loss = ce / jnp.maximum(n, 1.0)
    loss = loss + r.ptx_weight * ptx_loss + aux2.aux_loss
    stats = model.ForwardStats(max_logits=jnp.maximum(aux.max_logits, aux2.max_logits),
                               expert_load=aux.expert_load + aux2.expert_load,
                               aux_loss=aux.aux_loss + aux2.aux_loss)
  return loss, (k15, ptx_loss, stats)


def rl_step(config, tx, state: TrainState, batch, ptx, opt_shardings=None, grad_shardings=None):
  """One optimizer step on rl_loss, gated on finiteness like the pre-training step.
  opt_shardings, grad_shardings: the optimizer state's as stored and where the gradients are
  reduced to for the update (step.train_step's: parallel.grad_shardings, ZeRO-1's slices)."""
  grads, (k15, ptx_loss, stats) = jax.grad(
      lambda p: rl_loss(config, p, batch, ptx), has_aux=True)(state.params)
  if grad_shardings is not None:   # else XLA may hold each whole where its weight is
    grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(k15) & jnp.isfinite(grad_norm)
  old_opt = on_device(config.optimizer, state.opt_state, opt_shardings)
  updates, opt_state = tx.update(grads, old_opt, state.params,
                                 max_logits=stats.max_logits, expert_load=stats.expert_load)
  params = optax.apply_updates(state.params, updates)
  opt_state = split_as_stored(config.optimizer, _gate(finite, opt_state, old_opt),
                              opt_shardings)
  if opt_shardings is not None and config.optimizer.get("host_state", False):
    # back to host memory, as the pre-training step's out_shardings send them: left free,
    # XLA returns the new states in device memory and the next step takes them from there
    opt_state = jax.device_put(opt_state, opt_shardings)
  new = TrainState(state.step + 1, _gate(finite, params, state.params), opt_state,
                   jnp.where(finite, 0, state.nan_streak + 1),
                   state.skipped + (~finite).astype(jnp.int32))
  return new, {"k15_loss": k15, "ptx_loss": ptx_loss, "grad_norm": grad_norm,
               "max_logit": jnp.max(stats.max_logits)}


def step_program(config, tx, opt_shardings=None, grad_shardings=None):
  """rl_step jitted as `run` calls it (the state donated; shardings follow the arguments'):
  the one place it is written, so a compile for another machine (k2jax.compile --program
  rl, tests/test_tpu_inference.py) is the RL loop's own update. opt_shardings,
  grad_shardings: rl_step's."""
  return jax.jit(functools.partial(rl_step, config, tx, opt_shardings=opt_shardings,
                                   grad_shardings=grad_shardings), donate_argnums=0)


def old_logprobs(config, params, batch):
  P, K = batch["rewards"].shape
  logits, _ = model.forward(config.model, params, batch["inputs"], positions=batch["positions"],
                            segment_ids=batch["segment_ids"])
  return sequence_logprobs(logits, batch["targets"], batch["mask"]).reshape(P, K)


def trainer_logprobs(config, params, batch):
  """-> (log pi(y|x) per sequence [P, K] as old_logprobs, log pi per target position [P*K, T]):
  one forward gives the K1.5 loss its pi_old and the logs their per-token view."""
  P, K = batch["rewards"].shape
  logits, _ = model.forward(config.model, params, batch["inputs"], positions=batch["positions"],
                            segment_ids=batch["segment_ids"])
  tok = -optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                         batch["targets"])
  return jnp.sum(tok * batch["mask"], axis=-1).reshape(P, K), tok


def sampler_gap(groups, trainer_tok, sampler_tok, mask):
  """|log pi_sampler - log pi_trainer| over the policy tokens sampled this iteration (the
  sampler's weights are the trainer's then; older segments of a paused trajectory were
  sampled by older weights): -> (mean, max, count). sampler_tok: `sampler_logprobs`. The
  two compute one policy in different programs (decode over the latent cache on the
  inference layout, the training forward): they should agree to float rounding (unless
  rl.sampler_dtype differs on purpose); a gap that grows means the update trains on
  probabilities the sampler did not sample with."""
  fresh = np.zeros(mask.shape, bool)
  for i, t in enumerate(x for ts in groups for x in ts):
    fresh[i, np.flatnonzero(mask[i] > 0)[t.fresh:]] = True
  fresh &= np.isfinite(sampler_tok)
  gaps = np.abs(trainer_tok[fresh] - sampler_tok[fresh])
  return (float(gaps.mean()) if gaps.size else float("nan"),
          float(gaps.max()) if gaps.size else float("nan"), int(gaps.size))


def kl_k3(logp, logp_ref, mask):
  """KL(pi || pi_ref) estimated over sampled tokens, k3 = e^r - 1 - r with r = log pi_ref -
  log pi (unbiased and >= 0 for samples of pi; ours are drawn at the rollout temperature, so
  it is an estimate of the same order, not exact)."""
  r = np.clip(logp_ref - logp, -20.0, 20.0)
  k3 = np.expm1(r) - r
  return float(np.sum(k3 * mask) / max(float(np.sum(mask)), 1.0))


def eval_sets(config, environments) -> list:
  """(environment, fixed tasks) per environment for greedy evaluation: arithmetic's held-out
  problems (never drawn for training), the others' tasks of a fixed seed. self_critique has
  none: its reward ranks a group's responses, and a group of one has no ranks."""
  r, out = config.rl, []
  for env in environments:
    if env.name == "self_critique":
      continue
    if isinstance(env, envs_lib.Arithmetic):
      env = envs_lib.Arithmetic(max_operand=env.max_operand, budget=env.budget,
                                use_tools=bool(env.tools), split="heldout", ops=env.ops)
      tasks = env.all_tasks()
      tasks = random.Random(0).sample(tasks, min(int(r.eval_tasks), len(tasks)))
    else:
      tasks = env.tasks(random.Random(0), int(r.eval_tasks))
    out.append((env, tasks))
  return out


def evaluate(config, tokenizer, sets, cfg, params, penalty: float) -> dict:
  """Greedy decoding of each fixed eval set, whole (multi-turn included): -> {eval_reward/ENV,
  eval_accuracy/ENV (reward 1: solved), eval_truncated/ENV}."""
  row = {}
  for env, tasks in sets:
    ro = Rollouts(config, tokenizer, [env], random.Random(0))
    for i, task in enumerate(tasks):
      ids = chat.encode(task.messages, env.tools, tokenizer=tokenizer)
      ro.groups[i] = [Trajectory(i, 0, task, list(ids), [False] * len(ids), turn_start=len(ids))]
    while any(not t.done for ts in ro.groups.values() for t in ts):
      ro.decode(cfg, params, 0.0, seed=0)
    groups = list(ro.groups.values())
    rewards = score(groups, [env], penalty)[:, 0]
    row[f"eval_reward/{env.name}"] = float(rewards.mean())
    row[f"eval_accuracy/{env.name}"] = float(np.mean(rewards >= 1.0))
    row[f"eval_truncated/{env.name}"] = float(np.mean([ts[0].truncated for ts in groups]))
  return row


class Samples:
  """DIR/samples.jsonl: the sampled responses of an iteration, one line each (iteration,
  env, group, sample, prompt, response, reward, tokens, truncated, turns). A resumed run
  first drops the lines of iterations after its checkpoint, as MetricsWriter does."""

  def __init__(self, workdir: str, start: int):
    self.path = os.path.join(workdir, "samples.jsonl")
    if os.path.exists(self.path):
      with open(self.path) as f:
        keep = [x for x in f if x.endswith("\n") and json.loads(x)["iteration"] <= start]
      with open(self.path, "w") as f:
        f.writelines(keep)

  def write(self, iteration: int, groups, rewards) -> None:
    with open(self.path, "a") as f:
      for ts, rs in zip(groups, rewards):
        for t, reward in zip(ts, rs):
          f.write(json.dumps({
              "iteration": iteration, "env": t.task.env, "group": t.group, "sample": t.sample,
              "prompt": t.task.messages[-1]["content"], "response": t.final_text,
              "reward": float(reward), "tokens": t.generated, "truncated": t.truncated,
              "turns": t.turns}, ensure_ascii=False) + "\n")


class Rollouts:
  """Trajectories in flight, grouped by prompt; decoding segments with generate()."""

  END = "<|im_end|>"

  def __init__(self, config, tokenizer, environments, rng: random.Random):
    self.r, self.tok, self.envs, self.rng = config.rl, tokenizer, environments, rng
    self.groups: dict[int, list[Trajectory]] = {}
    self.next_group = 0
    self.stop = set(chat.stop_ids(tokenizer))
    self.resumed = 0

  def refill(self):
    """Start new groups until rl.prompts are in flight (paused ones count)."""
    while len(self.groups) < self.r.prompts:
      env = self.envs[self.next_group % len(self.envs)]
      task = env.tasks(self.rng, 1)[0]
      ids = chat.encode(task.messages, env.tools, tokenizer=self.tok)
      g = self.next_group
      self.groups[g] = [Trajectory(g, k, task, list(ids), [False] * len(ids),
                                   turn_start=len(ids)) for k in range(self.r.samples)]
      self.next_group += 1

  def _env(self, traj):
    return next(e for e in self.envs if e.name == traj.task.env)

  def decode(self, cfg, params, temperature: float, seed: int):
    """One segment for every unfinished trajectory; returns the number of tokens decoded."""
    from k2jax.serving.generate import generate
    for t in (t for g in self.groups.values() for t in g if t.done):
      t.fresh = len(t.logp)      # sampled in an earlier iteration, maybe by older weights
    active = [t for g in self.groups.values() for t in g if not t.done]
    self.resumed = sum(t.segments > 0 for t in active)   # paused earlier, going on now
    if not active:
      return 0
    room = [min(self.r.segment_tokens, t.task.budget - t.generated) for t in active]
    made = [0] * len(active)
    # the end marker may straddle two segments: start from the turn's last tokens
    tails = [t.ids[max(t.turn_start, len(t.ids) - 16):] for t in active]

    def on_token(step_tokens):
      end = set()
      for i, tkn in enumerate(step_tokens):
        if tkn is None:
          continue
        made[i] += 1
        tails[i] = (tails[i] + [tkn])[-16:]
        if made[i] >= room[i] or self.tok.decode(tails[i]).endswith(self.END):
          end.add(i)
      return end

    out, logps = generate(cfg, params, [t.ids for t in active], max_new_tokens=max(room),
                          temperature=temperature, seed=seed, stop_ids=sorted(self.stop),
                          on_token=on_token, return_logprobs=True)
    for t, new, lp, cap in zip(active, out, logps, room):
      new = new[:cap]
      t.fresh = len(t.logp)
      t.logp += lp[:cap]
      t.ids += new
      t.policy += [True] * len(new)
      t.generated += len(new)
      t.segments += 1
      text = self.tok.decode(t.ids[t.turn_start:], **_specials(self.tok))
      if text.endswith(self.END) or (new and new[-1] in self.stop):
        self._end_turn(t, text[:-len(self.END)] if text.endswith(self.END) else text)
      elif t.generated >= t.task.budget:
        t.done, t.truncated, t.final_text = True, True, text
    return sum(len(x) for x in out)

  def _end_turn(self, t, text):
    env = self._env(t)
    content, calls = text, []
    if env.tools:
      try:
        content, calls = chat.parse_tool_calls(text)
      except chat.ToolCallParseError:
        calls = []
    if calls and t.turns + 1 < self.r.max_turns:
      results = []
      for c in calls:
        try:
          out = env.call_tool(c["name"], c["arguments"])
        except Exception as e:  # the policy's call was wrong: it sees the error, as it would live
          out = f"error: {e}"
        results.append({"tool_call_id": c["id"], "name": c["name"], "content": out})
      more = chat.encode_tool_results(results, tokenizer=self.tok)
      t.ids += more
      t.policy += [False] * len(more)
      t.turns += 1
      t.turn_start = len(t.ids)
    else:
      t.done, t.final_text = True, content

  def complete_groups(self):
    """Pop and return the groups whose samples are all done."""
    done = [g for g, ts in self.groups.items() if all(t.done for t in ts)]
    return [self.groups.pop(g) for g in done]

  def state(self):
    return {"groups": {str(g): [t.to_json() for t in ts] for g, ts in self.groups.items()},
            "next_group": self.next_group, "rng": _rng_json(self.rng)}

  def load(self, s):
    self.groups = {int(g): [Trajectory.from_json(t) for t in ts]
                   for g, ts in s["groups"].items()}
    self.next_group = s["next_group"]
    self.rng.setstate(_rng_unjson(s["rng"]))


def _specials(tok):
  return {"specials": True} if getattr(tok, "special_ids", None) else {}


def _rng_json(rng):
  v, state, g = rng.getstate()
  return [v, list(state), g]


def _rng_unjson(x):
  return (x[0], tuple(x[1]), x[2])


def decode_seed(seed: int, iteration: int) -> int:
  """The sampling seed of an iteration's rollouts: a pure function of (train.seed, iteration),
  so a resumed run samples what the uninterrupted one did, while runs of different seeds
  sample differently (seeded by the iteration alone, every seed drew the same samples).
  The first word keeps it apart from the PTX generator's [seed + 1, iteration]."""
  return int(np.random.SeedSequence([0x726F6C6C, int(seed), int(iteration)])
             .generate_state(1)[0])


def make_environments(config, judge):
  out = []
  for name in [x.strip() for x in str(config.rl.envs).split(",") if x.strip()]:
    if name == "arithmetic":   # the train part: evaluation keeps the held-out one unseen
      out.append(envs_lib.Arithmetic(use_tools=bool(config.rl.tools),
                                     max_operand=int(config.rl.max_operand),
                                     budget=int(config.rl.budget), split="train",
                                     ops=str(config.rl.get("ops", envs_lib.OPS))))
    elif name == "self_critique":
      out.append(envs_lib.SelfCritique(judge=judge, budget=int(config.rl.budget)))
    elif name == "code":
      out.append(envs_lib.Code(isolation=str(config.rl.get("sandbox", "namespaces"))))
    else:
      out.append(envs_lib.make(name))
  return out


def score(groups, environments, penalty: float):
  """-> rewards [P, K] (truncated samples get `penalty`)."""
  rewards = []
  for ts in groups:
    env = next(e for e in environments if e.name == ts[0].task.env)
    r = env.score_group(ts[0].task, [t.final_text for t in ts])
    rewards.append([penalty if t.truncated else x for t, x in zip(ts, r)])
  return np.asarray(rewards, np.float32)


def batch_of(groups, rewards, prompts: int, pad_id: int):
  """Padded arrays for rl_loss: [prompts x samples, T] with T a power of two (few compiles);
  groups beyond the complete ones are masked out."""
  from k2jax.serving.generate import bucket
  K = len(groups[0])
  seqs = [t.ids for ts in groups for t in ts]
  masks = [t.policy for ts in groups for t in ts]
  T = bucket(max(len(s) for s in seqs) - 1, minimum=64)
  n_pad = (prompts - len(groups)) * K
  b = _pad_rows(seqs + [[pad_id]] * n_pad, masks + [[False]] * n_pad, pad_id, T)
  R = np.zeros((prompts, K), np.float32)
  R[:len(groups)] = rewards
  sm = np.zeros((prompts, K), bool)
  sm[:len(groups)] = True
  b.update(rewards=R, sample_mask=sm, logp_old=np.zeros((prompts, K), np.float32),
           weights=np.ones_like(b["mask"]))
  return b


def sampler_config(config):
  """The model config the sampler decodes with: the trainer's, or with rl.sampler_dtype
  (e.g. bfloat16) its weights and activations in that precision, as a serving engine runs
  them while the trainer keeps float32: a sampler that differs on purpose, whose mismatch
  the logs (logp_gap_*) and the rollout correction see."""
  dtype = config.rl.get("sampler_dtype", "")
  if not dtype:
    return config.model
  m = config.model.copy_and_resolve_references()
  m.dtype = m.param_dtype = dtype
  return m


def sampler_weights(config, sampler_model, inf_shardings):
  """fn(the trainer's params) -> the sampler's: in the sampler's precision
  (`sampler_config`), cast on the trainer's layout by one compiled program before the
  reshard to `inf_shardings`, so the bytes moved are the sampler's."""
  if sampler_model is config.model:
    return lambda params: jax.device_put(params, inf_shardings)
  dt = jnp.dtype(sampler_model.param_dtype)
  cast = jax.jit(lambda params: jax.tree.map(
      lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) else a, params))
  return lambda params: jax.device_put(cast(params), inf_shardings)


def sampler_logprobs(groups, mask):
  """The sampler's log-probabilities of the policy tokens, laid out as batch_of's rows
  [rows, T] (NaN where it has none: prompt and padding, and the tokens of a trajectory
  written before it kept them)."""
  out = np.full(mask.shape, np.nan, np.float32)
  for i, t in enumerate(x for ts in groups for x in ts):
    at = np.flatnonzero(mask[i] > 0)
    if len(at) == len(t.logp):
      out[i, at] = t.logp
  return out


def run(config, workdir: str, init=None, ptx_dialogs=None) -> dict:
  """Run (or resume) RL in workdir. init: fn(model config, shardings) -> params of the
  starting policy, built into the trainer's `shardings`; the run owns them (its steps donate
  them). None: a random init, for tests. ptx_dialogs: the chat dialogs of the PTX loss
  (default: data.files, else k2jax.sft's default dialogs): the data the policy was
  fine-tuned on, since PTX on anything else pulls the policy away from the behaviour RL
  starts from.

  SIGINT / SIGTERM as in the pre-training trainer: the iteration under way finishes (its
  rollouts and updates are the uninterrupted run's), a checkpoint is saved and the run ends
  with SystemExit(128 + signal); the same command resumes from there."""
  from k2jax.training.train import _StopFlag
  stop = _StopFlag()
  old_handlers = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    return _run(config, workdir, init, ptx_dialogs, stop)
  finally:
    for s, h in old_handlers.items():
      signal.signal(s, h)


def _run(config, workdir, init, ptx_dialogs, stop) -> dict:
  from k2jax.training.metrics import MetricsWriter
  from k2jax.training import resume
  r, t = config.rl, config.train
  changes = resume.check(workdir, config)   # before any write: ValueError leaves it untouched
  if changes:
    log.info("resuming with changed settings: %s", "; ".join(changes))
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  tok = data_lib.get_tokenizer(config.data.tokenizer)
  train_mesh = parallel.make_mesh(config.mesh)
  inf_mesh = parallel.make_mesh(r.inference_mesh)
  kernels.prepare(config.model.attention_impl, config.model.moe_impl)   # before any trace
  tx = optim.optimizer(config)
  specs = model.param_specs(config.model)
  abstract = jax.eval_shape(functools.partial(init_state, config, tx), jax.random.key(t.seed))
  shardings = parallel.state_shardings(specs, train_mesh, abstract, tx,
                                       host_state=config.optimizer.host_state)
  inf_shardings = parallel.param_shardings(specs, inf_mesh)
  sampler_model = sampler_config(config)
  to_sampler = sampler_weights(config, sampler_model, inf_shardings)

  manager = ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, "checkpoints")),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, cleanup_tmp_directories=True),
      item_handlers={"state": ocp.StandardCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()})
  judge = PolicyJudge(config.model, tok)
  environments = make_environments(config, judge)
  rollouts = Rollouts(config, tok, environments, random.Random(int(t.seed)))
  state, start, init_policy = _initial_state(config, manager, rollouts, init, tx, abstract,
                                               shardings, train_mesh)
  ptx_rows = _ptx_rows(config, tok, ptx_dialogs)
  step_fn = step_program(config, tx, shardings.opt_state,
                         parallel.grad_shardings(specs, train_mesh, abstract.params))
  logp_fn = jax.jit(functools.partial(trainer_logprobs, config))
  writer = MetricsWriter(workdir, start)
  samples = Samples(workdir, start)
  sets = eval_sets(config, environments) if r.get("eval_every", 0) else []
  history = []
  from k2jax.training.train import files_line
  # a signal while setting up stops before the first iteration, one after this line after it
  stopped, saved = stop.agreed(True), start
  if stopped is None and start >= r.iterations:
    log.info("RL: all %d iterations are done (raise rl.iterations to go on); %s",
             r.iterations, files_line(workdir))
  elif stopped is None:
    log.info("RL: iterations %d..%d of %d prompts x %d samples on %s; %s", start + 1,
             r.iterations, r.prompts, r.samples, r.envs, files_line(workdir))
  try:
    for it in range(start, r.iterations if stopped is None else start):
      t0 = time.perf_counter()
      row, groups = _sample(config, tok, it, to_sampler(state.params), judge, sets,
                            sampler_model, rollouts, inf_mesh)
      if groups:
        rewards = score(groups, environments, r.truncation_penalty)
        with jax.set_mesh(train_mesh):
          state, losses, gaps = _update(config, state, groups, rewards, tok.pad_id, step_fn,
                                        logp_fn, ptx_rows, init_policy, it)
        row.update(**losses, **_rollout_stats(groups, rewards, environments), **gaps)
        if r.get("samples_every", 0) and (it + 1) % r.samples_every == 0:
          samples.write(it + 1, groups, rewards)
      row["seconds"] = time.perf_counter() - t0
      writer.write(it + 1, row)
      history.append(row)
      log.info("iteration %d: %s", it + 1, ", ".join(
          f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
      stopped = stop.agreed(True)
      if (it + 1) % r.checkpoint_every == 0 or it + 1 == r.iterations or stopped is not None:
        saved = _save(manager, it + 1, state, rollouts)
      if stopped is not None:
        break
  finally:
    manager.wait_until_finished()
    manager.close()
    writer.close()
  _finish(config, workdir, history, stopped, saved)
  return {"history": history, "state": state}


def _save(manager, iteration: int, state, rollouts) -> int:
  """A checkpoint of the state and the rollouts in flight after `iteration`; -> iteration."""
  manager.save(iteration, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      meta=ocp.args.JsonSave({"iteration": iteration, "rollouts": rollouts.state()})),
      force=True)
  return iteration


def _finish(config, workdir, history, stopped, saved) -> None:
  """The run's last line: where a signal stopped it (then SystemExit(128 + signal)), or the
  reward's first and last iteration."""
  from k2jax.training.train import files_line
  r = config.rl
  if stopped is not None:
    log.warning("stopped by %s: %s; run the same command to resume",
                signal.Signals(stopped).name, f"checkpoint at iteration {saved} of "
                f"{r.iterations}" if saved else "before the first iteration, nothing to save")
    raise SystemExit(128 + stopped)
  rewards = [h["mean_reward"] for h in history if "mean_reward" in h]
  log.info("done: iteration %d/%d, mean reward %s; %s", r.iterations, r.iterations,
           f"{rewards[0]:.3f} (first) -> {rewards[-1]:.3f} (last)" if rewards else "n/a",
           files_line(workdir))


def _sample(config, tok, it: int, inf_params, judge, sets, sampler_model, rollouts, inf_mesh):
  """One iteration's sampling on the inference layout (`inf_params`: the policy resharded
  there): the greedy evaluation every rl.eval_every iterations (of the weights the iteration
  starts from), then the rollouts' next segments at this iteration's temperature.
  -> (the metrics row so far, the groups complete this iteration)."""
  r = config.rl
  temperature = temperature_at(it, r.iterations, r.temperature_start, r.temperature_end)
  judge.params = inf_params
  row = {}
  if sets and it % r.eval_every == 0:
    with jax.set_mesh(inf_mesh):
      row.update(evaluate(config, tok, sets, sampler_model, inf_params, r.truncation_penalty))
  rollouts.refill()
  with jax.set_mesh(inf_mesh):
    decoded = rollouts.decode(sampler_model, inf_params, temperature,
                              seed=decode_seed(config.train.seed, it))
  groups = rollouts.complete_groups()
  row.update({"temperature": temperature, "decoded_tokens": decoded,
              "groups_trained": len(groups), "in_flight": len(rollouts.groups),
              "resumed_trajectories": rollouts.resumed})
  return row, groups


def _initial_state(config, manager, rollouts, init, tx, abstract, shardings, train_mesh):
  """(state, first iteration, the initial policy for rl.kl_to_init or None): restored from
  the newest checkpoint (rollouts in flight included), else --init's weights loaded shard by
  shard into the trainer's shardings, else the seed's initialization."""
  r, t = config.rl, config.train
  latest = manager.latest_step()
  init_policy = None
  with jax.set_mesh(train_mesh):
    if latest is not None:
      target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
      restored = manager.restore(latest, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
      rollouts.load(restored.meta["rollouts"])
      start = restored.meta["iteration"]
      log.info("resumed RL at iteration %d (%d groups in flight)", start, len(rollouts.groups))
      state = TrainState(*restored.state)
    elif init is not None:
      params = init(config.model, shardings.params)
      if r.get("kl_to_init", False):   # kept apart: the step donates the state
        init_policy = jax.jit(lambda p: jax.tree.map(jnp.copy, p),
                              out_shardings=shardings.params)(params)
      state = jax.jit(functools.partial(fresh_state, tx), out_shardings=shardings,
                      donate_argnums=0)(params)
      start = 0
    else:
      state = jax.jit(functools.partial(init_state, config, tx),
                      out_shardings=shardings)(jax.random.key(t.seed))
      start = 0
    if r.get("kl_to_init", False) and init_policy is None:   # the policy RL started from:
      init_policy = (init(config.model, shardings.params) if init else   # --init's, or the
                     jax.jit(lambda k: init_state(config, tx, k).params,  # seed's init
                             out_shardings=shardings.params)(jax.random.key(t.seed)))
  return state, start, init_policy


def _ptx_rows(config, tok, ptx_dialogs):
  """The PTX loss's chat rows (rl.ptx_weight > 0): the given dialogs, data.files' or SFT's
  built-in set."""
  from k2jax import sft
  if config.rl.ptx_weight <= 0:
    return None
  dialogs = ptx_dialogs or (sft.read_dialogs(config.data.files) if config.data.files else
                            sft.default_dialogs(n=512, seed=1))
  return sft.ChatRows([chat.encode_with_mask(d["messages"], d.get("tools"), tokenizer=tok)
                       for d in dialogs], config.train.seq_len, tok.pad_id)


def _update(config, state, groups, rewards, pad_id, step_fn, logp_fn, ptx_rows, init_policy,
            it: int):
  """One iteration's rl.updates_per_iteration steps on its complete groups, under the
  training mesh: the trainer's log-probabilities of the samples before the first step
  (pi_old), their gap to the sampler's and the rollout correction's weights, the KL to the
  initial policy, PTX rows. -> (state, the last step's losses, the sampler / trainer gap and
  correction statistics)."""
  r, t = config.rl, config.train
  batch = batch_of(groups, rewards, r.prompts, pad_id)
  batch["logp_old"], trainer_tok = logp_fn(state.params, batch)
  trainer_tok = np.asarray(trainer_tok)
  sampler_tok = sampler_logprobs(groups, batch["mask"])
  gap, gap_max, gap_n = sampler_gap(groups, trainer_tok, sampler_tok, batch["mask"])
  batch["weights"], correction = rollout_weights(
      trainer_tok, sampler_tok, batch["mask"], mode=r.get("rollout_correction", "none"),
      level=r.get("correction_level", "token"), cap=r.get("tis_cap", 2.0),
      low=r.get("mask_low", 0.5), high=r.get("mask_high", 2.0))
  gaps = {"logp_gap_sampler_trainer": gap, "logp_gap_max": gap_max, "logp_gap_tokens": gap_n,
          **{f"rollout_{k}": v for k, v in correction.items()}}
  if init_policy is not None:
    gaps["kl_to_init"] = kl_k3(trainer_tok, np.asarray(logp_fn(init_policy, batch)[1]),
                               batch["mask"])
  # PTX rows drawn from a generator keyed by the iteration, not one carried across
  # iterations: a resumed run draws what the uninterrupted one drew
  ptx_rng = np.random.default_rng([int(t.seed) + 1, it])
  for _ in range(r.updates_per_iteration):
    ptx = None
    if ptx_rows is not None:
      idx = ptx_rng.integers(0, len(ptx_rows), size=r.ptx_batch_size)
      rows = [ptx_rows[i] for i in idx]
      ptx = {k: np.stack([x[k] for x in rows]) for k in rows[0]}
    state, m = step_fn(state, batch, ptx)
  return state, {k: float(v) for k, v in jax.device_get(m).items()}, gaps


def _rollout_stats(groups, rewards, environments) -> dict:
  """Reward (overall and per environment), truncation and response length of the groups."""
  trunc = [x.truncated for ts in groups for x in ts]
  lengths = [x.generated for ts in groups for x in ts]
  return dict(mean_reward=float(rewards.mean()), truncated_frac=float(np.mean(trunc)),
              mean_response_tokens=float(np.mean(lengths)),
              **{f"reward/{e.name}": float(np.mean([rewards[i].mean()
                                                    for i, ts in enumerate(groups)
                                                    if ts[0].task.env == e.name]))
                 for e in environments if any(ts[0].task.env == e.name for ts in groups)})


def main(argv=None):
  from k2jax import sft
  from k2jax.training import interrupt, train
  argv = list(sys.argv if argv is None else argv)
  init, argv = sft.pop_init(argv)
  try:
    with interrupt.raising():   # until run() sets its own handlers: loading, checks
      _main(argv, init)
  except train.UserError as e:
    print(f"k2jax.rl: error: {e}", file=sys.stderr)
    raise SystemExit(2)
  except interrupt.Interrupted as e:   # before run() took the signals over: nothing written
    print(f"k2jax.rl: stopped by {e.name} while starting; nothing was trained",
          file=sys.stderr)
    raise SystemExit(e.exit_code)


def _main(argv, init):
  """Parse, check, run; a mistake raises train.UserError."""
  from k2jax import sft
  from k2jax.training import resume, train
  config, workdir = train.parse(argv, "k2jax.rl", " [--init RUN | HF_DIR]", "tiny_rl",
                                more_help=sft.INIT_HELP)
  train.init_distributed()     # several processes (--coordinator_address ...): before JAX
  if "rl" not in config:
    raise train.UserError("config has no rl group: start from the tiny_rl preset "
                          "(--config tiny_rl)")
  params = None
  if init is not None:   # its config now, its weights once the trainer's shardings exist
    source = sft.load_init(init)
    try:
      config.model = sft.model_from_init(source.model, config, argv)
      sft.tokenizer_from_init(source, config, argv)
    except ValueError as e:
      raise train.UserError(str(e)) from None
    params = functools.partial(sft.load_params, init, source)
  try:   # everything is checked before any file is written
    configs_validate(config)
    parallel.make_mesh(config.mesh)
    parallel.make_mesh(config.rl.inference_mesh)
    workdir = train._writable_workdir(workdir)
    resume.check(workdir, config)    # another kind of run, or a change that cannot resume
  except ValueError as e:
    raise train.UserError(str(e)) from None
  with train.hold(workdir):   # before the first write: one run per workdir
    train._setup_logging(workdir)
    train.enable_compilation_cache()
    run(config, workdir, params)


def configs_validate(config):
  from k2jax import configs
  configs.validate(config)
  optim.validate(config)
  r = config.rl
  for k in ("prompts", "samples", "iterations", "segment_tokens", "budget", "max_turns",
            "updates_per_iteration", "checkpoint_every"):
    if int(r[k]) < 1:
      raise ValueError(f"rl.{k} = {r[k]} must be >= 1")
  names = [x.strip() for x in str(r.envs).split(",") if x.strip()]
  if not names:
    raise ValueError("rl.envs is empty: name one or more of " + ", ".join(envs_lib.ENVIRONMENTS))
  for n in names:
    if n not in envs_lib.ENVIRONMENTS:
      raise ValueError(f"rl.envs: unknown environment {n!r}; choose from "
                       + ", ".join(envs_lib.ENVIRONMENTS))
  for k in ("eval_every", "eval_tasks", "samples_every"):
    if int(r.get(k, 0)) < 0:
      raise ValueError(f"rl.{k} = {r[k]} must be >= 0 (0 turns it off)")
  if int(r.get("eval_every", 0)) > 0 and int(r.get("eval_tasks", 0)) < 1:
    raise ValueError(f"rl.eval_tasks = {r.eval_tasks} must be >= 1 while rl.eval_every > 0")
  if r.samples < 2:
    raise ValueError(f"rl.samples = {r.samples}: the K1.5 baseline needs >= 2 samples per prompt")
  # (key, lowest value, why): each must be finite and above (or, for >=, at least) its bound
  for k, low, why in (
      ("temperature_start", "> 0", ": greedy samples of a prompt are all alike, which leaves no "
       "reward differences to learn from"),
      ("temperature_end", "> 0", ": greedy samples of a prompt are all alike, which leaves no "
       "reward differences to learn from"),
      ("tau", "> 0", ": the K1.5 loss reaches the policy only through tau log(pi / pi_old)"),
      ("ptx_weight", ">= 0", " (0 turns the PTX loss off)")):
    v = float(r[k])
    if not np.isfinite(v) or not (v > 0 if low == "> 0" else v >= 0):
      raise ValueError(f"rl.{k} = {r[k]} must be {low}{why}")
  if r.get("rollout_correction", "none") not in CORRECTIONS:
    raise ValueError(f"rl.rollout_correction = {r.rollout_correction!r}: choose one of "
                     f"{', '.join(CORRECTIONS)}")
  if r.get("correction_level", "token") not in LEVELS:
    raise ValueError(f"rl.correction_level = {r.correction_level!r}: choose one of "
                     f"{', '.join(LEVELS)}")
  if not float(r.get("tis_cap", 2.0)) > 0:
    raise ValueError(f"rl.tis_cap = {r.tis_cap} must be > 0")
  if not 0 < float(r.get("mask_low", 0.5)) <= 1 <= float(r.get("mask_high", 2.0)):
    raise ValueError(f"rl.mask_low = {r.mask_low}, rl.mask_high = {r.mask_high}: need "
                     "0 < mask_low <= 1 <= mask_high (a band around equal probabilities)")
  if r.get("sampler_dtype", "") not in ("", "float32", "bfloat16", "float16"):
    raise ValueError(f"rl.sampler_dtype = {r.sampler_dtype!r}: choose float32, bfloat16, "
                     "float16, or empty for the trainer's")
  if float(r.ptx_weight) > 0 and int(r.ptx_batch_size) < 1:
    raise ValueError(f"rl.ptx_batch_size = {r.ptx_batch_size} must be >= 1 while "
                     "rl.ptx_weight > 0")
  if not np.isfinite(float(r.truncation_penalty)):
    raise ValueError(f"rl.truncation_penalty = {r.truncation_penalty} must be a finite reward")
  if int(r.max_operand) < 1:
    raise ValueError(f"rl.max_operand = {r.max_operand} must be >= 1")
  try:
    envs_lib.check_ops(str(r.get("ops", envs_lib.OPS)))
  except ValueError as e:
    raise ValueError(f"rl.ops: {e}") from None
  if "code" in names:    # before training: the code environment cannot score without it
    from k2jax.rl import sandbox
    try:
      sandbox.check(str(r.get("sandbox", "namespaces")))
    except sandbox.SandboxUnavailable as e:
      raise ValueError(f"rl.envs=code: {e}") from None
    except ValueError as e:
      raise ValueError(f"rl.sandbox: {e}") from None
