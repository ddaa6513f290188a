"""The documentation is part of the product: README.md and docs/ build, run and stay true.

- `mkdocs build --strict` builds the site (guides, results pages fed by the experiments'
  CSVs, the API reference from the docstrings): a broken link, a missing CSV or a docstring
  griffe cannot read fails the suite, not a reader.
- Every ```python block of README.md and of each docs page runs as written, in order, one
  namespace per page.
- Every `python -m k2jax.X` and `python experiments/X.py` command in a ```bash block names
  only flags its program accepts (its own --help; `--config.GROUP.KEY` a key of the config it
  loads), and each k2jax program is run by a test this file names (COMMANDS), whose body
  does run it.
"""

import ast
import contextlib
import functools
import glob
import importlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(
    glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))

# The test that runs each documented program (its body starts the program's CLI or calls its
# main): a documented command whose program is not here fails test_every_command_...
COMMANDS = {
    "k2jax.train": "tests/test_train.py::test_sigterm_then_resume_reproduces_the_uninterrupted_run",
    "k2jax.sft": "tests/test_sft.py::test_sft_cli_trains_then_fine_tunes_from_the_run",
    "k2jax.rl": "tests/test_rl.py::test_rl_resumes_exactly_after_kill_9",
    "k2jax.generate": "tests/test_generate.py::test_cli_samples_from_a_trained_run",
    "k2jax.serve": "tests/test_serve.py::test_cli_serves_a_trained_run_and_refuses_bad_input",
    "k2jax.plot": "tests/test_plot.py::test_runs_of_each_kind_draw_from_the_directory_or_its_metrics_file",
    "k2jax.plan": "tests/test_plan.py::test_cli_takes_config_files_and_overrides",
    "k2jax.params": "tests/test_plan.py::test_cli_takes_config_files_and_overrides",
    "k2jax.compile": "tests/test_tpu_compile.py::test_a_step_xla_refuses_ends_in_one_line_with_its_reason",
    "k2jax.convert": "tests/test_load.py::test_convert_export_and_fine_tune_from_published_weights_on_meshes",
    "k2jax.export": "tests/test_load.py::test_convert_export_and_fine_tune_from_published_weights_on_meshes",
    "k2jax.synth": "tests/test_synth.py::test_against_k2jax_serve_every_item_is_done_once_after_a_kill",
}
# where a program's main lives when `python -m` runs a package
MAINS = {"k2jax.rl": "k2jax.rl.train", "k2jax.synth": "k2jax.synth.cli"}


def _blocks(page: str, lang: str) -> list[str]:
  return re.findall(rf"```{lang}\n(.*?)```", open(page).read(), flags=re.S)


def _commands(page: str):
  """(program, argv) for each python command in the page's bash blocks."""
  for block in _blocks(page, "bash"):
    # one lexer over the block (a quoted argument may span lines); a line end ends a command
    # (after the line's comment, which the lexer drops)
    text = block.replace("\\\n", " ").replace("\n", "\n;")
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    tokens = list(lexer)
    for i, tok in enumerate(tokens):
      if tok not in ("python", "python3") or i + 1 == len(tokens):
        continue
      end = next((j for j in range(i + 1, len(tokens)) if set(tokens[j]) <= set(";&|")),
                 len(tokens))
      args = [t.strip("[]") for t in tokens[i + 1:end] if t != "..."]
      if args[:1] == ["-m"] and args[1].startswith("k2jax."):
        yield args[1], args[2:]
      elif args and args[0].startswith("experiments/"):
        yield args[0], args[1:]


def _documented():
  return [(os.path.relpath(page, ROOT), program, argv)
          for page in PAGES for program, argv in _commands(page)]


@functools.cache
def _help(program: str, sub: str | None) -> str:
  module = importlib.import_module(MAINS.get(program, program))
  # argparse programs take their arguments; the trainers (absl flags) argv[0] first
  for argv in ([sub, "--help"] if sub else ["--help"], [program, "--help"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), \
         pytest.raises(SystemExit) as exit:
      module.main(argv)
    if exit.value.code in (0, None):
      return out.getvalue()
  raise AssertionError(f"{program} --help failed: {out.getvalue()}")


@functools.cache
def _config(name: str):
  from k2jax import configs
  path = os.path.join(ROOT, name)
  if name.endswith(".py"):   # a config file; an example name (my_config.py): the tiny preset
    return runpy.run_path(path)["get_config"]() if os.path.exists(path) else \
        configs.get_config("tiny")
  return configs.get_config(name)


def test_the_site_builds_with_strict_checks(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", NO_MKDOCS_2_WARNING="1")
  p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                      str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=600)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  for page in ("index.html", "guides/parallelism/index.html", "reference/optim/index.html",
               "results/loading/index.html", "guides/img/schedule_zbh1.png",
               "results/data/load/load.csv"):
    assert (tmp_path / "site" / page).exists(), page
  # the reference is the docstrings: one that names QK-Clip's math must be on the page
  assert "max logit" in (tmp_path / "site/reference/optim/index.html").read_text().lower()
  # a results table is rendered from its CSV at build time, not pasted
  loading = (tmp_path / "site/results/loading/index.html").read_text()
  assert "<table>" in loading and "rss_over_arrays" in loading


@pytest.mark.parametrize("page", [os.path.relpath(p, ROOT) for p in PAGES
                                  if _blocks(p, "python")])
def test_python_blocks_run(page):
  namespace = {}
  for block in _blocks(os.path.join(ROOT, page), "python"):
    exec(compile(block, page, "exec"), namespace)


def test_the_commands_are_found():
  """The extraction itself: README's main jobs are all seen (a parser that finds nothing
  would pass every check below)."""
  readme = {program for page, program, _ in _documented() if page == "README.md"}
  assert {"k2jax.train", "k2jax.sft", "k2jax.rl", "k2jax.generate", "k2jax.serve",
          "k2jax.plan", "k2jax.compile"} <= readme


@pytest.mark.parametrize("page,program,argv", _documented(),
                         ids=lambda x: x if isinstance(x, str) else None)
def test_every_command_names_only_flags_its_program_accepts(page, program, argv):
  if program.startswith("experiments/"):
    path = os.path.join(ROOT, program)
    assert os.path.isfile(path), f"{page}: {program} does not exist"
    source = open(path).read()
    for flag in (a.split("=")[0] for a in argv if a.startswith("--")):
      assert f'"{flag}"' in source or f"'{flag}'" in source, f"{page}: {program} has no {flag}"
    return
  sub = argv[0] if program == "k2jax.synth" else None
  text = _help(program, sub)
  config = argv[argv.index("--config") + 1] if "--config" in argv else None
  for arg in argv:
    if not arg.startswith("--"):
      continue
    flag = arg.split("=")[0]
    if flag.startswith("--config."):
      assert config, f"{page}: {program} {flag} without --config"
      node = _config(config)
      for key in flag[len("--config."):].split("."):
        assert key in node, f"{page}: {program} --config {config} has no {flag[9:]}"
        node = node[key]
    else:
      assert re.search(rf"{re.escape(flag)}\b", text), f"{page}: {program} has no {flag}"


@pytest.mark.parametrize("program", sorted({p for _, p, _ in _documented()
                                            if p.startswith("k2jax.")}))
def test_every_documented_program_is_run_by_a_named_test(program):
  assert program in COMMANDS, f"no test is named for {program}: add it to COMMANDS"
  path, name = COMMANDS[program].split("::")
  source = open(os.path.join(ROOT, path)).read()
  found = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
  assert found, f"{COMMANDS[program]} does not exist"
  body = ast.get_source_segment(source, found[0])
  short = program.split(".")[-1]
  # the test starts the program (python -m), calls its main, or calls a helper of its file
  # that does (run_cli, run_sft, ...)
  helpers = [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)
             and re.search(rf'"{re.escape(program)}"|\b{short}\.main\(',
                           ast.get_source_segment(source, n))]
  assert any(re.search(rf"\b{h}\b", body) for h in helpers), \
      f"{COMMANDS[program]} does not run {program}"
