"""The chart's values table, from helm/values.schema.json (types, choices, descriptions) and helm/values.yaml
(defaults), written between the markers in helm/README.md.

    python scripts/helm_values_table.py            # rewrite the table in helm/README.md
    python scripts/helm_values_table.py --check    # exit 1 when the table is stale (the tests run this)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import generated_table
import yaml

CHART = Path(__file__).resolve().parents[1] / "helm"
START, END = "<!-- values-table:start -->", "<!-- values-table:end -->"


def type_of(schema: dict) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(f"`{v}`" for v in schema["enum"])
    kind = schema.get("type", "any")
    return " or ".join(kind) if isinstance(kind, list) else kind


def default_of(values: Any) -> str:
    if isinstance(values, dict) and not values:
        return "`{}`"
    if values is None:
        return ""
    text = json.dumps(values, separators=(", ", ": ")) if not isinstance(values, str) else values
    return f"`{text}`" if text else '`""`'


def rows(schema: dict, values: Any, path: str = "") -> Iterator[tuple[str, str, str, str]]:
    """A row per described value; an object whose parts are described also gets one row per part."""
    children = schema.get("properties") or {}
    described = [k for k, v in children.items() if "description" in v]
    if path and "description" in schema:
        shown = "" if described else default_of(values)
        yield path, "object" if described else type_of(schema), shown, schema["description"]
    for key, child in children.items():
        sub = values.get(key) if isinstance(values, dict) else None
        if described or not path:
            yield from rows(child, sub, f"{path}.{key}" if path else key)


def table() -> str:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    lines = ["| value | type | default | what it does |", "|---|---|---|---|"]
    for path, kind, default, text in rows(schema, values):
        cells = [f"`{path}`", kind, default, text]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return generated_table.main(CHART / "README.md", START, END, table, "scripts/helm_values_table.py", argv)


if __name__ == "__main__":
    sys.exit(main())
