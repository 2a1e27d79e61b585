"""The prompt sets the kit evaluates on and holds out of training (``prompts.py``), with the bundled Spec-Bench copy."""
