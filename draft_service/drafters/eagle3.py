"""Drafting with an EAGLE-3 head (tandem.model.eagle3): the model drafter's rounds, on target features.

Everything the model drafter does carries over (batched rounds, pre-drafts in scratch slots,
grammar masks, reduced-vocabulary q'), with two additions before each catch-up:
- the target's features that arrived since the last round are fused into the sequence's slot;
- rows computed from the head's own predicted features (its drafts, which the target may since
  have accepted) are fed again, now reading the target's features, as EAGLE does.
A sequence is drafted once the target's features reach its last committed token's predecessor:
right after an Open, the first Extend (which carries the prompt's features) has not come yet.
"""
from __future__ import annotations

import sys

import torch

from draft_service.drafter import DraftJob, common_prefix_len
from draft_service.metrics import DraftMetrics
from draft_service.drafters.model import ModelDrafter, Row
from tandem.hidden_states import FeatureLayout
from tandem.model.eagle3 import Eagle3Model


class Eagle3Drafter(ModelDrafter):
    kind = "eagle3"

    def __init__(self, model: Eagle3Model, probs_top_k: int, metrics: DraftMetrics, guesses: int = 1,
                 prefix_caching: bool = True):
        # One layer: its whole prefill is quick, and each catch-up's start depends on the features it
        # loads first, so it runs whole (no chunked prefill).
        super().__init__(model, probs_top_k, metrics, model.draft_vocab.cpu(), guesses, prefix_caching,
                         max_num_batched_tokens=sys.maxsize)
        self.feature_layout = FeatureLayout(model.eagle.feature_layers, model.eagle.target_hidden_size)

    def _rows(self, jobs: list[DraftJob]) -> list[Row]:
        return super()._rows([job for job in jobs if _features_ready(job)])

    def _catch_up(self, rows: list[Row], ends: list[int]) -> tuple[list[Row], torch.Tensor]:
        cache = self.model.kv_cache
        for row in rows:
            features, slot, state = row.job.sequence.features, row.state.slot, row.state
            known = min(features.known, row.job.known_len - 1)
            reload_from = min(cache.target_len[slot], common_prefix_len(state.cached, row.job.tokens), known)
            # Also when there is nothing new: a slot taken over from another sequence forgets its features.
            self.model.load_features(slot, reload_from, features.rows[reload_from:known])
            state.cached = state.cached[: cache.exact_rows[slot]]
        return super()._catch_up(rows, ends)


def _features_ready(job: DraftJob) -> bool:
    """The target's features reach the committed tokens' last but one position."""
    features = job.sequence.features
    return features is not None and features.known >= job.known_len - 1
