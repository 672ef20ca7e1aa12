"""The service spec file (YAML or JSON) that ``phalanx apply -f`` reads, and its published JSON Schema
(``phalanx/schemas/service.schema.json``): a document is checked against the schema, then for what a schema cannot
say (roles that do not add up, autoscaler bounds), before anything is sent. Every problem names its place in the
document (``roles[1].nodes``, ``autoscale.target``); an unknown field is a problem."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from phalanx.core.resources import parse_size

from ._errors import PhalanxError
from ._service_types import ServiceSpec

__all__ = [
    "ServiceSpecError",
    "service_schema",
    "service_spec_problems",
    "parse_service_spec",
    "load_service_spec",
    "SCHEMA_PACKAGE",
    "SCHEMA_FILE",
]

SCHEMA_PACKAGE = "phalanx.schemas"
SCHEMA_FILE = "service.schema.json"


class ServiceSpecError(PhalanxError, ValueError):
    """A service spec file or document that cannot be used: unreadable, not YAML or JSON, or not of the schema.

    Attributes:
        source: Where it came from (a file name, or "spec").
        problems: Each problem in words, prefixed with its place in the document (``replicas: 0 is less than
            the minimum of 1``).
    """

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = list(problems)
        super().__init__(f"{source}: " + "; ".join(self.problems))


@functools.cache
def _schema_text() -> str:
    return resources.files(SCHEMA_PACKAGE).joinpath(SCHEMA_FILE).read_text(encoding="utf-8")


def service_schema() -> dict[str, Any]:
    """The JSON Schema of a service spec document (a fresh copy: the caller may change it).

    Returns:
        The schema (JSON Schema draft 2020-12) as a dict.
    """
    schema: dict[str, Any] = json.loads(_schema_text())
    return schema


def _where(path: Iterator[Any] | Any) -> str:
    """``roles[1].nodes`` from a jsonschema path; ``(top level)`` for the document itself."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _describe(error: Any) -> str:
    """One schema error in words, with its place."""
    where = _where(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, Mapping):
        known = sorted(error.schema.get("properties", {}))
        unknown = sorted(str(k) for k in error.instance if k not in known)
        fields = ", ".join(repr(k) for k in unknown)
        return f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {fields} (known: {', '.join(known)})"
    if error.validator == "required" and isinstance(error.instance, Mapping):
        missing = [str(k) for k in error.validator_value if k not in error.instance]
        return f"{where}: missing required field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}"
    if error.validator in ("oneOf", "anyOf", "not") and error.schema.get("description"):
        return f"{where}: {error.instance!r:.80} is not valid: {error.schema['description']}"
    return f"{where}: {error.message}"


def service_spec_problems(doc: Any) -> list[str]:
    """What is wrong with a service spec document (a parsed YAML or JSON file), in words; empty when nothing is.

    The document is checked against :func:`service_schema` (unknown fields are problems), then for what the schema
    cannot say: roles that do not add up to ``nodes_per_replica``, an autoscaler whose ``max_replicas`` is below its
    ``min_replicas``, ``max_unavailable`` and ``max_surge`` both 0, a memory size that is not one. The scheduler
    checks the rest (tiers, queues, whether a replica fits) and answers INVALID_ARGUMENT.

    Args:
        doc: The document.

    Returns:
        The problems, each prefixed with its place in the document.
    """
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(service_schema())
    errors = sorted(validator.iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        return [_describe(e) for e in errors]
    return _semantic_problems(doc)


def _semantic_problems(doc: Mapping[str, Any]) -> list[str]:
    problems = []
    roles = doc.get("roles") or []
    nodes = doc.get("nodes_per_replica")
    total = sum(int(r["nodes"]) for r in roles)
    if roles and nodes is not None and nodes != total:
        problems.append(f"nodes_per_replica: {nodes}, but the roles have {total} nodes in all")
    names = [r["name"] for r in roles]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        problems.append(f"roles: role names must be unique; repeated: {', '.join(repeated)}")
    auto = doc.get("autoscale")
    if auto and auto["max_replicas"] < auto["min_replicas"]:
        problems.append(f"autoscale.max_replicas: {auto['max_replicas']} is below min_replicas {auto['min_replicas']}")
    if doc.get("max_unavailable", 1) == 0 and doc.get("max_surge", 0) == 0:
        problems.append("max_unavailable: 0 with max_surge 0: a rolling update could never start (raise one of them)")
    memory = doc.get("memory_per_node")
    if isinstance(memory, str):
        try:
            parse_size(memory)
        except ValueError as exc:
            problems.append(f"memory_per_node: {exc} (a number with a binary unit K, M, G, T or P)")
    return problems


def parse_service_spec(doc: Any, source: str = "spec") -> ServiceSpec:
    """A :class:`ServiceSpec` from a spec document, checked first (:func:`service_spec_problems`).

    Args:
        doc: The document (a mapping, as from :func:`yaml.safe_load`).
        source: Where it came from, for the error message.

    Returns:
        The spec.

    Raises:
        ServiceSpecError: The document has problems (all of them listed).
    """
    problems = service_spec_problems(doc)
    if problems:
        raise ServiceSpecError(source, problems)
    return ServiceSpec.from_dict(doc)


def _parse_text(text: str, source: str) -> Any:
    """One YAML (or JSON, which YAML reads too) document; a syntax error names its line and column."""
    import yaml

    if source.endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ServiceSpecError(source, [f"line {exc.lineno} column {exc.colno}: not JSON: {exc.msg}"]) from None
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ServiceSpecError(source, [f"{where}not YAML: {problem}"]) from None
    if len(docs) != 1:
        raise ServiceSpecError(source, [f"a spec file holds one document, this one holds {len(docs)}"])
    return docs[0]


def load_service_spec(path: str | os.PathLike[str] | None = None, *, text: str | None = None) -> ServiceSpec:
    """Read a service spec file (YAML, or JSON for a ``.json`` file) and check it against the schema.

    Example:
        >>> spec = load_service_spec("llm.yaml")
        >>> client.apply_service(spec)

    Args:
        path: The file.
        text: The file's content instead (``path`` then only names it in messages).

    Returns:
        The spec.

    Raises:
        ServiceSpecError: The file cannot be read, is not YAML or JSON, or has problems (all of them listed, each
            with its place in the document).
    """
    source = "spec" if path is None else os.fspath(path)
    if text is None:
        if path is None:
            raise ServiceSpecError(source, ["give a path or the text"])
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ServiceSpecError(source, [f"cannot read it: {exc}"]) from None
    return parse_service_spec(_parse_text(text, source), source)
