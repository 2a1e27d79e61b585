"""specdec_kit.bench: see the issue tracker; filled in by later work."""
