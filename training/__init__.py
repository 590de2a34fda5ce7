"""Offline training of drafters for a target (`python -m training`): a distilled small model, or an
EAGLE-3 head. Not part of either service: its output is a file the draft service loads."""
