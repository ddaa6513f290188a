"""Supervised fine-tuning on chat data (report 3.1): `python -m k2jax.sft --config ... --init ...`.

    python -m k2jax.sft --config tiny_sft --workdir runs/sft --init runs/tiny
    python -m k2jax.sft --config tiny_sft --workdir runs/sft --init runs/tiny \\
        --config.data.files='chats/*.jsonl'

Each JSONL line is a dialog: {"messages": [...], "tools": [...]} in the OpenAI-style shape
k2jax.serving.chat renders (system / user / assistant with optional tool_calls / tool results). The
loss covers the tokens the assistant produced (its text, tool calls and closing <|im_end|>)
and nothing the user, system or tools wrote. Dialogs are packed into rows without attending
across dialogs (segment ids). Without data.files an embedded, deterministically generated
set is used: arithmetic and unit-conversion dialogs, half of them calling a calculator tool.
Everything else is the pre-training trainer's: MuonClip by default (the report fine-tunes with
Muon), resume, metrics, checkpoints. --init starts from a k2jax run's newest checkpoint or a
Hugging Face directory; the model config comes from there.

May import: k2jax.configs, k2jax.data, k2jax.kernels, k2jax.model, k2jax.optim,
k2jax.parallel, k2jax.interop, k2jax.training, k2jax.serving.
"""

import json
import logging
import os
import random
import sys

import numpy as np

from k2jax import data as data_lib
from k2jax.serving import chat
# CALCULATOR: re-exported here too (sft.CALCULATOR), where SFT data uses it
from k2jax.data.arithmetic import CALCULATOR, SPLITS, check_ops, draw_problem

log = logging.getLogger("k2jax.sft")

UNITS = {("km", "m"): 1000, ("m", "cm"): 100, ("kg", "g"): 1000, ("h", "min"): 60,
         ("min", "s"): 60, ("l", "ml"): 1000}


def default_dialogs(n: int = 4000, seed: int = 0, max_operand: int = 99,
                    tool_fraction: float = 0.5, split: str = "train", ops: str = "+-*",
                    conversions: float = 0.3, dropped_carry: float = 0.0) -> list[dict]:
  """Deterministic arithmetic (operands 0..max_operand, operators `ops`) and unit-conversion
  dialogs (a `conversions` fraction); a tool_fraction of them call the calculator. Arithmetic
  problems come from `split` of k2jax.data.arithmetic.arithmetic_split ('train' keeps the held-out
  problems out of training). dropped_carry: the probability that an addition whose ones
  digits carry is answered without that carry (a + b - 10, no calculator call): a teacher's
  systematic slip, which SFT imitates and RL against a verifier can undo
  (experiments/rl_arithmetic.py, task add2_carry)."""
  if split not in SPLITS:
    raise ValueError(f"arithmetic split {split!r}: choose one of {', '.join(SPLITS)}")
  check_ops(ops)
  if not 0.0 <= dropped_carry <= 1.0:
    raise ValueError(f"dropped_carry = {dropped_carry}: a probability in [0, 1]")
  rng = random.Random(seed)
  out = []
  for i in range(n):
    if rng.random() < 1 - conversions:
      expr = draw_problem(rng, max_operand, ops, split)
      value = eval(expr)  # noqa: S307 - our own two-integer expression
      question = f"What is {expr}?"
      a, op, b = expr.split()
      # drawn only when it can apply, so dropped_carry=0 keeps every other draw as it was
      slipped = (dropped_carry > 0 and op == "+" and int(a) % 10 + int(b) % 10 >= 10
                 and rng.random() < dropped_carry)
      answer = f"{expr} = {value - 10 if slipped else value}"
    else:
      slipped = False
      (src, dst), k = rng.choice(sorted(UNITS.items()))
      q = rng.randint(1, 50)
      expr = f"{q} * {k}"
      value = q * k
      question = f"How many {dst} is {q} {src}?"
      answer = f"{q} {src} = {value} {dst}"
    if slipped or rng.random() >= tool_fraction:   # a slip is the teacher's own, no tool
      out.append({"messages": [{"role": "user", "content": question},
                               {"role": "assistant", "content": answer}]})
    else:
      cid = "functions.calculator:0"
      out.append({"tools": CALCULATOR, "messages": [
          {"role": "user", "content": question},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": cid, "function": {"name": "calculator",
                                       "arguments": {"expression": expr}}}]},
          {"role": "tool", "tool_call_id": cid, "name": "calculator", "content": str(value)},
          {"role": "assistant", "content": answer}]})
  return out


ROLES = ("system", "user", "assistant", "tool")


def dialog_problem(d) -> str | None:
  """What makes `d` unusable as an SFT dialog (said as the rest of a sentence), or None."""
  if not isinstance(d, dict) or not isinstance(d.get("messages"), list):
    return 'has no "messages" list'
  if "tools" in d and d["tools"] is not None and not isinstance(d["tools"], list):
    return f'has "tools" of type {type(d["tools"]).__name__}: it must be a list of tool specs'
  for i, m in enumerate(d["messages"]):
    if not isinstance(m, dict) or m.get("role") not in ROLES:
      role = m.get("role") if isinstance(m, dict) else m
      return f"message {i} has role {role!r}: each message needs a role of {', '.join(ROLES)}"
  if not any(m["role"] == "assistant" for m in d["messages"]):
    return "has no assistant turn: SFT trains on what the assistant says"
  return None


def read_dialogs(files: str) -> list[dict]:
  """Dialogs from JSONL files (a glob); one line names the file and line it cannot read."""
  paths = data_lib.corpus.match_files(files)
  out = []
  for path in paths:
    with open(path) as f:
      for lineno, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          d = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"data.files: {path}:{lineno} is not valid JSON ({e.msg})") from None
        problem = dialog_problem(d)
        if problem:
          raise ValueError(f"data.files: {path}:{lineno} {problem}")
        try:    # what only rendering finds (a list as content, a tool result without its id)
          chat.render_chunks(d["messages"], d.get("tools"))
        except chat.ChatFormatError as e:
          raise ValueError(f"data.files: {path}:{lineno}: {e}") from None
        out.append(d)
  if not out:
    raise ValueError(f"data.files = {files!r}: no dialogs in the matched files")
  return out


class ChatRows:
  """Dialogs packed into rows of seq_len tokens: inputs, targets, segment_ids (one per dialog,
  0 = padding), positions (from each dialog's start) and loss_mask (targets the assistant
  produced). A dialog longer than a row is cut to it."""

  def __init__(self, encoded: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int):
    self.seq_len, self.pad_id = seq_len, pad_id
    self.rows: list[list[tuple[list[int], list[bool]]]] = []
    row, used = [], 0
    for ids, mask in encoded:
      ids, mask = ids[:seq_len + 1], mask[:seq_len + 1]
      if used + len(ids) > seq_len + 1 and row:
        self.rows.append(row)
        row, used = [], 0
      row.append((ids, mask))
      used += len(ids)
    if row:
      self.rows.append(row)

  def __len__(self):
    return len(self.rows)

  def __getitem__(self, i):
    L = self.seq_len
    tok = np.full(L + 1, self.pad_id, np.int32)
    seg = np.zeros(L + 1, np.int32)
    pos = np.zeros(L + 1, np.int32)
    msk = np.zeros(L + 1, bool)
    at = 0
    for s, (ids, mask) in enumerate(self.rows[int(i)], 1):
      n = len(ids)
      tok[at:at + n], seg[at:at + n], pos[at:at + n], msk[at:at + n] = ids, s, np.arange(n), mask
      at += n
    same = seg[1:] == seg[:-1]
    return dict(inputs=tok[:-1], targets=tok[1:], segment_ids=seg[:-1], positions=pos[:-1],
                loss_mask=(msk[1:] & same & (seg[1:] > 0)).astype(np.float32))


def build_data(config, process_index: int = 0, process_count: int = 1,
               dialogs: list[dict] | None = None) -> data_lib.Data:
  """The chat Data (train / eval split by dialog) for train.train(build_data=...): the given
  dialogs, else data.files, else default_dialogs()."""
  d, t = config.data, config.train
  tok = data_lib.get_tokenizer(d.tokenizer)
  if dialogs is None:
    dialogs = read_dialogs(d.files) if d.files else default_dialogs()
  encoded = [chat.encode_with_mask(x["messages"], x.get("tools"), tokenizer=tok) for x in dialogs]
  order = np.random.default_rng(int(t.seed)).permutation(len(encoded))
  n_eval = max(1, int(len(encoded) * d.eval_fraction)) if d.eval_fraction else 0
  rows = lambda idx: ChatRows([encoded[i] for i in idx], t.seq_len, tok.pad_id)
  train_rows, eval_rows = rows(order[n_eval:]), rows(order[:n_eval])
  if not any(m for row in train_rows.rows for _, mask in row for m in mask[:t.seq_len + 1]):
    raise ValueError(f"data: no assistant token fits in rows of train.seq_len = {t.seq_len} "
                     f"(dialogs have {int(np.median([len(i) for i, _ in encoded]))} tokens at "
                     "the median): raise --config.train.seq_len (the tiny_sft preset uses 512)")
  if len(train_rows) < t.batch_size:
    raise ValueError(f"data: {len(dialogs)} dialogs pack into {len(train_rows)} rows of "
                     f"train.seq_len = {t.seq_len}, fewer than one batch of train.batch_size = "
                     f"{t.batch_size}: add dialogs or lower train.batch_size")
  cut = sum(len(i) > t.seq_len + 1 for i, _ in encoded)
  if cut:
    log.warning("sft data: %d of %d dialogs are longer than train.seq_len + 1 = %d tokens and "
                "are cut (their end is not trained); raise --config.train.seq_len", cut,
                len(encoded), t.seq_len + 1)
  assistant = sum(sum(m) for _, m in encoded)
  log.info("sft data: %d dialogs, %d tokens, %d trained (assistant); %d train / %d eval rows",
           len(dialogs), sum(len(i) for i, _ in encoded), assistant, len(train_rows),
           len(eval_rows))
  return data_lib.Data(tokenizer=tok, train_rows=train_rows, eval_rows=eval_rows,
                       batch_size=t.batch_size // process_count, seed=int(t.seed) % 2**32,
                       process_index=process_index, process_count=process_count)


INIT_HELP = (
    "--init: the weights to start from: a k2jax run directory (its params only) or a Hugging "
    "Face directory (config.json + safetensors, bf16 / FP8 / INT4 as published), read "
    "straight into the config's mesh (k2jax.training.weights). The model's shape is --init's: pair it "
    "with the preset whose mesh and optimizer fit it (kimi_k2 for Kimi-K2-Instruct, "
    "deepseek_v3 for DeepSeek-V3); --config.model.* may change only how it computes and "
    "param_dtype. The tokenizer is --init's (a run's, or the directory's tiktoken.model, "
    "else the byte tokenizer) unless --config.data.tokenizer names one.",)


def init_from(path: str):
  """The weights of a k2jax run directory or a Hugging Face directory (k2jax.training.weights.Source):
  their config, read before anything else; their params, loaded into the trainer's
  shardings when it asks."""
  from k2jax.training import weights
  return weights.open_source(path)


def pop_init(argv: list[str]) -> tuple[str | None, list[str]]:
  """Take --init PATH (or --init=PATH) out of argv: -> (path or None, the other arguments)."""
  argv = list(argv)
  for i, a in enumerate(argv):
    if a == "--init":
      return (argv[i + 1] if i + 1 < len(argv) else ""), argv[:i] + argv[i + 2:]
    if a.startswith("--init="):
      return a[len("--init="):], argv[:i] + argv[i + 1:]
  return None, argv


def load_init(init: str):
  """init_from with the user's mistakes as one-line UserErrors."""
  from k2jax.training import train
  if not init or not os.path.exists(init):
    raise train.UserError(f"--init {init!r}: no such run or checkpoint directory")
  try:
    source = init_from(init)
    source.check()      # before any file of the run is written
    return source
  except (OSError, ValueError) as e:
    raise train.UserError(f"--init {init}: {str(e).splitlines()[0]}") from None


def load_params(init: str, source, cfg, shardings, layout=None):
  """source.load with a checkpoint's flaws (a missing or misshapen tensor, a truncated
  file) as one-line UserErrors naming --init."""
  from k2jax.training import train
  try:
    return source.load(cfg, shardings, layout)
  except (OSError, ValueError) as e:
    raise train.UserError(f"--init {init}: {str(e).splitlines()[0]}") from None


# what --init's weights may be stored as besides their own dtype: they are cast on load
_INIT_DTYPE = "param_dtype"


def tokenizer_from_init(source, config, argv) -> None:
  """--init's tokenizer (a run's, or a Hugging Face directory's tiktoken.model) for the
  data, unless the command line names one: weights read the ids they were trained on."""
  if not any(a.startswith("--config.data.tokenizer") for a in argv):
    config.data.tokenizer = source.tokenizer()


def model_from_init(init_model, config, argv, flag: str = "--init"):
  """The model config to fine-tune: --init's, with the command line's --config.model.*
  overrides that only change how it computes (remat, dtype, kernels: the keys a resumed run
  may change, k2jax.training.resume) or the dtype the weights are stored in (param_dtype: they are
  cast as they load) applied. An override that would change the weights' shapes or meaning
  is refused (ValueError naming it), never dropped."""
  from k2jax.training import resume
  model = init_model.copy_and_resolve_references()
  for arg in argv:
    if not arg.startswith("--config.model."):
      continue
    key = arg[len("--config.model."):].split("=")[0].split(".")[0]
    new = config.model[key]
    old = model.get(key)
    if resume.flatten({"v": new}) == resume.flatten({"v": old}):
      continue
    if key != _INIT_DTYPE and not resume.can_resume(f"model.{key}", old, new):
      raise ValueError(f"{arg}: the {flag} weights have model.{key} = {old!r}; the model's "
                       f"shape comes from {flag}, so drop this override (only computation "
                       "settings such as model.remat or model.dtype may change)")
    model[key] = new
  return model


def main(argv=None):
  from k2jax.training import train
  init, argv = pop_init(sys.argv if argv is None else argv)
  try:
    config, workdir = train.parse(argv, "k2jax.sft", " [--init RUN | HF_DIR]",
                                  more_help=INIT_HELP)
    train.init_distributed()     # several processes (--coordinator_address ...): before JAX
    params = None
    if init is not None:
      source = load_init(init)
      init_model = source.model
      try:
        config.model = model_from_init(init_model, config, argv)
        tokenizer_from_init(source, config, argv)
      except ValueError as e:
        raise train.UserError(str(e)) from None

      def params(cfg, shardings, layout):   # the trainer's, once its logging is set up
        log.info("--init %s: weights of a %d-layer model, hidden size %d, %d experts, "
                 "stored as %s", init, init_model.num_hidden_layers, init_model.hidden_size,
                 init_model.n_routed_experts, cfg.param_dtype)
        return load_params(init, source, cfg, shardings, layout)
    train.enable_compilation_cache()
    train.train(config, workdir, build_data=build_data, init_params=params)
  except train.UserError as e:
    print(f"k2jax.sft: error: {e}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
  main()
