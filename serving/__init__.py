"""specdec_kit.serving: see the issue tracker; filled in by later work."""
