"""Decoding over the MLA latent cache: teacher forcing equals the full forward, the absorbed
attention equals the expanded one, greedy generation equals transformers' token for token,
sampling options behave, the CLI samples from a trained run, and constrained decoding makes
a random model emit valid tool calls."""

import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import configs, model
from k2jax.serving import chat, generate
from k2jax.configs import base
from k2jax.model import attention, decode, rope


def tiny(**kw):
  cfg = configs.get_config("tiny").model
  cfg.update(kw)
  return cfg


CONFIGS = {
    "plain": tiny(),
    "no_q_lora": tiny(q_lora_rank=None),
    "yarn": tiny(rope_scaling=base.yarn(4.0, 16, beta_fast=32.0, beta_slow=1.0)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_teacher_forced_decoding_equals_the_full_forward(name):
  cfg = CONFIGS[name]
  params = model.init(cfg, jax.random.key(0))
  params = jax.tree.map(lambda a: a * 3 if a.ndim >= 3 else a, params)   # livelier logits
  B, T = 3, 14
  toks = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
  lengths = jnp.asarray([5, 9, 2])                                        # a ragged batch
  full = np.asarray(model.forward(cfg, params, toks)[0])
  cache = decode.init_cache(cfg, B, 32)
  logits, cache = jax.jit(lambda p, t, l, c: decode.prefill(cfg, p, t, l, c))(params, toks,
                                                                            lengths, cache)
  step = jax.jit(lambda p, c, t: decode.decode_step(cfg, p, c, t))
  errs = [np.abs(np.asarray(logits[b]) - full[b, lengths[b] - 1]).max() for b in range(B)]
  for _ in range(4):
    nxt = toks[jnp.arange(B), cache.lengths]
    logits, cache = step(params, cache, nxt)
    errs += [np.abs(np.asarray(logits[b]) - full[b, int(cache.lengths[b]) - 1]).max()
             for b in range(B)]
  # several tokens at once (a server continuing a prompt whose start its cache holds), a
  # ragged number per row: the logits at each row's last new token
  counts = jnp.asarray([3, 1, 4])
  more = jnp.take_along_axis(toks, jnp.minimum(cache.lengths[:, None] + jnp.arange(4), T - 1),
                             axis=1)
  logits, cache = jax.jit(lambda p, c, t, n: decode.extend(cfg, p, c, t, n))(params, cache,
                                                                             more, counts)
  errs += [np.abs(np.asarray(logits[b]) - full[b, int(cache.lengths[b]) - 1]).max()
           for b in range(B)]
  assert cache.lengths.tolist() == [12, 14, 10]
  assert max(errs) < 1e-4, max(errs)


def test_returned_logprobs_are_the_full_forwards():
  """generate(return_logprobs=True): each sampled token's log pi at temperature 1 (the first
  from the prefill, the others from chunks of on-device steps, as RL decodes), as the full
  forward gives it (RL compares the sampler's with the trainer's)."""
  cfg = CONFIGS["plain"]
  params = model.init(cfg, jax.random.key(0))
  prompts = [[1, 5, 9], [2, 7]]
  out, lps = generate.generate(cfg, params, prompts, max_new_tokens=20, temperature=1.0,
                               seed=3, return_logprobs=True)
  for p, o, lp in zip(prompts, out, lps):
    assert len(lp) == len(o) == 20
    seq = jnp.asarray([p + o[:-1]])
    full = jax.nn.log_softmax(model.forward(cfg, params, seq)[0][0, len(p) - 1:], axis=-1)
    want = np.asarray(full)[np.arange(len(o)), o]
    np.testing.assert_allclose(lp, want, atol=1e-4)


def test_absorbed_attention_equals_expanded_attention():
  """mla_absorbed over a cache of latents == softmax(q k^T) v with k, v expanded by kv_b."""
  cfg = CONFIGS["yarn"]
  p = jax.tree.map(lambda a: a[0], model.init(cfg, jax.random.key(2))["moe_layers"]["attn"])
  B, S = 2, 11
  x = jax.random.normal(jax.random.key(3), (B, S, cfg.hidden_size))
  pos = jnp.broadcast_to(jnp.arange(S), (B, S))
  cos, sin = rope.cos_sin(cfg, pos)
  lat = attention.latents(cfg, p, x, cos, sin)
  valid = jnp.broadcast_to(jnp.tril(jnp.ones((S, S), bool)), (B, S, S))
  got = attention.mla_absorbed(cfg, p, x, pos, lat, valid)
  want, _ = attention.mla(cfg, p, x, pos)
  np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("case", ["k2_yarn", "groups_no_yarn", "q_proj_unnormalized", "all_dense"])
def test_greedy_generation_equals_transformers(case, tmp_path):
  from tests import hf_reference as ref
  from tests.test_hf_parity import CASES
  from k2jax.interop import hf
  a, yarn, theta, _ = CASES[case]
  cj = ref.hf_config_dict(a, yarn, theta)
  tmodel = ref.make_model(cj, seed=7)
  ref.write_dir(tmp_path, cj, ref.published_tensors(tmodel))
  cfg, params = hf.load_checkpoint(str(tmp_path))
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(2, a["vocab_size"], n)) for n in (3, 7, 5)]
  ours = generate.generate(cfg, params, prompts, max_new_tokens=8)
  tmodel.generation_config.eos_token_id = None
  tmodel.generation_config.pad_token_id = 0
  for prompt, got in zip(prompts, ours):
    with ref.torch.no_grad():
      out = tmodel.generate(ref.torch.as_tensor([prompt]), max_new_tokens=8, do_sample=False,
                            attention_mask=ref.torch.ones(1, len(prompt), dtype=ref.torch.long))
    assert got == out[0, len(prompt):].tolist()


def test_sampling_options():
  cfg = CONFIGS["plain"]
  params = model.init(cfg, jax.random.key(0))
  prompts = [[257, 100, 101], [257, 50]]
  greedy = generate.generate(cfg, params, prompts, max_new_tokens=6)
  assert generate.generate(cfg, params, prompts, max_new_tokens=6, temperature=1.0, top_k=1,
                           seed=3) == greedy
  assert generate.generate(cfg, params, prompts, max_new_tokens=6, temperature=1.0,
                           top_p=1e-6, seed=4) == greedy
  a = generate.generate(cfg, params, prompts, max_new_tokens=6, temperature=1.5, seed=5)
  assert a == generate.generate(cfg, params, prompts, max_new_tokens=6, temperature=1.5, seed=5)
  assert a != greedy                       # at this temperature a uniform-ish model wanders
  stop = greedy[0][2]                      # row 0 stops at its third token, row 1 runs on
  out = generate.generate(cfg, params, prompts, max_new_tokens=6, stop_ids=[stop])
  assert out[0] == greedy[0][:greedy[0].index(stop) + 1]
  assert len(out[1]) == 6 or stop in out[1]


def test_top_p_keeps_the_smallest_set_reaching_p():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  draws = {int(generate.sample(logits, jax.random.key(i), temperature=1.0, top_k=None,
                               top_p=0.7)[0]) for i in range(200)}
  assert draws == {0, 1}                   # 0.5 + 0.3 reaches 0.7: the rest never drawn


def test_per_row_sampling_settings_draw_what_each_row_would_alone():
  """sample_rows (a server's batch of rows with different settings) gives each row the
  token `sample` draws for that row alone with its key and settings, over many keys; and
  the greedy rows take the argmax of the allowed tokens."""
  V, settings = 300, [(0.0, None, None), (1.0, None, None), (0.7, 5, None), (1.3, None, 0.5),
                      (0.9, 20, 0.8), (1.0, 1, None), (2.0, 7, 0.3)]
  B = len(settings)
  logits = 3 * jax.random.normal(jax.random.key(1), (B, V))
  allowed = jax.random.bernoulli(jax.random.key(2), 0.7, (B, V))
  T = jnp.asarray([s[0] for s in settings])
  K = jnp.asarray([s[1] or 0 for s in settings])
  P = jnp.asarray([s[2] or 1.0 for s in settings])
  draw = jax.jit(lambda lg, k, m: generate.sample_rows(lg, k, temperature=T, top_k=K, top_p=P,
                                                       allowed=m))
  seen = set()
  for trial in range(25):
    keys = jax.vmap(lambda s: jax.random.key(s))(jnp.arange(B, dtype=jnp.uint32) + 100 * trial)
    mask = allowed if trial % 2 else None
    got = np.asarray(draw(logits, keys, mask))
    for b, (t, k, p) in enumerate(settings):
      want = generate.sample(logits[b:b + 1], keys[b:b + 1], temperature=t, top_k=k, top_p=p,
                             allowed=None if mask is None else mask[b:b + 1])
      assert got[b] == int(want[0]), (trial, b)
      seen.add((b, int(got[b])))
  assert len(seen) > 2 * B        # sampled rows did draw different tokens across keys


def test_constrained_decoding_gives_valid_calls_from_a_random_model():
  from tests.test_chat import TOOLS, _valid
  from k2jax.data import ByteTokenizer
  cfg = CONFIGS["plain"]
  params = model.init(cfg, jax.random.key(9))
  tok = ByteTokenizer()
  prompt = chat.encode([{"role": "user", "content": "add 2 and 3"}], tools=TOOLS, tokenizer=tok)
  constraint = chat.ToolCallConstraint(tok, TOOLS, max_calls=1)
  out = generate.generate(cfg, params, [prompt], max_new_tokens=300, temperature=1.0, seed=1,
                          stop_ids=[tok.eos_id], logits_processor=constraint)
  text = tok.decode(out[0])
  _, calls = chat.parse_tool_calls(text)
  schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
  assert len(calls) == 1 and _valid(calls[0]["arguments"], schemas[calls[0]["name"]]), text


def test_a_section_opened_under_auto_is_held_to_the_schemas():
  """tool_choice auto (chat.ToolSectionConstraint): nothing is masked before the model opens
  a tool-call section; from its marker on, a random model's call validates. The marker is
  forced here (a random model would not write it); without the constraint the rest is noise."""
  from tests.test_chat import TOOLS, _valid
  from k2jax.data import ByteTokenizer
  cfg = CONFIGS["plain"]
  params = model.init(cfg, jax.random.key(9))
  tok = ByteTokenizer()
  prompt = chat.encode([{"role": "user", "content": "add 2 and 3"}], tools=TOOLS, tokenizer=tok)
  opening = list(b"Sure. <|tool_calls_section_begin|>")
  schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
  for seed in range(3):
    auto = chat.ToolSectionConstraint(tok, TOOLS, max_calls=1)
    assert auto(0, opening[:7]) is None                      # free text so far

    def forced(b, ids):
      if len(ids) < len(opening):
        mask = np.zeros(cfg.vocab_size, bool)
        mask[opening[len(ids)]] = True
        return mask
      return auto(b, ids)
    out = generate.generate(cfg, params, [prompt], max_new_tokens=300, temperature=1.0,
                            seed=seed, stop_ids=[tok.eos_id], logits_processor=forced)
    text = tok.decode(out[0])
    content, calls = chat.parse_tool_calls(text)
    assert content.strip() == "Sure." and len(calls) == 1, text
    assert _valid(calls[0]["arguments"], schemas[calls[0]["name"]]), text


def test_cli_samples_from_a_trained_run(tmp_path):
  from tests.test_train import small_config
  from k2jax.training import train
  train.train(small_config(steps=4, checkpoint_every=4, eval_every=4), str(tmp_path))
  p = subprocess.run([sys.executable, "-m", "k2jax.generate", "--workdir", str(tmp_path),
                      "--prompt", "def ", "--max_new_tokens", "12", "--seed", "1"],
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.startswith("def ") and "tokens/s" in p.stderr
  for args, fragment in [(["--workdir", str(tmp_path / "nope")], "no such directory"),
                         (["--workdir", str(tmp_path), "--max_new_tokens", "0"], "must be >= 1")]:
    p = subprocess.run([sys.executable, "-m", "k2jax.generate", *args, "--prompt", "x"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and fragment in p.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  from tests.test_train import small_config
  from k2jax.training import train
  d = tmp_path_factory.mktemp("run")
  train.train(small_config(steps=2, checkpoint_every=2, eval_every=2), str(d))
  return d


# The table of user mistakes: (id, argv after `python -m k2jax.generate` with {run} for a
# trained run and {tmp} for an empty directory, the fragment its one error line contains).
BAD_INPUTS = [
    ("top_k-negative", ["--workdir={run}", "--top_k", "-1"], "--top_k -1: must be between 1"),
    ("top_k-over-vocab", ["--workdir={run}", "--top_k", "100000"],
     "--top_k 100000: must be between 1 and the vocabulary size (264)"),
    ("top_p-zero", ["--workdir={run}", "--top_p", "0"], "--top_p 0.0: must be in (0, 1]"),
    ("top_p-over-one", ["--workdir={run}", "--top_p", "1.5"], "--top_p 1.5: must be in (0, 1]"),
    ("temperature-nan", ["--workdir={run}", "--temperature", "nan"],
     "--temperature nan: must be a finite number >= 0"),
    ("temperature-negative", ["--workdir={run}", "--temperature", "-1"],
     "--temperature -1.0: must be a finite number >= 0"),
    ("max-new-tokens", ["--workdir={run}", "--max_new_tokens", "0"], "must be >= 1"),
    ("empty-stop", ["--workdir={run}", "--stop", ""], "--stop '': an empty stop string"),
    ("prompt-over-context", ["--workdir={run}", "--prompt", "x" * 1030],
     "--prompt of 1031 tokens + --max_new_tokens 200 exceeds the model's context of 1024"),
    ("mesh-over-devices", ["--workdir={run}", "--mesh", "context=64"],
     "--mesh context=64: needs 64 devices"),
    ("mesh-pipeline", ["--workdir={run}", "--mesh", "pipeline=2"],
     "--mesh pipeline=2: sampling has no pipeline"),
    ("mesh-unknown-axis", ["--workdir={run}", "--mesh", "ctx=2"],
     "--mesh 'ctx=2': expected pipeline=P,expert=E,data=D,context=C"),
    ("no-such-dir", ["--workdir={tmp}/nope"], "no such directory"),
    ("empty-config", ["--workdir={tmp}/empty_config"], "/config.json is not a readable run config"),
    ("hf-as-workdir", ["--workdir={tmp}/hf"], "holds a Hugging Face checkpoint (safetensors), "
                                               "not a k2jax.train run: pass it as --hf"),
    ("no-checkpoint", ["--workdir={tmp}/no_ckpt"], "has no checkpoint yet"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_cli_bad_inputs_end_in_one_line_and_exit_2(case, run_dir, tmp_path, capsys):
  from k2jax.serving import generate as gen
  _, argv, fragment = case
  (tmp_path / "empty_config").mkdir()
  (tmp_path / "empty_config" / "config.json").write_text("")
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "config.json").write_text("{}")
  (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
  (tmp_path / "no_ckpt").mkdir()
  (tmp_path / "no_ckpt" / "config.json").write_text((run_dir / "config.json").read_text())
  argv = [a.format(run=run_dir, tmp=tmp_path) for a in argv]
  if "--prompt" not in argv:
    argv += ["--prompt", "x"]
  with pytest.raises(SystemExit) as e:
    gen.main(argv)
  err = capsys.readouterr().err
  assert e.value.code == 2, err
  (line,) = [l for l in err.splitlines() if l.startswith("k2jax.generate: error:")]
  assert fragment in line, line
  assert "Traceback" not in err


def test_visible_streamed_text_stops_short_of_stop_strings():
  from k2jax.serving.generate import visible
  assert visible("hello wor", ["world"]) == "hello "      # 'wor' may become 'world'
  assert visible("hello world and more", ["world", "and"]) == "hello "
  assert visible("hello w", ["xyz"]) == "hello w"
  assert visible("abc", []) == "abc"


def test_cli_streaming_never_prints_the_stop_string(run_dir, capsys):
  """One prompt streams; the stop string (and what follows) was printed before the row
  ended, while a batch trimmed it."""
  from k2jax.serving import generate as gen
  argv = ["--workdir", str(run_dir), "--prompt", "def ", "--max_new_tokens", "24",
          "--temperature", "0"]
  gen.main(argv)
  text = capsys.readouterr().out[len("def "):]
  stop = text[6:9]
  assert len(stop) == 3
  gen.main(argv + ["--stop", stop])
  assert capsys.readouterr().out == "def " + text[:text.index(stop)]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cli_stops_on_a_signal_in_one_line(signum, run_dir):
  """Ctrl-C / SIGTERM while a prompt streams: one line saying how far it got, exit 130 / 143,
  no traceback (SIGINT was a KeyboardInterrupt traceback from inside the decode loop)."""
  p = subprocess.Popen([sys.executable, "-m", "k2jax.generate", "--workdir", str(run_dir),
                        "--prompt", "def ", "--max_new_tokens", "1000", "--temperature", "1"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  p.stdout.read(len("def ") + 2)    # the prompt and the first generated characters
  p.send_signal(signum)
  _, err = p.communicate(timeout=120)
  assert p.returncode == 128 + signum, err[-2000:]
  assert "Traceback" not in err
  assert re.fullmatch(rf"k2jax.generate: stopped by {signal.Signals(signum).name} after "
                      r"\d+ tokens", err.strip().splitlines()[-1]), err[-2000:]


def test_generate_refuses_settings_that_cannot_sample():
  cfg = configs.get_config("tiny").model
  for kw in (dict(temperature=float("nan")), dict(top_k=0), dict(top_p=0.0)):
    with pytest.raises(ValueError, match="must be"):
      generate.generate(cfg, None, [[1, 2]], max_new_tokens=2, **kw)


def test_the_batch_is_bucketed_and_padding_rows_never_surface():
  """RL decodes a different number of unfinished trajectories every iteration: 5, 6 and 7
  rows share one compiled program (bucket 8), greedy rows equal each row decoded alone, and
  callbacks never see the padding rows."""
  cfg = CONFIGS["plain"]
  params = jax.tree.map(lambda a: a * 3 if a.ndim >= 3 else a,
                        model.init(cfg, jax.random.key(4)))
  rng = np.random.default_rng(5)
  prompts = [list(rng.integers(1, cfg.vocab_size, size=int(rng.integers(2, 9))))
             for _ in range(7)]
  prefill, step, steps = generate._programs(cfg)
  seen = []
  out = generate.generate(cfg, params, prompts[:5], max_new_tokens=6,
                          on_token=lambda toks: seen.append(len(toks)))
  assert len(out) == 5 and set(seen) == {5}
  compiled = (prefill._cache_size(), steps._cache_size())
  for n in (6, 7):
    generate.generate(cfg, params, prompts[:n], max_new_tokens=6)
  assert (prefill._cache_size(), steps._cache_size()) == compiled
  alone = [generate.generate(cfg, params, [p], max_new_tokens=6)[0] for p in prompts[:5]]
  assert out == alone


def test_per_row_seeds_make_a_row_independent_of_its_batch():
  """generate(seed=[...]): a row's sampled tokens depend on its own seed only."""
  cfg = CONFIGS["plain"]
  params = model.init(cfg, jax.random.key(3))
  prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
  kw = dict(max_new_tokens=9, temperature=1.0, top_p=0.9)
  batched = generate.generate(cfg, params, prompts, seed=[11, 12, 13, 14], **kw)
  for b, p in enumerate(prompts):
    assert generate.generate(cfg, params, [p], seed=[11 + b], **kw)[0] == batched[b]
  assert generate.generate(cfg, params, prompts[:2], seed=[11, 99], **kw)[0] == batched[0]
  assert generate.generate(cfg, params, prompts[:2], seed=[12, 12], **kw)[0] != batched[0]
  with pytest.raises(ValueError, match="3 seeds for 4 prompts"):
    generate.generate(cfg, params, prompts, seed=[1, 2, 3], **kw)
