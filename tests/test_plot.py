"""k2jax.plot: every kind of run draws, and every mistake is one line with exit 2."""

import json

import pytest

from k2jax.tools import plot

PRE = [{"step": s, "loss": 5.0 - 0.1 * s, "max_logit": 10.0 + s, "clipped_heads": 0,
        "max_logits_per_layer": [9.0 + s, 10.0 + s]} for s in range(1, 6)]
RL = [{"step": s, "k15_loss": 0.01, "mean_reward": 0.3 + 0.05 * s, "reward/arithmetic": 0.3,
       "max_logit": 4.0} for s in range(1, 4)]


def _run(path, rows, optimizer=None):
  path.mkdir()
  (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  if optimizer:
    (path / "config.json").write_text(json.dumps({"optimizer": optimizer}))
  return path


@pytest.mark.parametrize("rows", [PRE, RL], ids=["pretrain", "rl"])
def test_runs_of_each_kind_draw_from_the_directory_or_its_metrics_file(tmp_path, rows, capsys):
  run = _run(tmp_path / "run", rows)
  plot.main([str(run / "metrics.jsonl")])
  assert capsys.readouterr().out.strip() == str(run / "curves.png")
  assert (run / "curves.png").stat().st_size > 10_000
  plot.main([str(run), "--out", str(tmp_path / "c.svg")])
  assert (tmp_path / "c.svg").read_text().startswith("<?xml")


def test_tau_is_drawn_only_when_the_run_clipped():
  opt = {"name": "muonclip", "tau": 100.0}
  labels = lambda fig: [l.get_label() for l in fig.axes[1].get_lines()]
  assert "tau = 100" not in labels(plot.draw(PRE, opt, "t"))
  clipped = [dict(r, clipped_heads=2 if r["step"] == 3 else 0) for r in PRE]
  assert "tau = 100" in labels(plot.draw(clipped, opt, "t"))


BAD_INPUTS = [
    ("no-such-dir", ["{tmp}/nope"], "no such run directory"),
    ("not-a-run", ["{tmp}/empty_dir"], "no metrics.jsonl"),
    ("empty-metrics", ["{tmp}/empty_run"], "has no rows yet"),
    ("out-format", ["{tmp}/run", "--out", "{tmp}/x.txt"], "matplotlib cannot write .txt"),
    ("out-no-ext", ["{tmp}/run", "--out", "{tmp}/x"], "a file without an extension"),
    ("out-dir-missing", ["{tmp}/run", "--out", "{tmp}/no/x.png"], "its directory does not exist"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_end_in_one_line_and_exit_2(tmp_path, case, capsys):
  _, argv, fragment = case
  _run(tmp_path / "run", PRE)
  _run(tmp_path / "empty_run", [])
  (tmp_path / "empty_dir").mkdir()
  with pytest.raises(SystemExit) as e:
    plot.main([a.format(tmp=tmp_path) for a in argv])
  err = capsys.readouterr().err
  assert e.value.code == 2
  (line,) = err.strip().splitlines()
  assert line.startswith("k2jax.plot: error:") and fragment in line, line
  assert not (tmp_path / "x.txt").exists() and not (tmp_path / "empty_run" / "curves.png").exists()
