"""The MkDocs hook of the documentation site (`mkdocs.yml`, `hooks:`): adds the generated reference pages.

At each build, `on_files` asks `tools/docs_gen.py` for the CLI reference (from the argparse parsers), the gRPC
reference (from `proto/`), the module map (from the code's docstrings) and the service spec schema's page and file
(from `phalanx/schemas/`), and adds them to the site as pages that exist only in the build, never in `docs/`, so they
cannot drift from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for entry in (str(ROOT), str(ROOT / "tools")):
    if entry not in sys.path:
        sys.path.insert(0, entry)

import docs_gen  # noqa: E402  (tools/ is not a package: found through the path set above)


def on_files(files: Any, config: Any, **_: Any) -> Any:
    from mkdocs.structure.files import File

    for rel, text in {**docs_gen.generated_pages(ROOT), **docs_gen.generated_files(ROOT)}.items():
        existing = files.get_file_from_path(rel)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, rel, content=text))
    return files
