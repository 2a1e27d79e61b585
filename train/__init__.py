"""specdec_kit.train: see the issue tracker; filled in by later work."""
