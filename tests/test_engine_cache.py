"""The shared engine cache: server engines built with a target store hold one copy of the target between them (and
their manifests still check it), and pruning removes a release's older engines and the targets left unlinked, never
what another release or a running build still needs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import griffin_inputs

from specdec_kit.export.builder import build_engine
from specdec_kit.export.engine_cache import EngineCache, locked
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.runtime.core.manifest import read_manifest
from specdec_kit.runtime.core.trees import DynamicTreeConfig


def inputs(paths, store, tree=DynamicTreeConfig(12, 3, 3), backend="vllm", dtype="float32") -> BuildInputs:
    return griffin_inputs(paths, tree, backend=backend, dtype=dtype, target_store=store)


@pytest.fixture(scope="module")
def cache(demo_checkpoints, tmp_path_factory):
    """Three vLLM engines in one cache: two trees of the float32 target (one shared copy) and a float16 one."""
    root = tmp_path_factory.mktemp("engine-cache")
    store = root / "targets"
    for name, tree, dtype in (
        ("a", DynamicTreeConfig(12, 3, 3), "float32"),
        ("b", DynamicTreeConfig(8, 2, 2), "float32"),
        ("c", DynamicTreeConfig(8, 2, 2), "float16"),
    ):
        build_engine(inputs(demo_checkpoints, store, tree, dtype=dtype), root / name)
    return root


def test_engines_of_one_target_share_one_copy_and_still_check_it(cache, demo_checkpoints):
    store = cache / "targets"
    assert len([p for p in store.iterdir() if not p.name.startswith(".")]) == 2  # float32 and float16
    a, b, c = (cache / n / "target" for n in "abc")
    assert a.is_symlink() and a.resolve() == b.resolve() != c.resolve()
    assert not os.path.isabs(os.readlink(a))  # the cache can be mounted anywhere
    manifest = read_manifest(cache / "a")
    assert "target/config.json" in manifest["files"] and any(f.endswith(".safetensors") for f in manifest["files"])
    weights = a.resolve() / "model.safetensors"
    own = [os.path.relpath(os.path.join(d, f), cache / "a") for d, _, files in os.walk(cache / "a") for f in files]
    assert own and not [f for f in own if f.startswith("target")]  # the engine itself holds no copy of the target
    # a changed shared file is caught by every engine that links to it
    original = weights.read_bytes()
    try:
        weights.write_bytes(original[:-4] + bytes(4 * [0xFF]))
        for engine in ("a", "b"):
            with pytest.raises(Exception, match="SHA-256"):
                read_manifest(cache / engine)
    finally:
        weights.write_bytes(original)
    # the same inputs again: the engine is reused, the store unchanged
    assert build_engine(inputs(demo_checkpoints, store), cache / "a").reused


def test_a_store_is_refused_where_it_cannot_serve(demo_checkpoints, tmp_path):
    with pytest.raises(BuildError, match="only server engines"):
        build_engine(inputs(demo_checkpoints, tmp_path / "s", backend="onnxruntime"), tmp_path / "e")
    (tmp_path / "file").write_text("")
    with pytest.raises(BuildError, match="is a file, expected a directory"):
        build_engine(inputs(demo_checkpoints, tmp_path / "file"), tmp_path / "e")


def test_prune_keeps_the_newest_and_what_others_serve(cache, tmp_path):
    work = tmp_path / "cache"
    subprocess.run(["cp", "-a", str(cache), str(work)], check=True)
    store = EngineCache(work)
    for name in ("a", "b", "c"):  # release r deployed a, then b, then c
        store.record("r", work / name)
    store.record("other", work / "a")  # another release still serves a
    removed = store.prune("r", keep=1, step=lambda m: None)
    assert removed == [work / "b"]  # a is kept for the other release; b's target is still a's
    assert store.deployed("r") == ["c", "a"] and (work / "a" / "target").resolve().is_dir()
    # the other release moves on to c: a goes, and with it the float32 target nothing links to any more
    store.record("other", work / "c")
    removed = store.prune("other", keep=1, step=lambda m: None)
    assert work / "a" in removed and not (work / "a").exists()
    assert [p.name for p in store.unused_targets()] == [] and len(list((work / "targets").glob("[!.]*"))) == 1
    assert read_manifest(work / "c")  # the engine served is whole


def test_prune_leaves_an_engine_being_built(cache, tmp_path):
    work = tmp_path / "cache"
    subprocess.run(["cp", "-a", str(cache), str(work)], check=True)
    store = EngineCache(work)
    store.record("r", work / "a")
    store.record("r", work / "b")
    with locked(work / ".a.lock"):  # the builder's lock on a's output
        assert store.prune("r", keep=1, step=lambda m: None) == []
    assert (work / "a").is_dir() and store.deployed("r") == ["b", "a"]
    assert [p.name for p in store.prune("r", keep=1, step=lambda m: None)] == ["a"]


def test_cache_command_lists_and_prunes(cache, tmp_path):
    work = tmp_path / "cache"
    subprocess.run(["cp", "-a", str(cache), str(work)], check=True)
    run = [sys.executable, "-m", "specdec_kit.export.cache_cli"]
    for engine in ("a", "b"):
        proc = subprocess.run(
            [*run, "prune", str(work), "--release", "rel", "--engine", str(work / engine), "--keep", "1"],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
    assert "removed engine a" in proc.stdout and "rel keeps ['b']" in proc.stdout
    listing = subprocess.run([*run, "list", str(work)], capture_output=True, text=True, check=True).stdout
    assert "b  vllm griffin" in listing and "(rel)" in listing and "c  vllm griffin" in listing
    bad = subprocess.run(
        [*run, "prune", str(work), "--release", "rel", "--engine", "/elsewhere/x"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "not directly under the engine cache" in bad.stderr


def test_the_charts_build_job_shares_the_target_and_prunes(chart, demo_checkpoints, tmp_path):
    """The build Job's own script and arguments, run as rendered (its /engine-cache and /models paths moved to temporary
    directories): three upgrades of one release, each a new tree, leave one shared target and the newest engines."""
    models, engines = tmp_path / "models", tmp_path / "engine-cache"
    models.mkdir()
    engines.mkdir()
    (models / "target").symlink_to(demo_checkpoints["target"])
    (models / "draft").symlink_to(demo_checkpoints["griffin"])
    built = []
    for depth in (2, 3, 4):
        values = {
            "backend": "vllm",
            "engine": {"source": "build", "draft": "griffin", "depth": depth, "cache": {"keepEngines": 2}},
            "model": {"pvc": {"claimName": "m"}},
        }
        [job] = [d for d in chart.render(values) if d["kind"] == "Job"]
        container = next(c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "build-engine")
        moved = [
            a.replace("/engine-cache", str(engines)).replace("/models", str(models))
            for a in [*container["command"], *container["args"]]
        ]
        env = {e["name"]: e["value"].replace("/engine-cache", str(engines)) for e in container["env"]}
        assert "--target-store=/engine-cache/targets" in container["args"]
        bin_dir = os.path.dirname(sys.executable)
        proc = subprocess.run(
            [a for a in moved if a != "--dtype=checkpoint"] + ["--dtype=float32"],
            env={**os.environ, **env, "HOME": str(tmp_path), "PATH": f"{bin_dir}:{os.environ['PATH']}"},
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        built.append(env["ENGINE"])
    names = sorted(p.name for p in engines.iterdir() if not p.name.startswith(".") and p.name != "targets")
    assert names == sorted(os.path.basename(e) for e in built[1:])  # the first engine was pruned after the third
    assert "removed engine" in proc.stdout
    [target] = [p for p in (engines / "targets").iterdir() if not p.name.startswith(".")]
    for engine in built[1:]:
        assert (engines / engine / "target").resolve() == target and read_manifest(engines / engine)
