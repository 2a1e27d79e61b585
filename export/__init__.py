"""specdec_kit.export: see the issue tracker; filled in by later work."""
