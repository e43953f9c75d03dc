"""EBNF building blocks for forced tool calls that are not one JSON value: a JSON schema's rules from xgrammar,
renamed under a prefix so that several schemas share one grammar (``schema_rules``, ``merge_rules``); the same
rules made to write Python literals instead of JSON (``python_literal_rules``, for the pythonic format); and the
keyword arguments of a Python call from an object schema (``kwargs_rules``, ``pythonic_arguments``).

Rules are a dict ``{name: body}`` in xgrammar's EBNF, one rule per line once joined (``grammar_text``).
"""

from __future__ import annotations

import json
import keyword
import re
from typing import Any

Rules = dict[str, str]

# One EBNF token: a string literal, a character class, a rule name, blanks, or any other single character (an
# operator, a parenthesis). Literals and classes are whole tokens, so a name inside them is never renamed.
_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z_][A-Za-z0-9_]*|\s+|.', re.DOTALL)
_SHARED_PREFIX = "basic_"  # xgrammar's rules for any JSON value: the same text in every schema's grammar

# JSON text that is not a Python literal, token by token: the keywords, and the escape "\/" (Python keeps the
# backslash). The string rule's lookahead may also see ")" (the end of a call's arguments).
_PYTHON_TOKENS = {
    '"true"': '"True"',
    '"false"': '"False"',
    '"null"': '"None"',
    r"[\"\\/bfnrt]": r"[\"\\bfnrt]",
    r"[,}\]:]": r"[,}\]:)]",
}
# "\uXXXX" outside the surrogates: Python does not pair "\ud83d\ude00" into one character as JSON does
_JSON_UNICODE_ESCAPE = '"u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]'
_PYTHON_UNICODE_ESCAPE = '"u" (([0-9A-Ca-cEFef] [0-9A-Fa-f]) | ([Dd] [0-7])) [0-9A-Fa-f] [0-9A-Fa-f]'
# the rewrites a Python grammar cannot do without: a JSON escape whose Python reading differs
_REQUIRED_PYTHON_REWRITES = (r"[\"\\/bfnrt]", _JSON_UNICODE_ESCAPE)


def literal(text: str) -> str:
    """``text`` as an EBNF string literal (JSON's escapes are xgrammar's)."""
    return json.dumps(text)


def grammar_text(root: str, rules: Rules) -> str:
    """The grammar whose root rule's body is ``root``, then ``rules``."""
    return "\n".join([f"root ::= {root}", *(f"{name} ::= {body}" for name, body in rules.items())])


def schema_rules(schema: dict[str, Any], prefix: str) -> tuple[str, Rules]:
    """(the rule matching a JSON value of ``schema`` (compact: ", " and ": " separators), its rules), every rule
    renamed ``prefix`` + its name except xgrammar's shared ``basic_*`` rules. Needs xgrammar."""
    from fnvllm.executor.structured import import_xgrammar

    xgr = import_xgrammar()
    text = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    parsed = [line.split(" ::= ", 1) for line in text.split("\n") if line.strip()]
    names = {name for name, _ in parsed}
    renamed = {_renamed(name, prefix): _rename_body(body, names, prefix) for name, body in parsed}
    return _renamed("root", prefix), renamed


def _renamed(name: str, prefix: str) -> str:
    return name if name.startswith(_SHARED_PREFIX) else prefix + name


def _rename_body(body: str, names: set[str], prefix: str) -> str:
    """``body`` with every rule name of ``names`` renamed (literals and classes untouched)."""
    return "".join(_renamed(t, prefix) if t in names else t for t in _TOKEN.findall(body))


def merge_rules(into: Rules, rules: Rules) -> Rules:
    """``into`` and ``rules`` in one dict (a new one); a name defined twice must have one body (xgrammar's
    shared rules are the same text in every schema's grammar)."""
    merged = dict(into)
    for name, body in rules.items():
        if merged.setdefault(name, body) != body:
            raise ValueError(f"grammar rule {name!r} is defined twice with different bodies")
    return merged


def python_literal_rules(rules: Rules) -> Rules:
    """``rules`` rewritten to match Python literals where they matched JSON: True / False / None for the JSON
    keywords (in enum and const lists and objects too), no "\\/" escape, no surrogate "\\u" escape, and ")"
    allowed after a string. JSON numbers, strings (so rewritten), arrays and objects are Python literals as they
    are. A ValueError when xgrammar's rules are not in the form these rewrites expect (another xgrammar
    version)."""
    out = {name: "".join(_python_token(t) for t in _TOKEN.findall(body)) for name, body in rules.items()}
    out = {name: body.replace(_JSON_UNICODE_ESCAPE, _PYTHON_UNICODE_ESCAPE) for name, body in out.items()}
    joined = "\n".join(rules.values())
    if not all(required in joined for required in _REQUIRED_PYTHON_REWRITES):
        raise ValueError("this xgrammar's JSON string rule is not in the form its Python rewrite expects")
    return out


def _python_token(token: str) -> str:
    """One EBNF token rewritten for Python: a JSON keyword or escape (``_PYTHON_TOKENS``), or a literal that is a
    whole JSON list or object (an enum or const value, which xgrammar writes as one literal) as Python text."""
    if token in _PYTHON_TOKENS:
        return _PYTHON_TOKENS[token]
    if not token.startswith('"[') and not token.startswith('"{'):
        return token
    try:
        value = json.loads(json.loads(token))
    except ValueError:  # a bracket alone, or a literal that is not JSON text
        return token
    return literal(_python_text(value)) if isinstance(value, (list, dict)) else token


def _python_text(value: Any) -> str:
    """A JSON value as Python literal text: True / False / None, strings as JSON writes them (its escapes mean
    the same in Python; characters kept as they are, so no surrogate pairs)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_python_text(k)}: {_python_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_python_text(item) for item in value) + "]"
    if value is None or isinstance(value, bool):
        return repr(value)
    return json.dumps(value, ensure_ascii=False)


def kwargs_rules(arguments: list[tuple[str, str]], required: set[str], prefix: str) -> tuple[str, Rules]:
    """(the rule matching a call's keyword arguments, its rules): ``name=value`` for each of ``arguments`` (name,
    the rule of its value) in their order, joined by ", ", each one present when it is in ``required`` and
    optional otherwise. Worked example for a (required), b (optional): "a=1" and "a=1, b=2", never "b=2".

    ``{prefix}rest_k``: arguments k.. after at least one argument (each after ", "); ``{prefix}first_k``:
    arguments k.. with none before (the first present one has no ", ")."""
    count = len(arguments)
    rules: Rules = {f"{prefix}rest_{count}": '""', f"{prefix}first_{count}": '""'}
    for k in range(count - 1, -1, -1):
        name, value = arguments[k]
        item = f"{literal(name + '=')} {value}"
        present_rest = f"{literal(', ')} {item} {prefix}rest_{k + 1}"
        present_first = f"{item} {prefix}rest_{k + 1}"
        if name in required:
            rules[f"{prefix}rest_{k}"], rules[f"{prefix}first_{k}"] = present_rest, present_first
        else:
            rules[f"{prefix}rest_{k}"] = f"({prefix}rest_{k + 1}) | ({present_rest})"
            rules[f"{prefix}first_{k}"] = f"({prefix}first_{k + 1}) | ({present_first})"
    return f"{prefix}first_0", rules


# the parameters schema's keywords the pythonic grammar writes as keyword arguments (the rest are refused)
_KWARGS_SCHEMA_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$schema"}


def pythonic_arguments(name: str, parameters: dict[str, Any] | None, prefix: str) -> tuple[str, Rules]:
    """(the rule of function ``name``'s keyword arguments, its rules, still matching JSON literals): the
    properties of its ``parameters`` schema, each ``key=value``; an object schema without properties takes any
    ``identifier=value``. A ValueError naming the parser for what keyword arguments cannot express."""
    where = f"the pythonic tool-call parser cannot force a call of {name!r}"
    schema = parameters or {"type": "object"}
    if not _is_identifier(name):
        raise ValueError(f"{where}: its name is not a Python identifier")
    refs: dict[str, Any] = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # properties may $ref them
    extra = sorted(set(schema) - _KWARGS_SCHEMA_KEYS - set(refs))
    if extra or schema.get("type", "object") != "object":
        got = f"keywords {extra}" if extra else f"type {schema['type']!r}"
        raise ValueError(f"{where}: its parameters must be an object schema of properties, got {got}")
    properties, required = schema.get("properties") or {}, schema.get("required", [])
    if not isinstance(properties, dict) or not all(isinstance(value, dict) for value in properties.values()):
        raise ValueError(f"{where}: its parameters' properties must be an object of schemas")
    for key in [*properties, *required] if isinstance(required, list) else [required]:
        if not isinstance(key, str) or not _is_identifier(key) or key not in properties:
            raise ValueError(f"{where}: property {key!r} is not a Python identifier among its properties")
    if not properties:
        return _open_kwargs(schema.get("additionalProperties", True) is not False, prefix)
    rules: Rules = {}
    arguments = []
    for index, (key, value_schema) in enumerate(properties.items()):
        value, value_rules = schema_rules({**value_schema, **refs}, f"{prefix}p{index}_")
        rules = merge_rules(rules, value_rules)
        arguments.append((key, value))
    root, kwargs = kwargs_rules(arguments, set(required), f"{prefix}kw_")
    return root, merge_rules(rules, kwargs)


def _open_kwargs(is_open: bool, prefix: str) -> tuple[str, Rules]:
    """Keyword arguments of an object schema without properties: any ``identifier=value`` when it is open,
    none when it is closed (``additionalProperties: false``)."""
    if not is_open:
        return '""', {}
    value, rules = schema_rules({}, f"{prefix}any_")
    item = f"[A-Za-z_] [A-Za-z0-9_]* {literal('=')} {value}"
    return f"{prefix}kwargs", merge_rules(rules, {f"{prefix}kwargs": f'"" | ({item} ({literal(", ")} {item})*)'})


def _is_identifier(name: str) -> bool:
    """Whether ``name`` can be a Python function or keyword-argument name."""
    return name.isidentifier() and not keyword.iskeyword(name)
