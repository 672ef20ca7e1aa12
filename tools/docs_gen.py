"""Generate the reference pages of the documentation site from the code, so that they cannot drift.

Three generators, each a pure function from the repository to Markdown, used by the MkDocs hook
(`tools/docs_hooks.py`) at build time and by the docs tests (`tests/unit/test_docs.py`):

- `cli_reference()`: every command of `phalanx` and of the three service entry points, walked from their argparse
  parsers (`phalanx.cli.main.build_parser()`, and the parser that each service's `main` module builds);
- `grpc_reference(proto_dir)`: one page per `.proto` file, its services' RPCs and its messages and enums with their
  fields and comments, parsed from the proto source;
- `module_map(root)`: every module of the packages with the first line of its docstring and its size, read with
  `ast` (nothing is imported), grouped by service and package;
- `service_schema_page(root)`: the service spec file's fields, from its JSON Schema
  (`phalanx/schemas/service.schema.json`), which the site also publishes as a file (`generated_files`).

`python tools/docs_gen.py OUT_DIR` writes the pages to OUT_DIR, to read them without MkDocs.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------------------- CLI


# The command-line programs documented, in order: (title, module, the console script's name). Each module is asked
# for its parser by name: `build_parser()` when it has one, else the parser its `parse_args([])` builds.
PROGRAMS: list[tuple[str, str, str]] = [
    ("phalanx", "phalanx.cli.main", "phalanx"),
    ("phalanx-scheduler", "services.scheduler.main", "phalanx-scheduler"),
    ("phalanx-agent", "services.node_agent.main", "phalanx-agent"),
    ("phalanx-checkpointd", "services.checkpoint_coordinator.main", "phalanx-checkpointd"),
]


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("captured")
        self.parser = parser


def _capture_parser(fn: Callable[..., object]) -> argparse.ArgumentParser:
    """The first parser that `fn([])` asks to parse its arguments (it is stopped there: nothing runs)."""
    original = argparse.ArgumentParser.parse_known_args

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> object:
        if self.add_help:  # a pre-parser without --help (e.g. for --config) is not the program's parser
            raise _Captured(self)
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    argparse.ArgumentParser.parse_known_args = capture  # type: ignore[assignment,method-assign]
    try:
        fn([])
    except _Captured as captured:
        return captured.parser
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
    raise RuntimeError(f"{fn!r} parsed no arguments")


def program_parser(module_name: str) -> argparse.ArgumentParser:
    """The argparse parser of a program's entry module: its `build_parser()`, else the one `parse_args` builds.

    Built with no PHALANX_* variable in the environment, so that the defaults shown are the code's, not the
    builder's (several flags default to an environment variable).
    """
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("PHALANX_")}
    try:
        return _program_parser(module_name)
    finally:
        os.environ.update(saved)


def _program_parser(module_name: str) -> argparse.ArgumentParser:
    module = importlib.import_module(module_name)
    build = getattr(module, "build_parser", None)
    if callable(build):
        parser = build()
        if isinstance(parser, argparse.ArgumentParser):
            return parser
    # Else the parser the module's own parsing function builds, or, last, the one `main([])` parses with (stopped
    # at the parse, so nothing runs), so that a refactoring of the flags cannot hide a program from the reference.
    for name in ("parse_args", "_parse_args", "parse", "main"):
        fn = getattr(module, name, None)
        if callable(fn):
            return _capture_parser(fn)
    raise RuntimeError(f"{module_name} has no build_parser(), parse_args() or main()")


def walk_commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """(command path, parser, one-line help) for the parser and every subcommand below it, depth first."""
    yield path, parser, ""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:  # an alias
                    continue
                seen.add(id(sub))
                for sub_path, sub_parser, sub_help in walk_commands(sub, (*path, name)):
                    yield sub_path, sub_parser, sub_help or (helps.get(name, "") if sub_path == (*path, name) else "")


def _escape(text: str) -> str:
    for char in "\\`*_[]<>|":
        text = text.replace(char, "\\" + char)
    return text


def _md(text: str) -> str:
    """Plain text (a help string, a comment, a docstring's line) as safe inline Markdown, in a table cell too.

    Code spans (`...`, when the backticks pair up) are kept as code; everything else is escaped.
    """
    text = " ".join(text.split())
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: no code spans
        return _escape(text)
    return "".join(_escape(p) if i % 2 == 0 else f"`{p}`" for i, p in enumerate(parts))


def _anchor(path: tuple[str, ...]) -> str:
    return "-".join(re.sub(r"[^a-z0-9]+", "-", p.lower()).strip("-") for p in path)


def _format_option(action: argparse.Action) -> str:
    if not action.option_strings:
        return action.metavar if isinstance(action.metavar, str) else action.dest
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    formatter = argparse.HelpFormatter("x")
    metavar = formatter._format_args(action, action.dest.upper())  # type: ignore[attr-defined]
    return ", ".join(f"{o} {metavar}" for o in action.option_strings)


def _help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    try:
        return str(parser._get_formatter()._expand_help(action))  # type: ignore[attr-defined]
    except (KeyError, TypeError, ValueError):
        return action.help


def command_section(path: tuple[str, ...], parser: argparse.ArgumentParser, summary: str, level: int) -> str:
    """One command's Markdown: heading, summary, usage, positional arguments and options."""
    lines = [f"{'#' * level} {' '.join(path)} {{ #{_anchor(path)} }}", ""]
    text = parser.description or summary
    if text:
        lines += [_md(text), ""]
    usage = " ".join(parser.format_usage().split())
    lines += ["```text", usage.removeprefix("usage: "), "```", ""]
    positionals, options, commands = [], [], []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                commands.append(f"- [`{choice.dest}`](#{_anchor((*path, choice.dest))}): {_md(choice.help or '')}")
            continue
        entry = f"- `{_format_option(action)}`"
        help_text = _help_of(parser, action)
        if help_text:
            entry += f": {_md(help_text)}"
        default = action.default
        shown = default not in (None, False, argparse.SUPPRESS, [], "") and "default" not in (action.help or "")
        if shown and action.nargs != 0:
            entry += f" (default: `{default}`)"
        if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
            entry += " (one of: " + ", ".join(f"`{c}`" for c in action.choices) + ")"
        (options if action.option_strings else positionals).append(entry)
    if commands:
        lines += ["Commands:", "", *commands, ""]
    if positionals:
        lines += ["Arguments:", "", *positionals, ""]
    if options:
        lines += ["Options:", "", *options, ""]
    return "\n".join(lines)


def cli_commands() -> list[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every documented command path, with its parser and one-line help, across the four programs."""
    found = []
    for _title, module, prog in PROGRAMS:
        found.extend(walk_commands(program_parser(module), (prog,)))
    return found


def cli_reference() -> str:
    """The CLI reference page: every program and subcommand, from the parsers themselves."""
    out = [
        "# CLI reference",
        "",
        "Generated at build time from the argparse parsers (`tools/docs_gen.py`), so it says exactly what",
        "`--help` says. For what the commands do and how they combine, see the [CLI guide](cli-guide.md).",
        "",
    ]
    for title, module, prog in PROGRAMS:
        parser = program_parser(module)
        out += [f"## {title} {{ #{_anchor((prog,))} }}", "", f"Entry point: `{module}`.", ""]
        for path, sub, summary in walk_commands(parser, (prog,)):
            if len(path) == 1:
                out.append(command_section(path, sub, summary, 3).split("\n", 2)[2])
            else:
                out.append(command_section(path, sub, summary, min(len(path) + 1, 6)))
    return "\n".join(out).rstrip() + "\n"


# --------------------------------------------------------------------------------------------------------- gRPC


@dataclass
class ProtoField:
    label: str  # "", "repeated", "optional", "map<...>" is in type
    type: str
    name: str
    number: str
    comment: str
    oneof: str = ""


@dataclass
class ProtoType:
    kind: str  # "message" or "enum"
    name: str  # dotted for nested types: Outer.Inner
    comment: str
    fields: list[ProtoField] = field(default_factory=list)


@dataclass
class ProtoRpc:
    name: str
    request: str
    response: str
    client_stream: bool
    server_stream: bool
    comment: str


@dataclass
class ProtoService:
    name: str
    comment: str
    rpcs: list[ProtoRpc] = field(default_factory=list)


@dataclass
class ProtoFile:
    path: Path
    package: str
    comment: str
    services: list[ProtoService] = field(default_factory=list)
    types: list[ProtoType] = field(default_factory=list)


_RPC = re.compile(
    r"rpc\s+(\w+)\s*\(\s*(stream\s+)?([\w.]+)\s*\)\s*returns\s*\(\s*(stream\s+)?([\w.]+)\s*\)\s*(?:;|\{\s*\}?)"
)
_FIELD = re.compile(r"(repeated\s+|optional\s+)?(map\s*<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*(\d+)[^;]*;")
_ENUM_VALUE = re.compile(r"(\w+)\s*=\s*(-?\d+)[^;]*;")


def parse_proto(path: Path) -> ProtoFile:
    """A proto3 file's services, messages and enums, with the `//` comments above or beside each element."""
    result = ProtoFile(path=path, package="", comment="")
    stack: list[tuple[str, object]] = []  # ("message"|"enum"|"service"|"oneof"|"other", object)
    pending: list[str] = []
    header_done = False
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("//"):
            pending.append(line[2:].strip())
            continue
        code, _, trailing = line.partition("//")
        code, trailing = code.strip(), trailing.strip()
        if not code:
            if pending and not header_done and not stack and not result.services and not result.types:
                pass  # a blank line inside the file's leading comment block
            continue
        comment = " ".join([*pending, trailing]).strip()
        pending = []
        if re.match(r"(syntax|import|option)\b", code):
            continue
        if code.startswith("package"):
            result.package = code.split()[1].rstrip(";")
            if comment:
                result.comment = comment
            header_done = True
            continue
        header_done = True
        scope = [obj.name for kind, obj in stack if kind in ("message", "enum") and isinstance(obj, ProtoType)]
        if match := re.match(r"(message|enum|service|oneof)\s+(\w+)\s*\{(.*)$", code):
            kind, name, rest = match.groups()
            obj: object
            if kind == "service":
                obj = ProtoService(name=name, comment=comment)
                result.services.append(obj)
            elif kind == "oneof":
                obj = name
            else:
                obj = ProtoType(kind=kind, name=".".join([*scope, name]), comment=comment)
                result.types.append(obj)
            stack.append((kind, obj))
            rest = rest.strip()
            if rest:  # a one-line body: `message X { string a = 1; }`
                _parse_body_line(stack, rest, "")
            if rest.endswith("}"):
                stack.pop()
            continue
        if code.startswith("}"):
            if stack:
                stack.pop()
            continue
        if re.match(r"\w+(\s+\w+)*\s*\{", code) and not code.startswith("rpc"):
            stack.append(("other", None))  # e.g. an `option` block
            continue
        _parse_body_line(stack, code, comment)
    return result


def _parse_body_line(stack: list[tuple[str, object]], code: str, comment: str) -> None:
    if not stack:
        return
    oneof = ""
    kind, obj = stack[-1]
    if kind == "oneof":
        oneof = str(obj)
        owner = next((o for k, o in reversed(stack) if k == "message"), None)
        kind, obj = "message", owner
    if kind == "service" and isinstance(obj, ProtoService):
        if m := _RPC.search(code):
            obj.rpcs.append(ProtoRpc(m[1], m[3], m[5], bool(m[2]), bool(m[4]), comment))
    elif kind == "message" and isinstance(obj, ProtoType):
        for m in _FIELD.finditer(code):
            if m[2] in ("reserved", "option"):
                continue
            obj.fields.append(ProtoField((m[1] or "").strip(), m[2].replace(" ", ""), m[3], m[4], comment, oneof))
    elif kind == "enum" and isinstance(obj, ProtoType):
        for m in _ENUM_VALUE.finditer(code):
            if m[1] in ("option", "reserved"):
                continue
            obj.fields.append(ProtoField("", "", m[1], m[2], comment))


def _type_anchor(name: str) -> str:
    return "t-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def grpc_reference(proto_dir: Path) -> dict[str, str]:
    """{page name: Markdown}: one page per `.proto` file, and an index; types link across the pages."""
    files = [parse_proto(p) for p in sorted(proto_dir.rglob("*.proto"))]
    where: dict[str, str] = {}
    for f in files:
        for t in f.types:
            where[t.name] = f"{f.path.stem}.md"

    def link(type_name: str, page: str, scope: str = "") -> str:
        name = type_name.split(".", 1)[1] if type_name.startswith(("phalanx.v1.", ".phalanx.v1.")) else type_name
        candidates = [f"{scope}.{name}"] if scope else []
        candidates.append(name)
        for cand in candidates:
            if cand in where:
                target = "" if where[cand] == page else where[cand]
                return f"[`{type_name}`]({target}#{_type_anchor(cand)})"
        return f"`{type_name}`"

    pages: dict[str, str] = {}
    index = [
        "# gRPC API reference",
        "",
        "Generated at build time from the `.proto` files in `proto/` (`tools/docs_gen.py`): every service, RPC,",
        "message, field and enum, with the comments of the source. The Python modules generated from the same files",
        "are in `phalanx/api/v1/`. What each status code means to a caller is on [Status codes](../status-codes.md).",
        "",
    ]
    for f in files:
        page = f"{f.path.stem}.md"
        rel = f.path.relative_to(proto_dir.parent) if proto_dir.parent in f.path.parents else f.path
        services = ", ".join(s.name for s in f.services) or "shared messages and enums"
        index.append(f"- [`{rel}`]({page}): {services}")
        out = [f"# {f.path.name}", "", f"Source: `{rel}`, package `{f.package}`.", ""]
        if f.comment:
            out += [_md(f.comment), ""]
        for svc in f.services:
            out += [f"## service {svc.name} {{ #{_type_anchor('service-' + svc.name)} }}", ""]
            if svc.comment:
                out += [_md(svc.comment), ""]
            out += ["| RPC | Request | Response | |", "|---|---|---|---|"]
            for rpc in svc.rpcs:
                req = ("stream " if rpc.client_stream else "") + link(rpc.request, page)
                resp = ("stream " if rpc.server_stream else "") + link(rpc.response, page)
                out.append(f"| `{rpc.name}` | {req} | {resp} | {_md(rpc.comment)} |")
            out.append("")
        messages = [t for t in f.types if t.kind == "message"]
        enums = [t for t in f.types if t.kind == "enum"]
        for title, group in (("Messages", messages), ("Enums", enums)):
            if not group:
                continue
            out += [f"## {title}", ""]
            for t in group:
                out += [f"### {t.name} {{ #{_type_anchor(t.name)} }}", ""]
                if t.comment:
                    out += [_md(t.comment), ""]
                if not t.fields:
                    out += ["(no fields)", ""]
                    continue
                scope = t.name
                if t.kind == "message":
                    out += ["| Field | Number | Type | |", "|---|---|---|---|"]
                    for fl in t.fields:
                        label = f"{fl.label} " if fl.label else ""
                        note = f"(oneof `{fl.oneof}`) " if fl.oneof else ""
                        typ = label + link(fl.type, page, scope)
                        out.append(f"| `{fl.name}` | {fl.number} | {typ} | {note}{_md(fl.comment)} |")
                else:
                    out += ["| Value | Number | |", "|---|---|---|"]
                    for fl in t.fields:
                        out.append(f"| `{fl.name}` | {fl.number} | {_md(fl.comment)} |")
                out.append("")
        pages[page] = "\n".join(out).rstrip() + "\n"
    pages["index.md"] = "\n".join(index) + "\n"
    return pages


# ---------------------------------------------------------------------------------------------------- Module map


# The rooms of the code base, in reading order: (title, package directory, what it is for).
ROOMS: list[tuple[str, str, str]] = [
    ("Scheduler", "services/scheduler", "`phalanx-scheduler`: the job API, the scheduling cycle, the ledger"),
    ("Node agent", "services/node_agent", "the `phalanx-agent` service: a GPU host's discovery, ranks and health"),
    ("Checkpoint coordinator", "services/checkpoint_coordinator", "the `phalanx-checkpointd` service"),
    ("Shared service code", "services/common", "what the three services share: server, auth, errors, metrics"),
    ("Core", "phalanx/core", "the pure scheduling core: placement, decision, preemption, quotas (no I/O)"),
    ("SDK", "phalanx/client", "the Python SDK: `Client`, `AsyncClient`, typed results, errors, service spec files"),
    ("CLI", "phalanx/cli", "the `phalanx` command"),
    ("Rank library", "phalanx/train", "`phalanx.train`: checkpoints from training code"),
    ("Shared client code", "phalanx/common", "what the CLI and the services share"),
    ("Schemas", "phalanx/schemas", "published JSON Schemas of spec files (data): `service.schema.json`"),
    ("Simulated hosts", "phalanx/simhost", "simulated GPU hosts below the real interfaces (NVML, sysfs, MPS)"),
    ("Simulator", "phalanx/sim", "`phalanx sim`: trace replay through the scheduling core"),
    ("Web dashboard", "phalanx/web", "`phalanx web`"),
    ("Test support", "phalanx/testing", "protocol-level agents for tests and benchmarks"),
    ("Examples", "phalanx/examples", "example rank programs"),
    ("Database", "db", "SQLAlchemy models, engine set-up, migrations entry point"),
]


@dataclass
class ModuleInfo:
    name: str  # dotted
    path: Path
    lines: int
    summary: str


def first_line(doc: str | None) -> str:
    """The first sentence-line of a docstring (its first paragraph's first line, joined if it wraps mid-sentence)."""
    if not doc:
        return ""
    para = doc.strip().split("\n\n", 1)[0]
    return " ".join(para.split())


def modules_under(root: Path, package_dir: str) -> list[ModuleInfo]:
    """Every module of a package directory, recursively (generated `_pb2` code left out), in name order."""
    base = root / package_dir
    found = []
    for path in sorted(base.rglob("*.py")):
        if "_pb2" in path.name or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        text = path.read_text(encoding="utf-8")
        try:
            doc = ast.get_docstring(ast.parse(text))
        except SyntaxError:
            doc = None
        found.append(ModuleInfo(".".join(parts), path, text.count("\n"), first_line(doc)))
    return found


def module_map(root: Path = ROOT) -> str:
    """The module map page: per room, each module, its size and its docstring's first line."""
    out = [
        "# Module map",
        "",
        "Generated at build time from the code (`tools/docs_gen.py`): every module of each room, its size in lines",
        "and the first line of its docstring. Nothing here is written by hand, so it follows every move; a module",
        "without a docstring shows *(no docstring)*. The rooms and how they talk are on",
        "[Architecture](index.md).",
        "",
    ]
    seen: set[str] = set()
    for title, package_dir, role in ROOMS:
        if not (root / package_dir).is_dir():
            continue
        mods = modules_under(root, package_dir)
        seen.update(m.name for m in mods)
        total = sum(m.lines for m in mods)
        out += [
            f"## {title}: `{package_dir}/` {{ #{_anchor((package_dir,))} }}",
            "",
            f"{role[0].upper()}{role[1:]}. {len(mods)} modules, {total:,} lines.",
            "",
            "| Module | Lines | What it holds |",
            "|---|---:|---|",
        ]
        for m in mods:
            out.append(f"| `{m.name}` | {m.lines:,} | {_md(m.summary) if m.summary else '*(no docstring)*'} |")
        out.append("")
    others = [
        m
        for top in ("phalanx", "services")
        for m in modules_under(root, top)
        if m.name not in seen and m.name.count(".") <= 1
    ]
    if others:
        out += ["## Other modules", "", "| Module | Lines | What it holds |", "|---|---:|---|"]
        for m in others:
            out.append(f"| `{m.name}` | {m.lines:,} | {_md(m.summary) if m.summary else '*(no docstring)*'} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


# ------------------------------------------------------------------------------------------ service spec schema

SERVICE_SCHEMA = Path("phalanx") / "schemas" / "service.schema.json"
SCHEMA_SECTIONS = ("role", "ready_probe", "autoscale")  # the schema's objects with a section of their own


def _schema_type(prop: dict, defs: dict) -> str:
    """A property's type in words: `integer`, `string`, `list of role`, `integer or string`..."""
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[1]
        target = defs.get(name, {})
        return f"[{name}](#{name.replace('_', '-')})" if name in SCHEMA_SECTIONS else _schema_type(target, defs)
    if "oneOf" in prop:
        return " or ".join(dict.fromkeys(_schema_type(p, defs) for p in prop["oneOf"]))
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{prop['const']}`"
    if prop.get("type") == "array":
        return "list of " + _schema_type(prop.get("items", {}), defs)
    if prop.get("type") == "object" and isinstance(prop.get("additionalProperties"), dict):
        return "map of " + _schema_type(prop["additionalProperties"], defs)
    kind = prop.get("type", "any")
    return " or ".join(kind) if isinstance(kind, list) else str(kind)


def _schema_limits(prop: dict) -> str:
    words = []
    for key, text in (("minimum", ">= {}"), ("exclusiveMinimum", "> {}"), ("maximum", "<= {}")):
        if key in prop:
            words.append(text.format(prop[key]))
    if "pattern" in prop:
        words.append(f"`{prop['pattern']}`")
    return ", ".join(words)


def _schema_table(schema: dict, defs: dict) -> list[str]:
    required = set(schema.get("required", ()))
    rows = ["| Field | Type | Required | Limits | What it is |", "|---|---|---|---|---|"]
    for name, prop in schema.get("properties", {}).items():
        target = defs.get(prop["$ref"].rsplit("/", 1)[1], {}) if "$ref" in prop else {}
        about = prop.get("description") or target.get("description", "")
        rows.append(
            f"| `{name}` | {_schema_type(prop, defs)} | {'yes' if name in required else ''} | "
            f"{_schema_limits(prop)} | {_md(about)} |"
        )
    return rows


def service_schema_page(root: Path = ROOT) -> str:
    """The reference page of the service spec file, generated from its JSON Schema."""
    import json

    text = (root / SERVICE_SCHEMA).read_text(encoding="utf-8")
    schema = json.loads(text)
    defs = schema.get("$defs", {})
    out = [
        "# Service spec schema",
        "",
        "The fields of a service spec file, the YAML or JSON file that `phalanx apply -f FILE` reads (see",
        "[Serving](../guides/serving.md)). Generated at build time from its JSON Schema (draft 2020-12), which ships",
        f"in the package as `{SERVICE_SCHEMA.as_posix()}` and is published with this site as",
        "[service.schema.json](../schemas/service.schema.json): point an editor at it (`$schema`, or",
        "`# yaml-language-server: $schema=...`). `phalanx apply` checks a file against it before anything is sent, and",
        "names each problem's place (`roles[1].nodes`); a field it does not know is an error.",
        "",
        _md(schema.get("description", "")),
        "",
        *_schema_table(schema, defs),
        "",
    ]
    for name in SCHEMA_SECTIONS:
        if name in defs:
            out += [f"## {name} {{ #{name.replace('_', '-')} }}", "", _md(defs[name].get("description", "")), ""]
            out += [*_schema_table(defs[name], defs), ""]
    out += ["## The schema", "", "```json", text.rstrip(), "```", ""]
    return "\n".join(out)


def generated_files(root: Path = ROOT) -> dict[str, str]:
    """{path under docs/: content} of the files (not pages) the site publishes: the service spec schema."""
    return {"schemas/service.schema.json": (root / SERVICE_SCHEMA).read_text(encoding="utf-8")}


# ---------------------------------------------------------------------------------------------------------- main


def generated_pages(root: Path = ROOT) -> dict[str, str]:
    """{path under docs/: Markdown} of every generated page."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    pages = {
        "reference/cli.md": cli_reference(),
        "architecture/modules.md": module_map(root),
        "reference/service-schema.md": service_schema_page(root),
    }
    for name, text in grpc_reference(root / "proto").items():
        pages[f"reference/grpc/{name}"] = text
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the generated reference pages to a directory.")
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    for rel, text in {**generated_pages(), **generated_files()}.items():
        target = args.out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        print(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
