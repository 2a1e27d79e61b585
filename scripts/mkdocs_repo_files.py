"""MkDocs hook: publish the plots the benchmarks and trainers write (``bench/results``, ``zoo/*``) beside the pages,
under the same paths, so pages show them from where they are produced instead of from copies kept in ``docs/``."""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

PUBLISHED = ("bench/results/**/*.png", "zoo/**/*.png")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = Path(config.config_file_path).parent
    for pattern in PUBLISHED:
        for path in sorted(root.glob(pattern)):
            uri = path.relative_to(root).as_posix()
            if files.get_file_from_path(uri) is None:
                files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
