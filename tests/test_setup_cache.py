"""The set-up scripts' shared cache (``scripts/steps.sh``, ``link_cached_env``): a checkout's environment is a link
to the cache's copy for the same inputs, another checkout with the same inputs gets the same copy, changed inputs
get a new one, and the cache keeps two copies per name."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def link(cache: Path, checkout: Path, *inputs: str) -> str:
    """Run ``link_cached_env CHECKOUT/.env demo INPUTS...`` -> the key it printed."""
    script = 'source scripts/steps.sh; link_cached_env "$1/.env" demo "${@:2}"; echo "$ENV_KEY"'
    proc = subprocess.run(
        ["bash", "-c", script, "link", str(checkout), *inputs],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "HOME": str(cache.parent), "SPECDEC_ENV_CACHE": str(cache)},
        check=True,
    )
    return proc.stdout.strip()


def test_checkouts_share_a_copy_per_inputs_and_the_cache_keeps_two(tmp_path):
    cache, first, second = tmp_path / "envs", tmp_path / "a", tmp_path / "b"
    spec = tmp_path / "spec.txt"
    spec.write_text("pkg==1\n")
    key = link(cache, first, str(spec), "extra")
    assert (first / ".env").is_symlink() and (first / ".env").resolve() == cache / f"demo-{key}"
    (first / ".env" / "marker").write_text("built")
    assert link(cache, second, str(spec), "extra") == key  # same inputs: the same copy, built once
    assert (second / ".env" / "marker").read_text() == "built"

    spec.write_text("pkg==2\n")  # a file input counts by content
    changed = link(cache, first, str(spec), "extra")
    assert changed != key and (first / ".env").resolve() == cache / f"demo-{changed}"
    assert link(cache, first, str(spec), "other") not in (key, changed)  # so does a word
    assert len(list(cache.glob("demo-*"))) == 2  # the new copy and the newest before it

    own = tmp_path / "own"
    (own / ".env").mkdir(parents=True)
    link(cache, own, str(spec), "extra")
    assert not (own / ".env").is_symlink()  # a checkout's own environment is left as it is
