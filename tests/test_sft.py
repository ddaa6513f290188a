"""SFT: the loss sees the assistant's tokens and nothing else; dialogs pack without attending
across each other; the CLI trains (loss falls), fine-tunes from a run, and refuses bad input."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from k2jax import configs, model, sft
from k2jax.serving import chat
from k2jax.data import ByteTokenizer
from k2jax.training.step import lm_loss


def small_model():
  c = configs.get_config("tiny_sft")
  c.model.update(dict(hidden_size=64, num_hidden_layers=2, n_routed_experts=4,
                      moe_intermediate_size=32, intermediate_size=96, q_lora_rank=32,
                      kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                      num_attention_heads=2))
  return c


def rows(n_dialogs=12, seq_len=1024):
  tok = ByteTokenizer()
  dialogs = sft.default_dialogs(n=n_dialogs, seed=3)
  enc = [chat.encode_with_mask(d["messages"], d.get("tools"), tokenizer=tok) for d in dialogs]
  return dialogs, sft.ChatRows(enc, seq_len, tok.pad_id), tok


def assistant_text(d):
  out = ""
  for m in d["messages"]:
    if m["role"] == "assistant":
      body = [b for h, b, a in chat.render_chunks([m], add_generation_prompt=False) if a]
      out += body[0]
  return out


def test_loss_mask_is_exactly_the_assistant_tokens_and_dialogs_do_not_mix():
  dialogs, r, tok = rows()
  assert sum(len(x) for x in r.rows) == len(dialogs)
  got = []
  for i in range(len(r)):
    b = r[i]
    seg = b["segment_ids"]
    for s in range(1, seg.max() + 1):
      sel = (seg == s) & (b["loss_mask"] > 0)
      got.append(tok.decode(b["targets"][sel]))
      pos = b["positions"][seg == s]
      assert (pos == np.arange(len(pos))).all()        # positions restart per dialog
    # a target that starts the next dialog is never trained (no cross-dialog prediction)
    boundary = np.nonzero(np.diff(seg) != 0)[0]
    assert not b["loss_mask"][boundary].any()
  want = [assistant_text(d) for d in dialogs]
  assert got == want
  assert any("<|tool_call_begin|>" in w for w in want) and all(w.endswith("<|im_end|>")
                                                               for w in want)


def test_flipping_non_assistant_labels_leaves_the_gradient_unchanged():
  c = small_model()
  _, r, _ = rows(8, 256)
  b = {k: np.stack([r[i][k] for i in range(min(4, len(r)))]) for k in r[0]}
  params = model.init(c.model, jax.random.key(0))
  grad = jax.jit(jax.grad(lambda p, b: (lambda s, n, _: s / n)(*lm_loss(c.model, p, b))))
  g = grad(params, b)
  V = c.model.vocab_size
  flipped = dict(b, targets=np.where(b["loss_mask"] > 0, b["targets"], (b["targets"] + 7) % V))
  assert (flipped["targets"] != b["targets"]).sum() > 100
  g2 = grad(params, flipped)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), g, g2)
  # the check can fail: flipping one assistant label changes the gradient
  t = b["targets"].copy()
  i, j = np.argwhere(b["loss_mask"] > 0)[0]
  t[i, j] = (t[i, j] + 7) % V
  g3 = grad(params, dict(b, targets=t))
  assert not all(np.array_equal(np.asarray(x), np.asarray(y))
                 for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g3)))


def run_sft(*args):
  return subprocess.run([sys.executable, "-m", "k2jax.sft", *args], capture_output=True,
                        text=True, timeout=600)


SMALL = ["--config.model.hidden_size=64", "--config.model.num_hidden_layers=2",
         "--config.model.n_routed_experts=4", "--config.model.q_lora_rank=32",
         "--config.train.seq_len=256", "--config.train.batch_size=8",
         "--config.train.log_every=5", "--config.train.eval_every=40",
         "--config.train.checkpoint_every=40", "--config.optimizer.warmup_steps=5",
         "--config.optimizer.decay_steps=10"]


def test_sft_cli_trains_then_fine_tunes_from_the_run(tmp_path):
  r = run_sft("--config", "tiny_sft", "--workdir", str(tmp_path / "a"),
              "--config.train.steps=40", *SMALL)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl")]
  losses = [x["loss"] for x in rows if "loss" in x]
  assert losses[-1] < 0.6 * losses[0], losses
  # second stage: --init from the first run's newest checkpoint (its model config comes along)
  r = run_sft("--config", "tiny_sft", "--workdir", str(tmp_path / "b"), "--init",
              str(tmp_path / "a"), "--config.train.steps=5", *SMALL[4:])
  assert r.returncode == 0, r.stderr[-3000:]
  first = [json.loads(x) for x in open(tmp_path / "b" / "metrics.jsonl")][0]
  assert first["loss"] < losses[0]          # starts from the trained weights, not from scratch
  r = run_sft("--config", "tiny_sft", "--workdir", str(tmp_path / "c"), "--init",
              str(tmp_path / "nope"))
  assert r.returncode == 2 and "--init" in r.stderr and "Traceback" not in r.stderr
  no_ckpt = tmp_path / "no_ckpt"
  no_ckpt.mkdir()
  (no_ckpt / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
  ok = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
  files = {"not_json": ok + "\nnot json\n",
           "no_assistant": '{"messages": [{"role": "user", "content": "hi"}]}\n',
           "tools_dict": '{"tools": {"name": "x"}, "messages": [{"role": "assistant", '
                         '"content": "a"}]}\n',
           "bad_role": '{"messages": [{"role": "robot", "content": "a"}]}\n'}
  for name, text in files.items():
    (tmp_path / f"{name}.jsonl").write_text(text)
  # The table of user mistakes: (argv after the preset, the fragment of the one error line).
  cases = [
      (["--init", str(no_ckpt)], "has no checkpoint yet"),
      (["--init", str(tmp_path / "a"), "--config.model.hidden_size=128"],
       "--config.model.hidden_size=128: the --init weights have model.hidden_size = 64"),
      ([f"--config.data.files={tmp_path / 'not_json.jsonl'}"], "not_json.jsonl:2 is not valid JSON"),
      ([f"--config.data.files={tmp_path / 'no_assistant.jsonl'}"],
       "no_assistant.jsonl:1 has no assistant turn"),
      ([f"--config.data.files={tmp_path / 'tools_dict.jsonl'}"],
       'tools_dict.jsonl:1 has "tools" of type dict: it must be a list'),
      ([f"--config.data.files={tmp_path / 'bad_role.jsonl'}"],
       "bad_role.jsonl:1 message 0 has role 'robot'"),
  ]
  procs = [(i, frag, subprocess.Popen(
      [sys.executable, "-m", "k2jax.sft", "--config", "tiny_sft", "--workdir",
       str(tmp_path / f"bad{i}"), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)) for i, (argv, frag) in enumerate(cases)]
  for i, frag, p in procs:
    _, err = p.communicate(timeout=600)
    lines = [l for l in err.splitlines() if l.startswith("k2jax.sft: error:")]
    assert p.returncode == 2 and len(lines) == 1 and frag in lines[0], (cases[i], err[-2000:])
    assert "Traceback" not in err and not (tmp_path / f"bad{i}" / "config.json").exists()


def test_init_keeps_its_model_and_takes_only_computation_overrides():
  from k2jax import configs, sft
  init = configs.get_config("tiny").model
  config = configs.get_config("tiny_sft")
  config.model.remat = "full"
  config.model.hidden_size = 4 * init.hidden_size
  m = sft.model_from_init(init, config, ["--config.model.remat=full", "--config.train.steps=3"])
  assert m.remat == "full" and m.hidden_size == init.hidden_size   # not overridden: init's
  with pytest.raises(ValueError, match="the --init weights have model.hidden_size"):
    sft.model_from_init(init, config, [f"--config.model.hidden_size={config.model.hidden_size}"])


def test_read_dialogs_names_file_and_line_of_what_only_rendering_finds(tmp_path):
  """A list as content (OpenAI's content parts) said 'content must be a string' with no file
  or line, from deep in the data build; every other mistake gave path:line."""
  from k2jax import sft
  ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
  parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                        {"role": "assistant", "content": "yo"}]}
  path = tmp_path / "chats.jsonl"
  path.write_text(json.dumps(ok) + "\n" + json.dumps(parts) + "\n")
  with pytest.raises(ValueError) as e:
    sft.read_dialogs(str(path))
  assert str(e.value) == (f"data.files: {path}:2: message 0: content must be a string, got "
                          "list (join its text parts into one string)")
