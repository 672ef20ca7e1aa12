"""The import rules of pyproject.toml ([tool.importlinter]) hold for the code as it is: layers import downward
only, the CLI and the SDK never import the services or the ledger, production code never imports the test fakes,
private modules stay inside their package, and nothing imports in a cycle."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_the_contracts_cover_the_rules_of_the_design():
    contracts = {c["type"]: c for c in _contracts()}
    layers = contracts["layers"]["layers"]
    assert layers[0] == "phalanx.cli" and layers[-1].startswith("phalanx.core")
    assert layers.index("services") < layers.index("phalanx.client") < layers.index(layers[-1])
    forbidden = [c for c in _contracts() if c["type"] == "forbidden"]
    assert any(
        {"phalanx.cli", "phalanx.client"} <= set(c["source_modules"])
        and {"services", "db"} <= set(c["forbidden_modules"])
        for c in forbidden
    )
    assert any("services" in c["source_modules"] and c["forbidden_modules"] == ["phalanx.testing"] for c in forbidden)
    assert "acyclic_siblings" in contracts and "private_modules" in contracts


def test_no_contract_has_exemptions():
    """A rule holds for all the code or is restated: no `ignore_imports` list (issue 32: the node agent's exemptions
    for the simulated host went when main.py began injecting it)."""
    exempt = {c["name"]: c["ignore_imports"] for c in _contracts() if c.get("ignore_imports")}
    assert exempt == {}


def test_the_code_keeps_every_import_contract(tmp_path):
    exe = LINT_IMPORTS if LINT_IMPORTS.exists() else shutil.which("lint-imports")
    assert exe, "lint-imports is not installed: the test extra brings import-linter (scripts/setup installs it)"
    result = subprocess.run([str(exe), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert f"Contracts: {len(_contracts())} kept, 0 broken." in result.stdout
