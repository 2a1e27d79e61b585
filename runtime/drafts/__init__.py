"""Draft graphs whose parameter names are the official checkpoints' keys, and their strict loader
(``checkpoint.load_draft`` loads one of a registered kind)."""

from specdec_kit.runtime.drafts.eagle import EagleDraft
from specdec_kit.runtime.drafts.griffin import GriffinDraft
from specdec_kit.runtime.drafts.loading import DraftLoadError
from specdec_kit.runtime.drafts.medusa import MedusaHeads

__all__ = ["DraftLoadError", "EagleDraft", "GriffinDraft", "MedusaHeads"]
