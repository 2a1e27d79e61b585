"""Named static trees in the Medusa / EAGLE-1 choice-list format (paths of top-k ranks).

These are published tree definitions (data), reproduced so that static-tree runs and TensorRT-LLM
exports can name them.
"""

# Medusa's standard 63-node tree (FasterDecoding/Medusa, medusa/model/medusa_choices.py).
MC_SIM_7B_63 = [
    [0],
    [0, 0],
    [1],
    [0, 1],
    [2],
    [0, 0, 0],
    [1, 0],
    [0, 2],
    [3],
    [0, 3],
    [4],
    [0, 4],
    [2, 0],
    [0, 5],
    [0, 0, 1],
    [5],
    [0, 6],
    [6],
    [0, 7],
    [0, 1, 0],
    [1, 1],
    [7],
    [0, 8],
    [0, 0, 2],
    [3, 0],
    [0, 9],
    [8],
    [9],
    [1, 0, 0],
    [0, 2, 0],
    [1, 2],
    [0, 0, 3],
    [4, 0],
    [2, 1],
    [0, 0, 4],
    [0, 0, 5],
    [0, 0, 0, 0],
    [0, 1, 1],
    [0, 0, 6],
    [0, 3, 0],
    [5, 0],
    [1, 3],
    [0, 0, 7],
    [0, 0, 8],
    [0, 0, 9],
    [6, 0],
    [0, 4, 0],
    [1, 4],
    [7, 0],
    [0, 1, 2],
    [2, 0, 0],
    [3, 1],
    [2, 2],
    [8, 0],
    [0, 5, 0],
    [1, 5],
    [1, 0, 1],
    [0, 2, 1],
    [9, 0],
    [0, 6, 0],
    [0, 0, 0, 1],
    [1, 6],
    [0, 7, 0],
]

# EAGLE-1's default static tree (SafeAILab/EAGLE v1, eagle/model/choices.py, also named mc_sim_7b_63
# there): 25 draft nodes, depth 5.
EAGLE1_DEFAULT = [
    [0],
    [1],
    [2],
    [3],
    [0, 0],
    [0, 1],
    [0, 2],
    [1, 0],
    [1, 1],
    [2, 0],
    [2, 1],
    [3, 0],
    [0, 0, 0],
    [0, 0, 1],
    [0, 0, 2],
    [0, 1, 0],
    [0, 1, 1],
    [0, 2, 0],
    [0, 2, 1],
    [1, 0, 0],
    [0, 0, 0, 0],
    [0, 0, 0, 1],
    [0, 0, 0, 2],
    [0, 0, 0, 0, 0],
    [0, 0, 0, 0, 1],
]


def chain(length: int) -> list[list[int]]:
    """A single path of top-1 proposals (classic chain speculation)."""
    return [[0] * (i + 1) for i in range(length)]


NAMED_TREES: dict[str, list[list[int]]] = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    "eagle1_default": EAGLE1_DEFAULT,
}
