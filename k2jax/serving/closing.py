"""The shortest text that finishes a partial JSON value under a JSON schema: how a constrained
reply still ends valid when its token budget runs out (k2jax.serving.chat's grammar constraints).

    complete('{"city": "Par', schema)   ->  '"}'             (if "city" is the only required key)
    complete('{"n": [1, ', schema)      ->  '0]}'            (an array after a comma needs a value)
    minimal(schema)                     ->  the shortest document of the schema

A grammar mask keeps every token valid, but nothing in it knows how many tokens are left: a
forced tool call whose budget ends inside its arguments' string comes back cut. llguidance
(which computes the masks) has no "shortest completion" query, so this module proposes one
from the schema and the text so far, and the constraint checks the proposal with llguidance
before it relies on it (`chat.GrammarConstraint`): a wrong proposal costs the budget
guarantee, never validity. What it does not know (a string `pattern` or `format`, `allOf`,
`not`, ...) it answers None, and the constraint falls back to the plain mask.

The text is read the way llguidance's JSON grammar reads it: properties in the order of the
schema's `properties` (then other keys, as additionalProperties allows), flexible whitespace.
"""

import json
import math

_WS = " \t\n\r"
_NUM = "0123456789+-.eE"


def _dump(v) -> str:
  return json.dumps(v, separators=(",", ":"), ensure_ascii=False)


def _resolve(schema, root):
  """`schema` with its $ref followed (local refs: #/...)."""
  seen = 0
  while isinstance(schema, dict) and "$ref" in schema and seen < 32:
    ref = schema["$ref"]
    if not ref.startswith("#"):
      return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
      part = part.replace("~1", "/").replace("~0", "~")
      if not isinstance(node, dict) or part not in node:
        return None
      node = node[part]
    schema, seen = node, seen + 1
  return None if isinstance(schema, dict) and "$ref" in schema else schema   # a loop of refs


def _kind(schema) -> str | None:
  """The JSON type a container schema describes ("object" / "array"), else None."""
  t = schema.get("type")
  if t in ("object", "array"):
    return t
  if "properties" in schema or "required" in schema or "additionalProperties" in schema:
    return "object"
  if "items" in schema or "prefixItems" in schema:
    return "array"
  return None


def _branch(schema, root, kind: str):
  """The schema of a container of `kind` under `schema` (the first anyOf / oneOf option, or
  type in a type list, that describes one)."""
  schema = _resolve(schema, root)
  if schema is True or schema == {}:
    return {}
  if not isinstance(schema, dict):
    return None
  for key in ("anyOf", "oneOf"):
    for option in schema.get(key, ()):
      option = _resolve(option, root)
      if isinstance(option, dict) and (_kind(option) == kind or
                                       (isinstance(option.get("type"), list) and
                                        kind in option["type"])):
        return option
  if isinstance(schema.get("type"), list):
    return schema if kind in schema["type"] else None
  return schema if _kind(schema) in (kind, None) else None


def _bound(schema, lo_key, ex_key, integer, up):
  v, ex = schema.get(lo_key), schema.get(ex_key)
  if isinstance(ex, bool):                       # draft 4: exclusiveMinimum is a flag
    ex = v if ex else None
    v = None if ex is not None else v
  if ex is not None:
    return ex - 1 if up else ex + 1
  return v


def _number(schema, integer: bool) -> str | None:
  lo = _bound(schema, "minimum", "exclusiveMinimum", integer, up=False)
  hi = _bound(schema, "maximum", "exclusiveMaximum", integer, up=True)
  v = 0
  if lo is not None and v < lo:
    v = lo
  if hi is not None and v > hi:
    v = hi
  if (lo is not None and v < lo) or (hi is not None and v > hi):
    return None
  if integer:
    v = math.ceil(v) if lo is not None and v == lo else math.floor(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
      return None
  m = schema.get("multipleOf")
  if m and v % m:
    return None
  return _dump(int(v)) if integer or float(v).is_integer() else _dump(v)


# The longest closing proposed: a schema whose shortest document is longer (minItems 10^6)
# gets none, rather than the server building it on its event loop.
MAX_TEXT = 4096


def minimal(schema, root=None) -> str | None:
  """The shortest JSON text (compact) valid under `schema`, or None when unknown (or longer
  than MAX_TEXT)."""
  try:
    return _minimal(schema, schema if root is None else root, frozenset())
  except RecursionError:
    return None


def _minimal(schema, root, expanding: frozenset) -> str | None:
  schema = _resolve(schema, root)
  if schema is True or schema == {}:
    return "0"
  if not isinstance(schema, dict) or id(schema) in expanding:    # (a $ref cycle)
    return None
  expanding = expanding | {id(schema)}
  sub = lambda s: _minimal(s, root, expanding)
  if "const" in schema:
    return _dump(schema["const"])
  if "enum" in schema:
    return min((_dump(v) for v in schema["enum"]), key=len, default=None)
  for key in ("anyOf", "oneOf"):
    if key in schema:
      found = [m for m in map(sub, schema[key]) if m is not None]
      return min(found, key=len) if found else None
  if "allOf" in schema or "not" in schema or "if" in schema:
    return None
  t = schema.get("type")
  if isinstance(t, list):
    found = [m for m in (sub({**schema, "type": x}) for x in t) if m is not None]
    return min(found, key=len) if found else None
  t = t or _kind(schema)
  if t == "object":
    parts = []
    for k in _required(schema):
      v = sub(_value_schema(schema, k))
      if v is None:
        return None
      parts.append(f"{_dump(k)}:{v}")
    text = "{" + ",".join(parts) + "}"
    return text if len(text) <= MAX_TEXT else None
  if t == "array":
    if schema.get("minItems", 0) > MAX_TEXT:
      return None
    items = _items(schema, root, 0, schema.get("minItems", 0), expanding)
    text = None if items is None else "[" + ",".join(items) + "]"
    return text if text is not None and len(text) <= MAX_TEXT else None
  if t == "string":
    if "pattern" in schema or "format" in schema or schema.get("minLength", 0) > MAX_TEXT:
      return None
    return '"' + "a" * int(schema.get("minLength", 0)) + '"'
  if t in ("integer", "number"):
    return _number(schema, t == "integer")
  if t == "boolean":
    return "false"
  if t == "null":
    return "null"
  return "0" if t is None else None


def _required(schema) -> list[str]:
  """Required keys in the order llguidance wants them: `properties`' order, then the rest."""
  req = list(schema.get("required", ()))
  props = list(schema.get("properties", {}))
  return [k for k in props if k in req] + [k for k in req if k not in props]


def _value_schema(schema, key):
  props = schema.get("properties", {})
  if key in props:
    return props[key]
  extra = schema.get("additionalProperties", True)
  return {} if extra is True else extra


def _items(schema, root, start: int, upto: int, expanding=frozenset()) -> list[str] | None:
  """Minimal items start..upto-1 of an array schema."""
  if upto - start > MAX_TEXT:
    return None
  out = []
  for i in range(start, upto):
    v = _minimal(_item_schema(schema, i), root, expanding)
    if v is None:
      return None
    out.append(v)
  return out


def _item_schema(schema, i: int):
  prefix = schema.get("prefixItems", [])
  return prefix[i] if i < len(prefix) else schema.get("items", {})


class _Frame:
  """One open container or scalar of the partial text."""

  def __init__(self, kind, schema=None, state=None):
    self.kind, self.schema, self.state = kind, schema, state
    self.seen: list[str] = []     # object: keys written
    self.key = None               # object: the key whose value is open
    self.count = 0                # array: items written
    self.text = ""                # string / number / literal so far
    self.escape = ""              # string: an escape in progress ("\\", "\\u12")
    self.role = "value"           # string: "key" or "value"


def complete(prefix: str, schema, root=None) -> tuple[str, int] | None:
  """(the shortest suffix that makes `prefix` one valid document of `schema`, where the
  document ends in prefix + suffix); None when unknown or when the prefix is no such document's
  start. Text after a complete document (a following marker's first characters) is not read:
  the returned end says where the document stopped, so a caller can finish what follows."""
  try:
    return _complete(prefix, schema, schema if root is None else root)
  except RecursionError:
    return None


def _complete(prefix: str, schema, root) -> tuple[str, int] | None:
  stack = [_Frame("root", _resolve(schema, root), "value")]
  end = None
  for pos, c in enumerate(prefix):
    if not _feed(stack, c, root):
      if stack[-1].kind == "root" and stack[-1].state == "done":
        end = pos
        break
      return None
  if end is not None:
    return "", end
  suffix = _close(stack, root)
  return (suffix, len(prefix)) if suffix is not None else None


def _value_start(stack, c, schema, root) -> bool:
  """Open the value that c starts (in a parent that expects one)."""
  if c == "{":
    s = _branch(schema, root, "object")
    stack.append(_Frame("obj", s, "key_or_end"))
  elif c == "[":
    s = _branch(schema, root, "array")
    stack.append(_Frame("arr", s, "value_or_end"))
  elif c == '"':
    stack.append(_Frame("str", _resolve(schema, root)))
  elif c in "-0123456789":
    f = _Frame("num", _resolve(schema, root))
    f.text = c
    stack.append(f)
  elif c in "tfn":
    f = _Frame("lit")
    f.text = c
    stack.append(f)
  else:
    return False
  return stack[-1].schema is not None or stack[-1].kind in ("lit", "num", "str")


def _done(stack, root) -> None:
  """The top value is complete: pop it and advance its parent."""
  child = stack.pop()
  if child.kind == "str" and child.role == "key":
    stack[-1].key, stack[-1].state = json.loads('"' + child.text + '"'), "colon"
  else:
    _advance(stack)


def _feed(stack, c, root) -> bool:
  top = stack[-1]
  if top.kind == "str":
    if top.escape:
      top.escape += c
      if top.escape[1] != "u" or len(top.escape) == 6:
        top.text += top.escape
        top.escape = ""
    elif c == "\\":
      top.escape = c
    elif c == '"':
      _done(stack, root)
    else:
      top.text += c
    return True
  if top.kind == "num":
    if c in _NUM:
      top.text += c
      return True
    _done(stack, root)
    return _feed(stack, c, root)
  if top.kind == "lit":
    top.text += c
    if not any(w.startswith(top.text) for w in ("true", "false", "null")):
      return False
    if top.text in ("true", "false", "null"):
      _done(stack, root)
    return True
  if c in _WS:
    return True
  if top.kind == "root":
    return top.state == "value" and _value_start(stack, c, top.schema, root)
  if top.kind == "obj":
    if top.state in ("key_or_end", "key") and c == '"':
      f = _Frame("str")
      f.role = "key"
      stack.append(f)
    elif top.state == "key_or_end" and c == "}":
      _done(stack, root)
    elif top.state == "colon" and c == ":":
      top.state = "value"
    elif top.state == "value":
      return _value_start(stack, c, _value_schema(top.schema, top.key), root)
    elif top.state == "comma_or_end" and c == ",":
      top.state = "key"
    elif top.state == "comma_or_end" and c == "}":
      _done(stack, root)
    else:
      return False
    return True
  if top.kind == "arr":
    if top.state in ("value_or_end", "value") and not (top.state == "value_or_end" and c == "]"):
      return _value_start(stack, c, _item_schema(top.schema, top.count), root)
    if c == "]" and top.state in ("value_or_end", "comma_or_end"):
      _done(stack, root)
    elif c == "," and top.state == "comma_or_end":
      top.state = "value"
    else:
      return False
    return True
  return False


def _close(stack, root) -> str | None:
  """The suffix that closes every open frame, innermost first (None: a frame no text can
  close, such as a string under a pattern)."""
  out = []
  while stack:
    top = stack[-1]
    if top.kind == "root":
      if top.state == "value":
        v = minimal(top.schema, root)
        if v is None:
          return None
        out.append(v)
      return "".join(out)
    piece = _CLOSERS[top.kind](top, stack, root)
    if piece is None:
      return None
    out.append(piece)
    stack.pop()
    if not (top.kind == "str" and top.role == "key"):   # a key's parent expects its colon
      _advance(stack)
  return "".join(out)


def _close_str(top, stack, root) -> str | None:
  """The end of an open string: a key's (the parent object then expects its colon), an
  enum's or const's shortest member the text so far starts, or a closing quote after
  what minLength still asks."""
  if top.role == "key":
    parent = stack[-2]
    name = None if top.escape else _key_name(parent, json.loads('"' + top.text + '"'))
    rest = None if name is None else _dump(name)[1:]      # the escaped name and its quote
    if rest is None or not rest.startswith(top.text):
      return None
    parent.key, parent.state = name, "colon"
    return rest[len(top.text):]
  s = top.schema if isinstance(top.schema, dict) else {}
  if "enum" in s or "const" in s:
    tails = [_dump(v)[1:] for v in s.get("enum", [s.get("const")]) if isinstance(v, str)]
    tails = [t for t in tails if t.startswith(top.text) and not top.escape]
    return min(tails, key=len)[len(top.text):] if tails else None
  if "pattern" in s or "format" in s:
    return None
  written = len(json.loads('"' + top.text + '"'))
  out = ""
  if top.escape:          # finish the escape: \\ (a backslash) or \uXXXX padded with 0s
    out = "0" * (6 - len(top.escape)) if top.escape.startswith("\\u") else "\\"
    written += 1
  return out + "a" * max(0, int(s.get("minLength", 0)) - written) + '"'


def _close_num(top, stack, root) -> str | None:
  return _number_tail(top.text, top.schema if isinstance(top.schema, dict) else {})


def _close_lit(top, stack, root) -> str:
  return next(w for w in ("true", "false", "null") if w.startswith(top.text))[len(top.text):]


def _close_obj(top, stack, root) -> str | None:
  """The open value, then every required property not yet written, then the brace."""
  s, out = top.schema, []
  rest = [k for k in _required(s) if k not in top.seen and k != top.key]
  if top.state in ("colon", "value"):
    v = minimal(_value_schema(s, top.key), root)
    if v is None:
      return None
    out.append((":" if top.state == "colon" else "") + v)
    top.seen.append(top.key)
    top.state = "comma_or_end"
  if top.state == "key" and not rest:       # after a comma a key must follow
    k = _key_name(top, "")
    v = None if k is None else minimal(_value_schema(s, k), root)
    if v is None:
      return None
    out.append(f"{_dump(k)}:{v}")
    top.state = "comma_or_end"
  for i, k in enumerate(rest):
    v = minimal(_value_schema(s, k), root)
    if v is None:
      return None
    sep = "" if (i == 0 and top.state in ("key", "key_or_end")) else ","
    out.append(f"{sep}{_dump(k)}:{v}")
  return "".join(out) + "}"


def _close_arr(top, stack, root) -> str | None:
  """The items minItems still asks (one where a value must follow a comma), then ']'."""
  s = top.schema
  need = max(s.get("minItems", 0) - top.count, 0)
  if top.state == "value":
    need = max(need, 1)
  items = _items(s, root, top.count, top.count + need)
  if items is None:
    return None
  sep = "" if top.state in ("value", "value_or_end") else ","
  return (sep + ",".join(items) if items else "") + "]"


_CLOSERS = {"str": _close_str, "num": _close_num, "lit": _close_lit, "obj": _close_obj,
            "arr": _close_arr}


def _advance(stack) -> None:
  """The parent of a value just closed moves past it."""
  parent = stack[-1]
  if parent.kind == "root":
    parent.state = "done"
  elif parent.kind == "obj":
    parent.seen.append(parent.key)
    parent.state = "comma_or_end"
  elif parent.kind == "arr":
    parent.count += 1
    parent.state = "comma_or_end"


def _number_tail(text: str, schema) -> str | None:
  """Digits that end a partial number inside the schema's bounds: a sign or exponent needs a
  digit (the bound's own where 0 is out: "-" under maximum -3 gives "-3"), and a whole
  number below its minimum grows by digits ("1" under minimum 5 gives "10"); None where no
  digit can help (already past the maximum)."""
  lo = _bound(schema, "minimum", "exclusiveMinimum", True, up=False)
  hi = _bound(schema, "maximum", "exclusiveMaximum", True, up=True)
  ok = lambda v: (lo is None or v >= lo) and (hi is None or v <= hi)
  if text == "-":
    digit = str(-math.floor(hi)) if hi is not None and hi < 0 else "0"
    return digit if ok(float(text + digit)) else None
  tail = "0" if text[-1] in "+-.eE" else ""
  if text.isdigit():
    while not ok(int(text + tail)) and len(tail) < 18 and int(text + tail) < (lo or 0):
      tail += "0"
  return tail if ok(float(text + tail)) else None


def _key_name(obj: _Frame, partial: str) -> str | None:
  """The key to finish a partial one with: a required key it starts, else the shortest
  property it starts, else itself when additionalProperties allows."""
  s = obj.schema
  props = list(s.get("properties", {}))
  last = max((props.index(k) for k in obj.seen if k in props), default=-1)
  free = props[last + 1:]                # llguidance keeps `properties`' order
  req = [k for k in _required(s) if k not in obj.seen]
  for pool in (req, sorted(free, key=len)):
    for k in pool:
      if k.startswith(partial):
        return k
  if s.get("additionalProperties", True) is not False:
    return partial
  return None


def slack(schema, root=None) -> int:
  """A bound on how much one sampled token can lengthen the closing of a value of `schema`,
  in UTF-8 bytes (a token is at least one): it can open at most one new key or item whose
  shortest value is the longest of any subschema (nested containers it opens are part of that
  value's shortest text), so: the longest key + the longest shortest value + separators."""
  root = schema if root is None else root
  longest_key, longest_value, seen = 0, 0, set()

  def walk(s, depth=0):
    nonlocal longest_key, longest_value
    s = _resolve(s, root)
    if not isinstance(s, dict) or id(s) in seen or depth > 32:
      return
    seen.add(id(s))
    v = minimal(s, root)
    longest_value = max(longest_value, len(v.encode()) if v is not None else 0)
    for k, sub in s.get("properties", {}).items():
      longest_key = max(longest_key, len(_dump(k).encode()))
      walk(sub, depth + 1)
    for key in ("items", "additionalProperties"):
      if isinstance(s.get(key), dict):
        walk(s[key], depth + 1)
    for key in ("prefixItems", "anyOf", "oneOf"):
      for sub in s.get(key, ()):
        walk(sub, depth + 1)
  walk(schema)
  return longest_key + longest_value + 4
