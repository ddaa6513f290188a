"""Samples of each synthesis pipeline's output, written by the SCRIPTED model (--dry_run,
`k2jax.synth.dryrun`), not by a language model: they show the record format and provenance
the pipelines write (what k2jax.train / k2jax.sft read), not the quality of any model's text.
Rewrites copy their source, the agent calls its first tool with schema-valid arguments, every
judge passes; the `add` tool of examples/synth/tools/calc.json really runs in the RL sandbox.

    python experiments/synth_samples.py

Inputs: examples/synth/ (the README's tiny-scale run uses the same files).
Output: experiments/results/synth/samples/scripted_{rephrase,math,agentic}.jsonl
"""

import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(ROOT)

from k2jax.synth import cli  # noqa: E402

RUNS = {
    "rephrase": ["--input", "examples/synth/docs.jsonl", "-k", "2", "--chunk_chars", "300"],
    "math": ["--input", "examples/synth/math/*.md", "--chunk_chars", "300"],
    "agentic": ["--tools", "examples/synth/tools/*.json", "--evolve", "2,1,1", "--items", "3"],
}


def main():
  os.chdir(ROOT)                   # item ids of .md inputs are their relative paths
  out_dir = os.path.join(HERE, "results", "synth", "samples")
  os.makedirs(out_dir, exist_ok=True)
  for pipeline, argv in RUNS.items():
    out = os.path.join(out_dir, f"scripted_{pipeline}.jsonl")
    for old in glob.glob(out + "*"):          # the store resumes: start from nothing
      os.remove(old)
    cli.main([pipeline, *argv, "--output", out, "--dry_run", "--concurrency", "1"])
    for side in glob.glob(out + ".*"):         # .drops (empty when all kept), .tools.json
      os.remove(side)


if __name__ == "__main__":
  main()
