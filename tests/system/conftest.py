"""The pairs that several whole-system modules share: one of each per test session."""
from __future__ import annotations

from tests.support.pairs import TWO_THREADS, pair_fixture

# Room for the structured-output tests' long JSON answers.
LONG = ["--max-model-len", "1024"]
ngram_pair = pair_fixture("ngram", [*LONG, *TWO_THREADS], scope="session")
# Whether an async step finds the model drafter's drafts in time depends on the machine's load, and
# the draft budget may verify none of them; synchronous speculation verifies every draft, so that
# these tests always check verification with the distilled drafter's real drafts.
# 32 sequences at a time: the choice test's 600 short requests then take a quarter of the steps.
WIDE = ["--max-num-seqs", "32"]
model_pair = pair_fixture("model", ["--sync-speculation", *LONG, *WIDE, *TWO_THREADS], [*TWO_THREADS, "--num-slots", "32"],
                          scope="session")
