"""The documentation: its generated references match the code, and the commands it shows are real.

What runs for real here, and what does not (the rest is in tests/e2e/test_docs_getting_started.py):
- every `phalanx ...` / `phalanx-<service> ...` command in a fenced shell block of the README or of any page in
  docs/ is parsed by the program's own argparse parser (nothing executes): a verb, flag or value the code does not
  take fails the test;
- the `--help` of every verb those blocks use, and of the programs behind `./scripts/demo` (`phalanx demo`), is run
  as a process: cheap, and it proves the console scripts start;
- `./scripts/demo` and `./scripts/test` themselves are NOT run here: the demo (`phalanx demo`) runs a cluster of 8
  agents through 7 jobs and a preemption, 33 s on the 2-core build machine without torch (more with torch's eighth
  job): tests/e2e/test_demo.py runs it; the test command is the whole suite (CI runs it). Here both are checked to
  exist, to be executable, to parse (`bash -n`) and to run what the docs say;
- the README's Python example and the getting-started page's cluster session start real clusters: they run in
  tests/e2e/test_docs_getting_started.py (slow);
- the strict site build (`mkdocs build --strict`) is not a test: `scripts/lint` runs it (and CI runs scripts/lint).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import docs_gen  # tools/ is not a package: found through the path above

PROGRAMS = {prog: module for _title, module, prog in docs_gen.PROGRAMS}
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


# ------------------------------------------------------------------------------------------ documented commands


def shell_blocks(path: Path) -> list[str]:
    """The fenced ```bash / ```sh / ```shell blocks of a Markdown file."""
    return re.findall(r"^```(?:bash|sh|shell|console)\n(.*?)^```", path.read_text(encoding="utf-8"), re.S | re.M)


def commands_in(block: str) -> list[list[str]]:
    """Every command of a Phalanx program in a shell block, as argv (program first), with `$VAR`s as placeholders.

    Continuation lines are joined; a command starts a line or follows `(`, `|`, `;`, `&&` or `&`, and ends at one of
    them or at the end of the line (quotes respected); comments are dropped.
    """
    found = []
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] | None = None
        start = skip = False
        start = True
        for token in lexer:
            if skip:  # a redirection's target
                skip = False
                continue
            if token in (">", ">>", "<", "2>", "&>"):
                skip = True
                continue
            if token in ("(", "|", ";", "&&", "&", ")", "||"):
                if current:
                    found.append(current)
                current, start = None, True
                continue
            if start and "=" in token and not token.startswith("-"):  # VAR=value before a command
                continue
            if start:
                name = token.removeprefix(".venv/bin/")
                current = [name] if name in PROGRAMS else None
                start = False
                continue
            if current is not None:
                current.append("X" if token.startswith("$") else token)
        if current:
            found.append(current)
    return found


def documented_commands() -> list[tuple[str, list[str]]]:
    out = []
    for path in DOC_FILES:
        for block in shell_blocks(path):
            for argv in commands_in(block):
                out.append((str(path.relative_to(ROOT)), argv))
    return out


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    return {prog: docs_gen.program_parser(module) for prog, module in PROGRAMS.items()}


def test_the_docs_show_commands_of_every_program():
    progs = {argv[0] for _where, argv in documented_commands()}
    assert {"phalanx", "phalanx-scheduler"} <= progs, progs
    where = {w for w, _argv in documented_commands()}
    assert {"README.md", "docs/getting-started.md"} <= where, where


# Documented commands that the CLI refuses today, each for a bug in the CLI, not in the docs (strict: when the bug is
# fixed the test says so, and the entry goes).
KNOWN_BROKEN: dict[tuple[str, ...], str] = {}  # documented commands the parser refuses (none now)


def _documented_cases() -> list:
    cases = []
    for where, argv in documented_commands():
        why = KNOWN_BROKEN.get(tuple(argv))
        marks = [pytest.mark.xfail(reason=why, strict=True)] if why else []
        cases.append(pytest.param(where, argv, marks=marks, id=f"{where}: {' '.join(argv)}"))
    return cases


@pytest.mark.parametrize("where,argv", _documented_cases())
def test_documented_command_parses(where, argv, parsers, capsys):
    parser = parsers[argv[0]]
    try:
        parser.parse_args(argv[1:])
    except SystemExit as exc:
        if exc.code not in (0, None):  # 0: a --help or --version form
            pytest.fail(f"{where}: `{' '.join(argv)}` is refused by the parser: {capsys.readouterr().err.strip()}")


def _verbs(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """The subcommand path of an argv, e.g. ['phalanx', 'quota', 'set'] (options before the verb skipped)."""
    path = [argv[0]]
    args = argv[1:]
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return path
        words = [a for a in args if not a.startswith("-")]
        choice = next((w for w in words if w in subs[0].choices), None)
        if choice is None:
            return path
        path.append(choice)
        parser = subs[0].choices[choice]
        args = args[args.index(choice) + 1 :]


def test_help_of_every_documented_verb_runs(parsers):
    """The cheap forms for real: `--help` of each verb the README and the getting-started page use, as processes."""
    paths = set()
    for where, argv in documented_commands():
        if where in ("README.md", "docs/getting-started.md"):
            paths.add(tuple(_verbs(argv, parsers[argv[0]])))
    paths.add(("phalanx", "demo"))  # what ./scripts/demo runs
    assert len(paths) >= 5, paths
    for path in sorted(paths):
        module = PROGRAMS[path[0]]
        proc = subprocess.run(
            [sys.executable, "-m", module, *path[1:], "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert proc.returncode == 0, (path, proc.stderr[-2000:])
        assert proc.stdout.startswith("usage: " + " ".join(path)), (path, proc.stdout[:200])


def test_the_two_commands_exist_and_run_what_the_docs_say():
    """./scripts/demo and ./scripts/test are not run here (a minute-long cluster; the whole suite): checked instead."""
    for doc in (ROOT / "README.md", ROOT / "docs" / "getting-started.md"):
        text = doc.read_text(encoding="utf-8")
        assert "./scripts/demo" in text and "./scripts/test" in text, doc
    for name in ("demo", "test", "lint", "setup"):
        script = ROOT / "scripts" / name
        assert script.is_file() and script.stat().st_mode & 0o111, script
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    assert re.search(r'exec .*/phalanx" demo "\$@"', (ROOT / "scripts" / "demo").read_text())
    assert re.search(r"-m pytest", (ROOT / "scripts" / "test").read_text())
    assert 'mkdocs" build --strict' in (ROOT / "scripts" / "lint").read_text()


# ---------------------------------------------------------------------------------------------- CLI reference


def _all_paths(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    out = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.extend(_all_paths(sub, (*path, name)))
    return out


def test_every_cli_verb_and_flag_is_in_the_generated_reference(parsers):
    reference = docs_gen.cli_reference()
    missing = []
    for prog, parser in parsers.items():
        for path in _all_paths(parser, (prog,)):
            title = " ".join(path)
            if len(path) > 1 and not re.search(rf"^#+ {re.escape(title)} {{ #", reference, re.M):
                missing.append(title)
        for action in parser._actions:
            for option in action.option_strings:
                if option not in reference:
                    missing.append(f"{prog} {option}")
    assert not missing, missing
    # and each subcommand's own flags sit in its section
    section = reference.split("### phalanx submit {", 1)[1].split("\n### ", 1)[0]
    for flag in ("--replicas", "--gpus-per-replica", "--priority", "--mig", "--gpu-milli", "--time-limit"):
        assert f"`{flag}" in section, flag


def test_service_parsers_are_found_by_name():
    for prog, module in PROGRAMS.items():
        parser = docs_gen.program_parser(module)
        assert parser.prog == prog, (module, parser.prog)
        assert any("--help" in a.option_strings for a in parser._actions)


# --------------------------------------------------------------------------------------------- gRPC reference


def test_the_proto_parser_agrees_with_the_generated_descriptors():
    from phalanx.api.v1 import agent_pb2, checkpoint_pb2, common_pb2, scheduler_pb2

    for module in (agent_pb2, checkpoint_pb2, common_pb2, scheduler_pb2):
        file = docs_gen.parse_proto(ROOT / "proto" / module.DESCRIPTOR.name)
        types = {t.name: t for t in file.types}

        def check(descriptors, prefix: str, types=types) -> None:
            for message in descriptors:
                if message.GetOptions().map_entry:
                    continue
                name = prefix + message.name
                assert [f.name for f in types[name].fields] == [f.name for f in message.fields], name
                assert [f.number for f in types[name].fields] == [str(f.number) for f in message.fields], name
                for enum in message.enum_types:
                    assert [v.name for v in types[f"{name}.{enum.name}"].fields] == [v.name for v in enum.values]
                check(message.nested_types, name + ".")

        check(module.DESCRIPTOR.message_types_by_name.values(), "")
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            assert [v.name for v in types[enum.name].fields] == [v.name for v in enum.values], enum.name
        services = {s.name: s for s in file.services}
        assert set(services) == set(module.DESCRIPTOR.services_by_name)
        for service in module.DESCRIPTOR.services_by_name.values():
            rpcs = services[service.name].rpcs
            assert [r.name for r in rpcs] == [m.name for m in service.methods]
            for rpc, method in zip(rpcs, service.methods):
                assert rpc.request.split(".")[-1] == method.input_type.name
                assert rpc.response.split(".")[-1] == method.output_type.name
                assert rpc.server_stream == method.server_streaming


def test_grpc_reference_has_a_page_per_proto_with_every_rpc():
    pages = docs_gen.grpc_reference(ROOT / "proto")
    assert set(pages) == {"index.md", "agent.md", "checkpoint.md", "common.md", "scheduler.md", "service.md"}
    assert "| `SubmitJob` |" in pages["scheduler.md"] and "### JobSpec {" in pages["common.md"]
    assert "Idempotency key" in pages["scheduler.md"]  # a field's comment comes along


# --------------------------------------------------------------------------------------------------- Module map


def test_module_map_lists_every_module_with_its_docstring():
    text = docs_gen.module_map(ROOT)
    for top in ("services/scheduler", "services/node_agent", "services/checkpoint_coordinator", "phalanx/core"):
        for info in docs_gen.modules_under(ROOT, top):
            assert f"| `{info.name}` |" in text, info.name
    assert "| `phalanx.core.decide` |" in text
    assert "## Scheduler: `services/scheduler/`" in text and "## SDK: `phalanx/client/`" in text


# ------------------------------------------------------------------------------------------ Status codes, README


def test_every_status_code_the_services_use_is_documented():
    page = (ROOT / "docs" / "reference" / "status-codes.md").read_text(encoding="utf-8")
    used = set()
    for path in (ROOT / "services").rglob("*.py"):
        used |= set(re.findall(r"StatusCode\.([A-Z_]+)", path.read_text(encoding="utf-8")))
    assert {"INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE"} <= used
    for code in sorted(used):
        assert f"`{code}`" in page or f"# {code}" in page, f"{code} is not on status-codes.md"
    # and every SDK error class named there exists
    import phalanx.client as sdk

    for name in re.findall(r"`(\w+Error)`", page):
        if name not in ("RPCError", "CheckpointRejectedError"):
            assert hasattr(sdk, name), name
    for code in grpc.StatusCode:
        if f"`{code.name}`" in page and code.name in used:
            assert f"### {code.name}" in page or code.name in ("ALREADY_EXISTS", "ABORTED", "UNIMPLEMENTED")


def test_every_core_status_code_is_documented():
    from phalanx.core.status import Code

    page = (ROOT / "docs" / "reference" / "status-codes.md").read_text(encoding="utf-8")
    table = page.split("## Why a job waits", 1)[1]
    for code in Code:
        assert f"| `{code.name}` |" in table, code


def test_the_service_spec_files_the_docs_show_are_valid():
    """Every YAML block of the README and the serving guide that is a service spec passes the published schema."""
    import yaml

    from phalanx.client import service_spec_problems

    specs = []
    for doc in (ROOT / "README.md", ROOT / "docs" / "guides" / "serving.md"):
        for block in re.findall(r"^```yaml\n(.*?)^```", doc.read_text(encoding="utf-8"), re.S | re.M):
            loaded = yaml.safe_load(block)
            if isinstance(loaded, dict) and "replicas" in loaded:
                specs.append(loaded)
    assert len(specs) >= 2
    for spec in specs:
        assert service_spec_problems(spec) == [], spec


def test_readme_is_short_and_links_into_the_site():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < 200
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", text)
    assert len(links) >= 10
    for link in links:
        assert (ROOT / link).is_file(), link


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in (ROOT / "docs").rglob("*.md"):
        assert str(page.relative_to(ROOT / "docs")) in nav, page
    for generated in docs_gen.generated_pages(ROOT):
        assert generated in nav, generated
        assert not (ROOT / "docs" / generated).exists(), f"{generated} is generated: do not commit it"


# Flags the docs name that belong to other programs than Phalanx's own (whose flags are read from their parsers, and
# from the add_argument calls of bench/ and phalanx/examples/).
OTHER_TOOLS_FLAGS = {
    "--build": "docker compose up --build",
    "--cert": "kubectl create secret tls",
    "--key": "kubectl create secret tls",
    "--from-file": "kubectl create secret generic",
    "--check": "ruff format --check",
    "--fix": "scripts/lint --fix (ruff's)",
    "--strict": "mkdocs build --strict",
    "--test-only": "Slurm's sbatch --test-only, for comparison",
    "--no-shell": "Slurm's salloc --no-shell, timed by bench/peers.py",
    "--fast": "a user's own eval.py in an SDK example",
    "--tls-": "the prefix of --tls-ca/--tls-cert/--tls-key in prose",
    "--head": "ray start --head, in the serving guide's vLLM script",
    "--block": "ray start --block, in the serving guide's vLLM script",
    "--filter": "ray list nodes --filter, in the serving guide's vLLM script",
    "--tensor-parallel-size": "vllm serve's, in the serving guide",
    "--pipeline-parallel-size": "vllm serve's, in the serving guide",
}


def test_every_flag_the_docs_name_exists(parsers):
    known = set(OTHER_TOOLS_FLAGS)
    for prog, parser in parsers.items():
        for _path, sub, _summary in docs_gen.walk_commands(parser, (prog,)):
            for action in sub._actions:
                known.update(action.option_strings)
    for path in [*(ROOT / "bench").glob("*.py"), *(ROOT / "phalanx" / "examples").glob("*.py")]:
        known.update(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", path.read_text(encoding="utf-8")))
    unknown = {}
    for doc in DOC_FILES:
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", doc.read_text(encoding="utf-8")):
            if flag not in known:
                unknown.setdefault(flag, set()).add(str(doc.relative_to(ROOT)))
    assert not unknown, unknown
