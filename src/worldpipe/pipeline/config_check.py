"""The pipeline config's refusals while the Snakefile is parsed: one line each, ``error: pipeline config: ...``.

The JSON schema (``workflow/schemas/config.schema.yaml``) is checked here before Snakemake's ``validate`` (which
then fills in the schema's defaults): jsonschema's own report of one bad value is a dozen lines, of a missing key
a page of schema. :func:`schema_problem` names the key path, what is wrong, and the valid range, values or keys.
:func:`refuse` ends the parse with that line and exit status 2, without Snakemake's location and traceback lines
(the line names the key; where in the Snakefile it was found says nothing a user can act on).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import yaml

from worldpipe.core.errors import ERROR_PREFIX, EXIT_USAGE, one_line


def refuse(message: str) -> NoReturn:
    """End the Snakefile's parse with ``error: <message>`` (one line) and exit status 2 (bad input)."""
    print(ERROR_PREFIX + one_line(Exception(message)), file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE)


def schema_problem(config: Mapping[str, Any], schema_file: str | Path) -> str | None:
    """The first way ``config`` breaks the JSON schema in ``schema_file``, as one line naming the key path; None
    when it conforms."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    schema = yaml.safe_load(Path(schema_file).read_text())
    error = best_match(Draft202012Validator(schema).iter_errors(dict(config)))
    return None if error is None else describe(error)


def _path(parts) -> str:
    return ".".join(str(p) for p in parts) or "(top level)"


def _range(schema: Mapping[str, Any]) -> str:
    bounds = [f"{text} {schema[key]}" for key, text in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                          ("maximum", "<="), ("exclusiveMaximum", "<"))
              if key in schema]
    return " and ".join(bounds)


def _keys(schema: Mapping[str, Any]) -> str:
    required = list(schema.get("required", []))
    optional = [key for key in schema.get("properties", {}) if key not in required]
    return f"required: {', '.join(required) or '-'}; optional: {', '.join(optional) or '-'}"


def describe(error) -> str:
    """One line for a jsonschema ``ValidationError``: the key path, what is wrong, what would be valid."""
    key, kind, schema, value = _path(error.absolute_path), error.validator, error.schema, error.instance
    if kind in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        return f"{key}: {value!r} is out of range (valid: {_range(schema)})"
    if kind == "required":
        missing = next((k for k in error.validator_value if k not in value), "?")
        return f"{key}: missing key '{missing}' ({_keys(schema)})"
    if kind == "additionalProperties":
        extra = sorted(set(value) - set(schema.get("properties", {})))
        return f"{key}: unknown key '{extra[0] if extra else '?'}' ({_keys(schema)})"
    if kind == "enum":
        return f"{key}: {value!r} is not one of {', '.join(map(str, error.validator_value))}"
    if kind == "type":
        valid = f"{schema['type']}" + (f" {_range(schema)}" if _range(schema) else "")
        return f"{key}: {value!r} is not of type {valid}"
    if kind == "pattern":
        return f"{key}: {value!r} does not match {error.validator_value!r}"
    if kind in ("minItems", "maxItems", "minLength", "maxLength", "minProperties"):
        return f"{key}: {value!r} has too {'few' if kind.startswith('min') else 'many'} entries " \
               f"({kind} {error.validator_value})"
    return f"{key}: {one_line(Exception(error.message))}"
