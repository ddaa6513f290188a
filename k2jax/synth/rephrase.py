"""Knowledge rephrasing (report 2.2, Figure 4): K style-diverse rewrites of each document,
written chunk by chunk and checked for fidelity against their source.

A document longer than `chunk_chars` is split at paragraph / sentence boundaries. Chunk i is
rewritten given the original text before it and the rewrite so far (a tail of each, so the
prompt stays bounded), which keeps the rewrite coherent across chunks without asking the
model for a long output in one go; the rewritten chunks are joined in order.

Every rewritten chunk is checked twice:
  * `overlap`: the cheap check. Numbers of the source missing from the rewrite (dropped
    content) or numbers in the rewrite that the source does not have (invented content), and
    the recall of the source's names (capitalized words not starting a sentence). A reworded
    sentence keeps its numbers and names; a dropped or hallucinated fact usually does not.
  * `judge`: the model is asked for a 0-10 score of faithfulness (JSON); below `min_score`
    the rewrite is dropped, and a judge reply that is not the asked JSON is a counted drop.
A rewrite is kept only if every chunk passes both; its record says how it scored.
"""

import dataclasses
import re

from k2jax.synth.client import Client, ModelError, Request
from k2jax.synth.store import extract_json, item_seed

# Style and perspective prompts (ours): the rewrite's voice changes, its facts must not.
STYLES = {
    "encyclopedia": "as a neutral encyclopedia entry",
    "textbook": "as a passage of a university textbook that explains each point to a student",
    "qa": "as a series of questions and answers that together cover every fact",
    "lecture": "as the transcript of a lecturer explaining it to a class",
    "expert_notes": "as terse notes one expert writes for another",
    "plain": "in plain words for a curious reader with no background in the subject",
    "narrative": "as a narrative told by someone who watched it happen or did the work",
}
KEEP_FACTS = ("Keep every fact, number and name of the passage and add nothing it does not "
              "say. Reply with the rewritten passage only.")

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_NAME = re.compile(r"(?<![.!?]\s)(?<!^)\b[A-Z][a-zA-Z]{2,}\b")


def split_chunks(text: str, max_chars: int) -> list[str]:
  """Paragraphs packed up to max_chars; a longer paragraph is split between sentences, a
  longer sentence between words (only a word longer than max_chars is cut)."""
  pieces = []
  for para in re.split(r"\n\s*\n", text.strip()):
    if len(para) <= max_chars:
      pieces.append(para)
      continue
    for sent in re.split(r"(?<=[.!?])\s+", para):
      if len(sent) <= max_chars:
        pieces.append(sent)
        continue
      line = ""                    # a long sentence: between words (a long word: cut)
      for word in re.findall(r"\S+\s*", sent):
        while len(word) > max_chars:
          pieces += [line] if line else []
          line, pieces = "", pieces + [word[:max_chars]]
          word = word[max_chars:]
        if len(line) + len(word.rstrip()) > max_chars:
          pieces.append(line.rstrip())
          line = ""
        line += word
      pieces += [line.rstrip()] if line.strip() else []
  chunks, cur = [], ""
  for p in pieces:
    if cur and len(cur) + len(p) + 2 > max_chars:
      chunks.append(cur)
      cur = p
    else:
      cur = f"{cur}\n\n{p}" if cur else p
  return chunks + ([cur] if cur else [])


def overlap(source: str, rewrite: str) -> dict:
  """The cheap fidelity check: number recall / invention and name recall (see the module
  docstring). Values are fractions in [0, 1]; 1.0 when the source has none."""
  def numbers(t):
    return {n.replace(",", "") for n in _NUMBER.findall(t)}
  src_n, out_n = numbers(source), numbers(rewrite)
  src_names = set(_NAME.findall(source))
  low = rewrite.lower()
  return {
      "number_recall": len(src_n & out_n) / len(src_n) if src_n else 1.0,
      "numbers_invented": len(out_n - src_n) / len(out_n) if out_n else 0.0,
      "name_recall": (sum(n.lower() in low for n in src_names) / len(src_names)
                      if src_names else 1.0),
  }


@dataclasses.dataclass
class Settings:
  """Knobs of a rewrite (the CLI's flags)."""
  chunk_chars: int = 1500
  context_chars: int = 1000            # tail of the preceding original / rewrite shown
  min_number_recall: float = 0.8
  max_numbers_invented: float = 0.2
  min_name_recall: float = 0.6
  min_score: float = 7.0
  judge: bool = True
  temperature: float = 0.8
  max_tokens: int = 1024


class Dropped(Exception):
  """An item that failed a check (reason: 'kind: detail')."""


def judge_fidelity(client: Client, source: str, rewrite: str, seed: int) -> float:
  """The model's 0-10 faithfulness score of `rewrite` against `source` (Dropped when the
  reply is not the asked JSON)."""
  reply = client.chat(Request(messages=[
      {"role": "system", "content": "You check rewrites against their source. Reply in JSON."},
      {"role": "user", "content":
       f"Source:\n<<<\n{source}\n>>>\n\nRewrite:\n<<<\n{rewrite}\n>>>\n\nDoes the rewrite "
       "state every fact of the source, and nothing the source does not say? Reply with JSON "
       'only: {"score": <0-10>, "missing": [facts left out], "invented": [facts added]}.'}],
      temperature=0.0, max_tokens=256, seed=seed))
  try:
    score = float(extract_json(reply.content)["score"])
  except (ValueError, KeyError, TypeError) as e:
    raise Dropped(f"judge malformed: {str(e)[:80]}") from None
  if not 0 <= score <= 10:
    raise Dropped(f"judge malformed: score {score} outside 0-10")
  return score


def rewrite_document(client: Client, text: str, instruction: str, *, seed: int,
                     settings: Settings, system: str = "You rewrite documents piece by piece."
                     ) -> tuple[str, list[dict]]:
  """(the whole rewrite, per-chunk records {chunk, chars, overlap, score}); raises Dropped
  when a chunk fails a check and ModelError when the model fails for good."""
  s = settings
  chunks = split_chunks(text, s.chunk_chars)
  done: list[str] = []
  info = []
  for i, chunk in enumerate(chunks):
    context = ""
    if i:
      before = "\n\n".join(chunks[:i])[-s.context_chars:]
      so_far = "\n\n".join(done)[-s.context_chars:]
      context = (f"The document so far, original:\n<<<\n{before}\n>>>\nand rewritten:\n<<<\n"
                 f"{so_far}\n>>>\nContinue the rewrite so it reads on from there.\n\n")
    reply = client.chat(Request(messages=[
        {"role": "system", "content": system},
        {"role": "user", "content": f"{context}Rewrite this part {instruction}. {KEEP_FACTS}"
                                    f"\n<<<\n{chunk}\n>>>"}],
        temperature=s.temperature, max_tokens=s.max_tokens, seed=item_seed(seed, "chunk", i)))
    out = reply.content.strip()
    if not out:
      raise Dropped(f"empty: chunk {i} came back empty")
    if reply.finish_reason == "length":   # fewer tokens than asked: clamped to the context
      limit = (f"the model's context after {reply.completion_tokens} tokens"
               if 0 < reply.completion_tokens < s.max_tokens else f"max_tokens {s.max_tokens}")
      raise Dropped(f"truncated: chunk {i} hit {limit}")
    o = overlap(chunk, out)
    if o["number_recall"] < s.min_number_recall:
      raise Dropped(f"dropped content: chunk {i} keeps {o['number_recall']:.0%} of the numbers")
    if o["numbers_invented"] > s.max_numbers_invented:
      raise Dropped(f"invented content: chunk {i} has {o['numbers_invented']:.0%} new numbers")
    if o["name_recall"] < s.min_name_recall:
      raise Dropped(f"dropped content: chunk {i} keeps {o['name_recall']:.0%} of the names")
    score = judge_fidelity(client, chunk, out, item_seed(seed, "judge", i)) if s.judge else None
    if score is not None and score < s.min_score:
      raise Dropped(f"judge: chunk {i} scored {score:g} < {s.min_score:g}")
    done.append(out)
    info.append({"chunk": i, "chars": len(chunk), "overlap": o, "score": score})
  return "\n\n".join(done), info


def rephrase(client: Client, doc: dict, k: int, *, seed: int, settings: Settings,
             styles: dict = STYLES) -> dict:
  """The k-th rephrasing of doc {"id", "text"} as a record for k2jax.train (field "text"),
  with provenance. The style is drawn per (document, k) without repeats until all are used."""
  names = sorted(styles)
  order = sorted(names, key=lambda n: item_seed(seed, doc["id"], "style", n))
  style = order[k % len(order)]
  text, chunks = rewrite_document(client, doc["text"], styles[style],
                                  seed=item_seed(seed, doc["id"], k), settings=settings)
  scores = [c["score"] for c in chunks if c["score"] is not None]
  return {"text": text, "source_id": doc["id"], "style": style, "rephrasing": k,
          "chunks": chunks, "fidelity": min(scores) if scores else None}


__all__ = ["STYLES", "Settings", "Dropped", "ModelError", "split_chunks", "overlap",
           "judge_fidelity", "rewrite_document", "rephrase"]
