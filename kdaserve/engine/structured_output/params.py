"""vLLM's `StructuredOutputsParams`: exactly one constraint, checked when the object is built."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# The constraint kinds, in vLLM's field names.
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# A grammar's source is compiled on the server: bounded like every other input.
MAX_SPEC_CHARS = 1 << 16
MAX_CHOICES = 1024


def _fail(name: str, got, expected: str):
    raise ValueError(f"invalid structured_outputs.{name}: got {got!r}; expected {expected}")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None          # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None         # the output is exactly one of these strings
    grammar: str | None = None              # EBNF (GBNF) or Lark
    json_object: bool | None = None         # any JSON object
    disable_any_whitespace: bool = False    # JSON without optional whitespace
    disable_additional_properties: bool = False   # objects without properties the schema does not name
    # The compiled grammar, set once (engine or server) and shared by the n samples of a request.
    compiled: object = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        # xgrammar's compiled grammars do not pickle: a copy (an engine in another process) carries
        # the source and compiles its own (its compiler caches by source).
        return {**self.__dict__, "compiled": None}

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "true or false")
        if self.json is not None:
            if isinstance(self.json, dict):
                self.json = json.dumps(self.json)
            elif isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as exc:
                    _fail("json", self.json[:80], f"a JSON schema (an object, or its JSON text): {exc}")
                if not isinstance(schema, (dict, bool)):
                    _fail("json", self.json[:80], "a JSON schema: an object")
            else:
                _fail("json", type(self.json).__name__, "a JSON schema (an object, or its JSON text)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            _fail("regex", self.regex, "a non-empty regular expression")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            _fail("grammar", self.grammar, "a non-empty EBNF or Lark grammar")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                _fail("choice", self.choice, "a non-empty list of non-empty strings")
            if len(self.choice) > MAX_CHOICES:
                _fail("choice", f"{len(self.choice)} strings", f"at most {MAX_CHOICES}")
        if self.json_object is not None and self.json_object is not True:
            _fail("json_object", self.json_object, "true")
        size = len(self.spec)
        if size > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{self.kind} has {size} characters; at most {MAX_SPEC_CHARS} are allowed")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def spec(self) -> str:
        """The constraint as text (what is compiled, and the key of the compiler's cache)."""
        if self.choice is not None:
            return json.dumps(self.choice)
        if self.json_object is not None:
            return ""
        return getattr(self, self.kind)
