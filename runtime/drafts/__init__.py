"""Draft graphs whose parameter names are the official checkpoints' keys, and their strict loader."""

from specdec_kit.runtime.drafts.eagle import EagleDraft
from specdec_kit.runtime.drafts.griffin import GriffinDraft
from specdec_kit.runtime.drafts.loading import DraftLoadError, load_draft
from specdec_kit.runtime.drafts.medusa import MedusaHeads

__all__ = ["DraftLoadError", "EagleDraft", "GriffinDraft", "MedusaHeads", "load_draft"]
