"""Parameter counts and FLOPs of a config: `python -m k2jax.params --config kimi_k2`."""

import argparse
import sys

from k2jax import configs, model

# Report Table 2 (total, activated) for the presets that have published counts.
REPORTED = {"kimi_k2": (1.04e12, 32.6e9), "deepseek_v3": (671e9, 37e9)}


def table(config, seq_len: int | None = None, name: str | None = None) -> str:
  """The table of a preset name or a full config (`name` labels it)."""
  cfg = configs.get_config(config) if isinstance(config, str) else config
  name = name or (config if isinstance(config, str) else "config")
  m = cfg.model
  c = model.count_params(m)
  seq_len = seq_len or cfg.train.seq_len
  lines = [f"{name}: {m.num_hidden_layers} layers ({m.first_k_dense_replace} dense), "
           f"{m.num_attention_heads} heads, {m.n_routed_experts} experts "
           f"(top-{m.num_experts_per_tok} + {m.n_shared_experts} shared)",
           f"{'component':<28}{'parameters':>20}"]
  for k in ("embedding", "attention", "norms", "dense_mlp", "routed_experts",
            "routed_experts_activated", "shared_experts", "router", "lm_head"):
    lines.append(f"  {k:<26}{c[k]:>20,}")
  lines.append(f"{'total':<28}{c['total']:>20,}  ({c['total'] / 1e9:.2f}B)")
  lines.append(f"{'activated per token':<28}{c['activated']:>20,}  ({c['activated'] / 1e9:.2f}B)")
  if name in REPORTED:
    t, a = REPORTED[name]
    lines.append(f"{'report':<28}{'':>20}  total {t / 1e9:.0f}B ({c['total'] / t - 1:+.1%}), "
                 f"activated {a / 1e9:.1f}B ({c['activated'] / a - 1:+.1%})")
  f = model.flops_per_token(m, seq_len)
  lines.append(f"{'training FLOPs / token':<28}{f:>20,.0f}  (at seq_len {seq_len}; "
               f"forward {f / 3:,.0f})")
  return "\n".join(lines)


def parse_config(prog: str, parser: argparse.ArgumentParser, argv, positive=()):
  """(args, config, overrides) for a CLI with argparse options plus the trainer's --config
  PRESET | FILE and --config.KEY=VALUE overrides (read by k2jax.train's parser, so every CLI
  takes the same configs). The options named in `positive` must be >= 1 where given; they
  are checked before the config is loaded. Raises ValueError (one line) for anything wrong."""
  from k2jax.training import train
  args, rest = parser.parse_known_args(argv)
  for flag in positive:
    value = getattr(args, flag)
    if value is not None and value < 1:
      raise ValueError(f"--{flag} {value}: must be >= 1")
  overrides = [a for a in rest if a.startswith("--config.")]
  if len(overrides) != len(rest):
    parser.error(f"unrecognized arguments: {' '.join(a for a in rest if a not in overrides)}")
  try:
    return args, train.load_config([prog, "--config", args.config, *overrides]), overrides
  except train.UserError as e:
    raise ValueError(str(e)) from None


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m k2jax.params", description=__doc__,
                              epilog="Override any config value with --config.KEY=VALUE.")
  p.add_argument("--config", required=True,
                 help=f"preset ({', '.join(configs.PRESETS)}) or config file")
  p.add_argument("--seq_len", type=int, default=None, help="default: the config's train.seq_len")
  try:
    args, config, overrides = parse_config("k2jax.params", p, argv, positive=("seq_len",))
    # the report's published counts only label the preset as shipped
    name = args.config if not overrides else f"{args.config} with {' '.join(overrides)}"
    print(table(config, args.seq_len, name=name))
  except ValueError as e:
    print(f"k2jax.params: error: {e}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
  main()
