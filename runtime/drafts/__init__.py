"""Draft graphs whose parameter names are the official checkpoints' keys, and their strict loader."""

from specdec_kit.runtime.drafts.eagle import EagleDraft
from specdec_kit.runtime.drafts.griffin import GriffinDraft
from specdec_kit.runtime.drafts.loading import DRAFT_KINDS, DraftLoadError, load_draft
from specdec_kit.runtime.drafts.medusa import MedusaHeads

__all__ = ["DRAFT_KINDS", "DraftLoadError", "EagleDraft", "GriffinDraft", "MedusaHeads", "load_draft"]
