"""`python -m training`: train a small drafter for a target and save it.

Teacher data comes from our own runtime. `--kind model`: the student starts from the target's
first layers and learns KL(teacher || student) over a reduced draft vocabulary; it is saved as a
drafter file. `--kind eagle3`: an EAGLE-3 head that reads the target's features, trained with
training-time test (training/eagle.py), saved as an EAGLE-3 folder. The same flags and seed give
the same weights.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from training.config import DistillConfig, HELP
from training.eagle_run import run_eagle
from training.prompts import PROMPT_SET_SIZE, distill_prompts
from training.student import Student
from training.teacher import (EntryKey, TeacherSequence, encode_prompts, generate_completions,
                                           load_teacher_data, save_teacher_data)
from training.train import (HeldOut, TrainOptions, draft_vocabulary, evaluate, frequency_subset,
                                         split_held_out, train)
from tandem.cli_args import add_dataclass_flags, dataclass_from_args
from tandem.config import ModelConfig
from tandem.grpc_server import set_torch_threads
from tandem.loaders import load_checkpoint
from tandem.loaders.drafter_file import DrafterFile, save_drafter_file, weights_fingerprint
from tandem.model.llama import ModelWeights, build_model
from tandem.model.rope import rope_inv_freq
from tandem.registry import resolve_model_path
from tandem.runtime import load_tokenizer
from tandem.tokenizer import Tokenizer

log = logging.getLogger("training")


SWEEP = (1024, 2048, 4096, 8192, 16384, 32768)


def run(config: DistillConfig) -> dict:
    began = time.perf_counter()
    device = config.torch_device()
    path = resolve_model_path(config.target)
    target_config, weights = load_checkpoint(path)
    tokenizer = load_tokenizer(path)
    fingerprint = weights_fingerprint(weights)
    sequences = _teacher_sequences(config, target_config, weights, tokenizer, device, fingerprint)
    data_seconds = time.perf_counter() - began
    train_set, held_out = split_held_out(sequences, config.held_out, config.seed)
    vocab = draft_vocabulary(train_set, config.draft_vocab, target_config.vocab_size)
    if config.kind == "eagle3":
        return run_eagle(config, target_config, weights, sequences, vocab, began, data_seconds)
    student = Student(target_config, weights.layers[: config.layers], weights.norm, weights.embed,
                      weights.lm_head[vocab], _inv_freq(weights, target_config), max_len=2048, device=device)
    before = evaluate(student, held_out, weights.lm_head, vocab)
    log.info("held-out before training: %s", _describe(before))
    with tqdm(total=config.steps, desc="distill", unit="step") as bar:
        def on_step(step: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(kl=f"{loss:.3f}")
            if (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
                bar.write(f"step {step + 1}: held-out {_describe(evaluate(student, held_out, weights.lm_head, vocab))}")
                student.train()

        train(student, train_set, TrainOptions(config.steps, config.batch_size, config.lr, config.seed), on_step)
    after = evaluate(student, held_out, weights.lm_head, vocab)
    log.info("held-out after training: %s", _describe(after))
    sweep = {n: asdict(evaluate(student, held_out, weights.lm_head, vocab, frequency_subset(vocab, train_set, n)))
             for n in SWEEP if n < config.draft_vocab}
    shipped_rows, shipped = torch.arange(len(vocab)), after
    if 0 < config.ship_vocab < config.draft_vocab:
        shipped_rows = frequency_subset(vocab, train_set, config.ship_vocab).sort().values
        shipped = evaluate(student, held_out, weights.lm_head, vocab, shipped_rows)
        log.info("held-out with the %d-row shipped head: %s", config.ship_vocab, _describe(shipped))
    training = {
        "flags": asdict(config),
        "teacher_tokens": sum(len(s.token_ids) - s.prompt_len for s in sequences),
        "train_sequences": len(train_set),
        "held_out_before": asdict(before),
        "held_out_after": asdict(after),
        "held_out_shipped": asdict(shipped),
        "draft_vocab_sweep": sweep,
        "data_seconds": round(data_seconds, 1),
        "total_seconds": round(time.perf_counter() - began, 1),
    }
    drafter = DrafterFile(student.layer_weights(), student.norm.detach().clone(), vocab[shipped_rows],
                          config.target, fingerprint, training)
    save_drafter_file(Path(config.out), drafter)
    log.info("saved %s (%.1f MB) in %.0f s", config.out, Path(config.out).stat().st_size / 1e6,
             training["total_seconds"])
    return training


def _teacher_sequences(config: DistillConfig, target_config: ModelConfig, weights: ModelWeights,
                       tokenizer: Tokenizer, device: torch.device, fingerprint: str) -> list[TeacherSequence]:
    """Each prompt's samples_per_prompt completions: those the cache holds, the others generated (and cached).

    Completion s of prompt i is drawn with seed + s * PROMPT_SET_SIZE + i, so it is the same
    sequence whatever --num-prompts and --samples-per-prompt say, and a cache serves larger runs.
    """
    key = {"target": fingerprint, "max_new_tokens": config.max_new_tokens, "temperature": config.temperature,
           "seed": config.seed}
    cache = Path(config.teacher_data) if config.teacher_data else None
    entries = load_teacher_data(cache, key) if cache is not None and cache.exists() else {}
    wanted = [(s, i) for s in range(config.samples_per_prompt) for i in range(config.num_prompts)]
    missing = [e for e in wanted if e not in entries]
    log.info("%d teacher sequences wanted: %d cached, %d to generate", len(wanted), len(wanted) - len(missing),
             len(missing))
    if missing:
        entries.update(zip(missing, _generate(config, target_config, weights, tokenizer, device, missing)))
        if cache is not None:
            save_teacher_data(cache, entries, key)
    return [entries[e] for e in wanted]


def _generate(config: DistillConfig, target_config: ModelConfig, weights: ModelWeights, tokenizer: Tokenizer,
              device: torch.device, entries: list[EntryKey]) -> list[TeacherSequence]:
    teacher = build_model(target_config, weights, dtype=torch.float32, device=device,
                          num_slots=config.generation_batch, max_model_len=2048)
    prompts = encode_prompts(tokenizer, distill_prompts(config.num_prompts, config.seed))
    seeds = [config.seed + sample * PROMPT_SET_SIZE + index for sample, index in entries]
    with tqdm(total=len(entries), desc="teacher data", unit="sequence") as bar:
        return generate_completions(teacher, [prompts[index] for _, index in entries], seeds=seeds,
                                    max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                    stop_ids=tokenizer.eos_token_ids, progress=bar.update)


def _inv_freq(weights: ModelWeights, config: ModelConfig) -> torch.Tensor:
    return weights.rope_inv_freq if weights.rope_inv_freq is not None else rope_inv_freq(config)


def _describe(h: HeldOut) -> str:
    return (f"greedy agreement {h.greedy_agreement:.3f}, alpha {h.alpha:.3f}, "
            f"coverage {h.coverage:.3f} over {h.positions} positions")


def parse_config(argv: Sequence[str] | None = None) -> DistillConfig:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__.splitlines()[0])
    add_dataclass_flags(parser, DistillConfig, HELP)
    try:
        return dataclass_from_args(DistillConfig, parser.parse_args(argv))
    except ValueError as e:
        parser.error(str(e))


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.threads:
        set_torch_threads(config.threads)
    torch.manual_seed(config.seed)
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
