"""`python -m training --kind eagle3`: features, training with training-time test, figures, save."""
from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from training.config import DistillConfig
from training.eagle import EagleHeldOut, EagleStudent, evaluate_eagle, teacher_features, train_eagle
from training.teacher import TeacherSequence
from training.train import TrainOptions, split_held_out
from tandem.config import ModelConfig
from tandem.loaders.drafter_file import weights_fingerprint
from tandem.loaders.eagle3 import save_eagle3
from tandem.model.eagle3 import default_feature_layers
from tandem.model.llama import ModelWeights, build_model
from tandem.model.rope import rope_inv_freq

log = logging.getLogger("training")


def feature_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """--feature-layers: "default" or comma-separated target layers."""
    if spec == "default":
        return default_feature_layers(num_layers)
    try:
        layers = tuple(sorted({int(part) for part in spec.split(",")}))
    except ValueError:
        raise ValueError(f"--feature-layers must be 'default' or comma-separated layers, got {spec!r}") from None
    if not layers or layers[0] < 0 or layers[-1] >= num_layers:
        raise ValueError(f"--feature-layers {spec!r}: the target has layers 0..{num_layers - 1}")
    return layers


def run_eagle(config: DistillConfig, target_config: ModelConfig, weights: ModelWeights,
              sequences: list[TeacherSequence], vocab: torch.Tensor, began: float, data_seconds: float) -> dict:
    device = config.torch_device()
    layers = feature_layers(config.feature_layers, target_config.num_layers)
    train_set, held_out = split_held_out(sequences, config.held_out, config.seed)
    feature_began = time.perf_counter()
    teacher = build_model(target_config, weights, dtype=torch.float32, device=device, num_slots=1,
                          max_model_len=2048)
    with tqdm(total=len(sequences), desc="teacher features", unit="sequence") as bar:
        train_features = teacher_features(teacher, train_set, layers, bar.update)
        held_features = teacher_features(teacher, held_out, layers, bar.update)
    del teacher
    feature_seconds = time.perf_counter() - feature_began
    inv_freq = weights.rope_inv_freq if weights.rope_inv_freq is not None else rope_inv_freq(target_config)
    student = EagleStudent(target_config, weights.layers[-1], weights.norm, weights.embed, weights.lm_head[vocab],
                           vocab, layers, inv_freq, max_len=2048, device=device, seed=config.seed)
    before = evaluate_eagle(student, held_out, held_features, weights.lm_head)
    log.info("held-out before training: %s", describe(before))
    unroll_from = int(config.ttt_from * config.steps)
    train_began = time.perf_counter()
    with tqdm(total=config.steps, desc="distill eagle3", unit="step") as bar:
        def on_step(step: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(kl=f"{loss:.3f}")
            if (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
                figures = evaluate_eagle(student, held_out, held_features, weights.lm_head)
                bar.write(f"step {step + 1}: held-out {describe(figures)}")
                student.train()

        train_eagle(student, train_set, train_features,
                    TrainOptions(config.steps, config.batch_size, config.lr, config.seed),
                    lambda step: config.ttt_steps if step >= unroll_from else 1, on_step)
    train_seconds = time.perf_counter() - train_began
    after = evaluate_eagle(student, held_out, held_features, weights.lm_head)
    log.info("held-out after training: %s", describe(after))
    fingerprint = weights_fingerprint(weights)
    training = {
        "flags": asdict(config),
        "feature_layers": list(layers),
        "teacher_tokens": sum(len(s.token_ids) - s.prompt_len for s in sequences),
        "train_sequences": len(train_set),
        "held_out_before": asdict(before) | {"mean_accepted_length": before.mean_accepted_length},
        "held_out_after": asdict(after) | {"mean_accepted_length": after.mean_accepted_length},
        "data_seconds": round(data_seconds, 1),
        "feature_seconds": round(feature_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - began, 1),
    }
    head_config, head_weights = student.export(target_config.hidden_size)
    save_eagle3(Path(config.out), head_config, head_weights, dtype=torch.bfloat16,
                extra_config={"tandem": {"target": config.target, "target_fingerprint": fingerprint,
                                         "training": training}})
    log.info("saved %s in %.0f s (data %.0f s, features %.0f s, training %.0f s)", config.out,
             training["total_seconds"], data_seconds, feature_seconds, train_seconds)
    return training


def describe(h: EagleHeldOut) -> str:
    depths = ", ".join(f"{a:.3f}" for a in h.depth_agreement)
    return f"agreement by depth [{depths}], mean accepted length {h.mean_accepted_length:.2f} over {h.positions} positions"
