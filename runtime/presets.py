"""The demo runs' fixed inputs (prompts, CPU-sized trees), shared by ``specdec-generate``'s option parser and the work
behind it; a light module, so ``--help`` answers before torch loads."""

from __future__ import annotations

from pathlib import Path

# Dynamic-tree size for the CPU demo: verifying 60 tree tokens costs a CPU far more than one token.
DEMO_TREE = dict(total_tokens=12, depth=5, top_k=2)

DEMO_PROMPTS = ["The quick brown fox", "def main():\n", "Speculative decoding", "Hello, world!"]
CHAT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the capital of France? Name two famous places there.",
    "Explain what a hash table is, with a short example.",
]
ZOO_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "class Stack:\n    def __init__(self):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    "    def __repr__(self):\n        return",
]
MEDUSA_DEMO_TREE = "static:mc_sim_7b_63:24"


ZOO_DEFAULT = Path("<default zoo>")  # --zoo without a value: resolved by specdec_kit.paths.default_zoo
