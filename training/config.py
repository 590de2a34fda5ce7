"""What `python -m training` is asked to do: its flags, as a dataclass, and their help."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.registry import DEFAULT_MODEL
from training.prompts import PROMPT_SET_SIZE

KINDS = ("model", "eagle3")


@dataclass(slots=True)
class DistillConfig:
    kind: str = "model"  # one of KINDS
    target: str = DEFAULT_MODEL
    out: str = "drafter.safetensors"
    teacher_data: str = ""  # a cache file of the teacher data; empty: none
    num_prompts: int = 640
    samples_per_prompt: int = 1
    max_new_tokens: int = 128
    temperature: float = 0.8
    generation_batch: int = 32
    layers: int = 2
    draft_vocab: int = 16384
    ship_vocab: int = 0  # 0: the whole draft vocabulary
    steps: int = 1200
    batch_size: int = 8
    lr: float = 1e-3
    held_out: float = 0.05
    eval_every: int = 300
    seed: int = 0
    device: str = "auto"
    threads: int = 0  # 0: torch's default
    feature_layers: str = "default"  # eagle3: target layers, comma-separated; default: EAGLE-3's three
    ttt_steps: int = 4  # eagle3: unrolled steps of training-time test (1: none)
    ttt_from: float = 0.3  # eagle3: the fraction of training before unrolling starts (warm-up on step 0)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"--kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.ttt_steps < 1 or not 0 <= self.ttt_from < 1:
            raise ValueError("--ttt-steps must be at least 1 and --ttt-from in [0, 1)")
        for name in ("num_prompts", "samples_per_prompt", "max_new_tokens", "generation_batch", "layers",
                     "draft_vocab", "steps", "batch_size", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.ship_vocab <= self.draft_vocab:
            raise ValueError(f"--ship-vocab must be in [0, --draft-vocab {self.draft_vocab}], got {self.ship_vocab}")
        if not 0 < self.held_out < 1:
            raise ValueError(f"--held-out must be a fraction in (0, 1), got {self.held_out}")
        if self.temperature <= 0 or self.lr <= 0:
            raise ValueError("--temperature and --lr must be positive")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


HELP = {
    "kind": "model (a token-only drafter file) or eagle3 (an EAGLE-3 head folder that reads the target's features)",
    "feature_layers": "eagle3: the target layers whose input the head reads, comma-separated (e.g. 27 for the "
                      "last-layer feature alone); default: layers 2, L/2 and L-3",
    "ttt_steps": "eagle3: training-time test, how many steps the head is unrolled on its own predictions; 1: none",
    "ttt_from": "eagle3: the fraction of the steps trained on step 0 alone before unrolling starts",
    "target": "the teacher: embedded model name or a .gguf/HF path; the drafter serves this target",
    "out": "where to write the drafter file (safetensors), or the EAGLE-3 folder",
    "teacher_data": "cache of the teacher data, refused when made with another target, seed, temperature or "
                    "max-new-tokens; sequences it lacks are generated and added; empty: no cache",
    "num_prompts": f"prompts the teacher answers (the set holds {PROMPT_SET_SIZE})",
    "samples_per_prompt": "completions the teacher samples per prompt, each with its own seed",
    "max_new_tokens": "tokens the teacher samples per prompt",
    "temperature": "the teacher's sampling temperature for the data",
    "generation_batch": "sequences the teacher samples at once",
    "layers": "student decoder layers, initialized from the teacher's first layers",
    "draft_vocab": "N: the student's head is the target's lm_head rows of the N most frequent output tokens",
    "ship_vocab": "the saved drafter keeps only the head rows of its N most frequent tokens (FR-Spec style), a "
                  "cheaper head for the same layers; 0 keeps all of --draft-vocab",
    "steps": "optimizer steps",
    "batch_size": "sequences per step",
    "lr": "peak learning rate of the one-cycle schedule",
    "held_out": "fraction of the sequences kept out of training for the figures",
    "eval_every": "log held-out figures every this many steps",
    "seed": "one seed for data, split, initialization and batches",
    "device": "auto (cuda when present), cpu or cuda:N",
    "threads": "torch CPU threads; 0 keeps torch's default",
}
