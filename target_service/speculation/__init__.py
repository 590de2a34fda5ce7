"""Speculation on the target: the Speculator the engine talks to about drafts, its policy (how long a
step waits, how many drafts it verifies) and speed guard (speculation only where it pays), what the
drafter knows of each sequence and the proposals held for it, a step's draft plan, and the link to
the draft service (its messages and addresses)."""
