"""Math rephrasing (report 2.2): mathematical documents rewritten as learning notes, and
documents in other languages translated into English first.

The "learning note" (the report's style, after SwallowMath) restates the material the way a
student writes it up to learn it: what is asked or defined, the ideas it rests on, the
derivation step by step with every intermediate result, and what to remember. It goes
through the same chunked rewrite and fidelity checks as knowledge rephrasing
(`k2jax.synth.rephrase`), where numbers are what matters most: a note that loses or changes
one is dropped.

Translation is decided per document by a cheap script test (the share of letters outside
Latin script, `needs_translation`); a translated document is checked (numbers kept, judge)
before the note is written from it, and the record keeps the language step in its
provenance.
"""

from k2jax.synth.client import Client
from k2jax.synth.rephrase import Settings, rewrite_document
from k2jax.synth.store import item_seed

LEARNING_NOTE = ("as a learning note: state what is asked or defined, the ideas it rests on, "
                 "then work through it step by step writing out every intermediate result and "
                 "formula, and end with what to remember")
TRANSLATE = ("in English: translate it faithfully, keeping every formula, number and symbol "
             "exactly as written")
SYSTEM = "You are a careful mathematician who rewrites material piece by piece."


def needs_translation(text: str, threshold: float = 0.3) -> bool:
  """True when more than `threshold` of the letters are outside the Latin script (a cheap
  test; accented Latin languages are left to the note's rewrite, which writes English)."""
  letters = [c for c in text if c.isalpha()]
  if not letters:
    return False
  other = sum(1 for c in letters if ord(c) > 0x24F)
  return other / len(letters) > threshold


def learning_note(client: Client, doc: dict, *, seed: int, settings: Settings) -> dict:
  """The learning note of doc {"id", "text"} as a k2jax.train record with provenance."""
  text, steps = doc["text"], []
  if needs_translation(text):
    text, chunks = rewrite_document(client, text, TRANSLATE, system=SYSTEM, settings=settings,
                                    seed=item_seed(seed, doc["id"], "translate"))
    steps.append({"step": "translate", "chunks": chunks})
  note, chunks = rewrite_document(client, text, LEARNING_NOTE, system=SYSTEM, settings=settings,
                                  seed=item_seed(seed, doc["id"], "note"))
  steps.append({"step": "learning_note", "chunks": chunks})
  scores = [c["score"] for s in steps for c in s["chunks"] if c["score"] is not None]
  return {"text": note, "source_id": doc["id"], "style": "learning_note",
          "translated": len(steps) == 2, "steps": steps,
          "fidelity": min(scores) if scores else None}
