"""The demo zoo's heads each benchmark offers, by name: (draft kind, folder under the zoo). Light (no torch), so the
benchmarks' ``--help`` lists them; the registry owns the kinds and their zoo folders."""

from __future__ import annotations

from specdec_kit.runtime.registry import zoo_heads

# EAGLE-1's head is EAGLE-2's on a static tree: the speedup benchmark measures it as EAGLE-2
SPEEDUP_METHODS = {name: head for name, head in zoo_heads().items() if name != "eagle"}
# client-server drafting: plain decoding through the remote API, and the drafts a client can run
EDGE_METHODS = {"plain": ("none", None)} | {
    name: zoo_heads()[name] for name in ("eagle2", "griffin", "moa", "moa_tli0")
}
