"""The drafters, each behind draft_service.drafter's `Drafter`: model.py (a small LM), eagle3.py (an
EAGLE-3 head on the target's features), ngram.py (prompt lookup), suffix.py (a suffix tree of the
sequence and past outputs, tandem/suffix_index.py; alone, or in front of the model), with kv_slots.py
(a model drafter's KV slots and its pre-drafts' scratch slots)."""
