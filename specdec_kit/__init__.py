"""specdec-kit: a deployment kit for speculative decoding (GRIFFIN, EAGLE/EAGLE-2, HASS, Medusa).

The importable package is ``specdec_kit``; its subpackages live in the repository's top-level
folders (``runtime/``, ``export/``, ``serving/``, ...) and are mapped into this namespace by
``pyproject.toml`` so that generic folder names never clash with other distributions.
"""

__version__ = "0.1.0"
