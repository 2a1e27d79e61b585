"""specdec_kit.loadtest: see the issue tracker; filled in by later work."""
