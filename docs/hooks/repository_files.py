"""MkDocs hook: figures kept beside the results they draw, published with the site.

A bench writes its figure next to its figures (`bench/results/2026-12-07-ablation/ablation.svg`),
outside `docs/`. Rather than copy it into `docs/` (a second copy to drift), this hook adds every
SVG under `bench/results/` to the site as `bench-results/<its path there>`, where pages show it:
`![...](bench-results/2026-12-07-ablation/ablation.svg)`. The strict build checks those
references like any other link.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
SITE_FOLDER = "bench-results"


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for figure in sorted(RESULTS.rglob("*.svg")):
        src_uri = f"{SITE_FOLDER}/{figure.relative_to(RESULTS).as_posix()}"
        files.append(File.generated(config, src_uri, abs_src_path=str(figure)))
    return files
