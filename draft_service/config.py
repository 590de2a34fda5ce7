"""The draft service's configuration: one dataclass whose fields are the `draft-service` flags."""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem_kernels.compression import DEFAULT_TOP_K, MAX_VOCAB
from tandem.model.batch import DEFAULT_MAX_NUM_BATCHED_TOKENS, MIN_PREFILL_TOKENS
from tandem.model.kv_cache import KV_CACHE_DTYPE_HELP
from tandem.cli_args import add_dataclass_flags, dataclass_from_args
from tandem.protos import MAX_PREDRAFT_DEPTH
from tandem.registry import DEFAULT_DRAFT_MODEL
from tandem.quantization import BLOCK_ACTIVATIONS, BLOCK_ACTIVATIONS_HELP, QUANTIZATION_HELP, QUANTIZATIONS
from tandem.runtime import check_kv_cache_dtype, resolve_dtype
from tandem.tls import ServerTls

DRAFTER_KINDS = ("model", "ngram", "suffix", "suffix+model", "eagle3")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(slots=True)
class DraftConfig:
    host: str = "127.0.0.1"
    port: int = 50052
    metrics_port: int = 9092  # 0 turns /metrics off
    drafter: str = "suffix"  # one of DRAFTER_KINDS; the best mix measured (docs/drafters.md, Which drafter by default)
    model: str = DEFAULT_DRAFT_MODEL
    drafter_target: str = ""  # a drafter file's target checkpoint; empty: the one the file names
    device: str = "cpu"
    dtype: str = "auto"  # bf16 for a drafter file, on CUDA and on CPUs with the native decoder, else fp32
    quantization: str = "auto"  # model drafters: one of tandem.quantization.QUANTIZATIONS
    block_activations: str = "int16"  # model drafters: one of tandem.quantization.BLOCK_ACTIVATIONS
    kv_cache_dtype: str = "auto"  # model and suffix+model drafters: a key of tandem.model.kv_cache.KV_CACHE_DTYPES
    threads: int = 1  # torch threads; one core per service by default (docs/design/runtime.md, CPU threads)
    num_slots: int = 8
    prefix_caching: bool = True  # a closed sequence's slots keep their KV for a prompt with the same first tokens
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # a round's catch-up forward at most (chunked prefill)
    max_seqs_per_target: int = 0  # 0: a target may take every slot
    max_model_len: int = 2048
    max_k: int = 8
    max_fanout: int = -1  # outcomes pre-drafted per proposal at most; -1: all, 0: off
    predraft_guesses: int = 3  # guesses at each recovered token, each an outcome to pre-draft
    max_predraft_depth: int = 4  # verifications ahead that pre-drafts reach at most, over a long link
    lookahead: bool = True  # over a long link, lookup drafters draft up to max_k for the target to salvage
    probs_top_k: int = DEFAULT_TOP_K
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    suffix_max_depth: int = 24
    suffix_spec_factor: float = 4.0
    suffix_min_token_prob: float = 0.1
    suffix_cache_tokens: int = 200_000
    suffix_confidence: float = 0.75
    grammar_cache_size: int = 256
    grace_seconds: float = 5.0
    log_level: str = "info"
    max_message_bytes: int = 16 * 1024 * 1024
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""  # mTLS: only targets whose certificate this CA signed

    def __post_init__(self) -> None:
        self.log_level = self.log_level.lower()
        _check_ranges(self)
        for name, allowed in (("drafter", DRAFTER_KINDS), ("log_level", LOG_LEVELS), ("quantization", QUANTIZATIONS),
                              ("block_activations", BLOCK_ACTIVATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{_flag(name)} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        self.server_tls()
        if self.drafter == "eagle3" and not self.drafter_target:
            raise ValueError("--drafter eagle3 needs --drafter-target: the target checkpoint whose features it reads")
        if self.ngram_min_n > self.ngram_max_n:
            raise ValueError(f"--ngram-min-n ({self.ngram_min_n}) must not exceed --ngram-max-n ({self.ngram_max_n})")
        try:
            resolve_dtype(self.dtype, torch.device(self.device))
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"--device/--dtype: {e}") from None
        check_kv_cache_dtype(self.kv_cache_dtype, self.dtype, self.device)

    def server_tls(self) -> ServerTls | None:
        return ServerTls.from_flags(self.tls_cert, self.tls_key, self.tls_client_ca)


HELP = {
    "host": "address that gRPC and /metrics bind to",
    "port": "gRPC port",
    "metrics_port": "port of the Prometheus /metrics endpoint; 0 turns it off",
    "drafter": "model (a small model drafts), ngram (prompt lookup, no model), suffix (suffix decoding over "
               "the request and recent outputs, no model), suffix+model (suffix where it is confident, "
               "else the model) or eagle3 (an EAGLE-3 head that reads the target's features: --model is its "
               "folder, --drafter-target its target checkpoint)",
    "model": "embedded name (smollm2-135m-draft, the distilled drafter; smollm2-135m), a .gguf file, an HF "
             "folder, or a drafter file from python -m training; the lookup drafters (ngram, suffix) load "
             "only its tokenizer, to report the vocabulary",
    "drafter_target": "for a distilled drafter file: the target checkpoint whose embedding and head rows "
                      "it uses (its fingerprint must match); empty: the target the file names. For an EAGLE-3 "
                      "head (required): the target whose features it reads",
    "device": "torch device of the draft model: cpu, cuda, cuda:1, ...",
    "dtype": "auto, float32, bfloat16 or float16 (auto: bfloat16 for a distilled drafter file, on CUDA and on "
             "x86 CPUs the native decoder runs on, else float32)",
    "quantization": f"model drafters: {QUANTIZATION_HELP}",
    "block_activations": f"model drafters: {BLOCK_ACTIVATIONS_HELP}",
    "kv_cache_dtype": f"model and suffix+model drafters: {KV_CACHE_DTYPE_HELP}",
    "threads": "torch CPU threads; give each service its own cores",
    "num_slots": "KV slots: sequences drafted at once; further Opens are refused",
    "prefix_caching": "model drafters: a closed sequence's KV slots keep their KV, and a new sequence whose tokens "
                      "start the same way prefills only the rest (--no-prefix-caching: prefill every prompt whole)",
    "max_num_batched_tokens": "model and suffix+model drafters: the tokens a round's catch-up forward runs at most "
                              "(chunked prefill): a longer prompt is prefilled in chunks, in rounds between the "
                              "rounds that draft the other sequences, rather than holding up their drafts for its "
                              "whole prefill (an eagle3 head prefills whole)",
    "max_seqs_per_target": "sequences one target (one Speculate stream) may hold, so that a drafter shared by "
                           "several targets serves each; 0: no cap but --num-slots",
    "max_model_len": "the longest sequence, prompt included, that the drafter holds",
    "max_k": "the largest k (draft tokens per proposal) that an Open may ask for",
    "max_fanout": "pre-drafting: the most outcomes of one proposal (j drafts accepted, then a guessed token) "
                  "drafted ahead while the target verifies it, for targets that keep such proposals; -1: all "
                  "(k x --predraft-guesses + 1), 0: off. Each takes a KV slot from --num-slots while in use; "
                  "spare time and free slots may cover fewer",
    "predraft_guesses": "pre-drafting: how many of its most likely tokens the model drafter tries as the token the "
                        "target emits after rejecting a draft, each an outcome of its own (best expected gain "
                        "first); the bonus token gets one guess",
    "max_predraft_depth": "pre-drafting: how many verifications ahead the drafter pre-drafts at most. It pre-drafts "
                          "as many as a target's draft round trip spans of its step interval (both sent by the "
                          "target), so that the drafts for a step reach the target before it starts over a long "
                          "link; 1: only the outcomes of the proposal under verification",
    "lookahead": "lookup drafters (ngram, suffix, suffix+model's suffix drafts): when a target's draft round "
                 "trip spans a step, draft up to --max-k tokens rather than the sequence's k. The target commits "
                 "tokens while a proposal travels; it verifies the drafts past them, and the longer proposal "
                 "keeps k of those (--no-lookahead: k)",
    "probs_top_k": "K of the compressed draft probabilities sent for sampled requests (model drafter)",
    "ngram_min_n": "the shortest trailing n-gram that the ngram drafter looks up",
    "ngram_max_n": "the longest trailing n-gram that the ngram drafter looks up",
    "suffix_max_depth": "suffix drafter: the longest match it measures, in tokens",
    "suffix_spec_factor": "suffix drafter: draft at most this many tokens per matched token (and at most k)",
    "suffix_min_token_prob": "suffix drafter: stop a draft once its chance of being right so far, by the "
                             "frequencies of the matches, falls below this",
    "suffix_cache_tokens": "suffix drafter: tokens of finished outputs kept for later requests to draft from; "
                           "0: each request drafts from its own tokens only",
    "suffix_confidence": "suffix+model: take the suffix draft when its expected accepted tokens reach this "
                         "share of k, else ask the model",
    "grammar_cache_size": "structured output: compiled grammars kept, by content hash (least recently used go first)",
    "grace_seconds": "on SIGTERM, how long the service may take to end its streams and stop",
    "log_level": "debug, info, warning or error",
    "max_message_bytes": "the largest gRPC message either way",
    "tls_cert": "PEM certificate (chain) served to targets; with --tls-key turns TLS on",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA bundle: accept only targets whose client certificate it signed (mTLS)",
}

_RANGES = {
    "port": (0, 65535),
    "metrics_port": (0, 65535),
    "threads": (1, None),
    "num_slots": (1, None),
    "max_num_batched_tokens": (MIN_PREFILL_TOKENS, None),
    "max_seqs_per_target": (0, None),
    "max_model_len": (1, None),
    "max_k": (1, None),
    "max_fanout": (-1, None),
    "predraft_guesses": (1, 16),
    "max_predraft_depth": (1, MAX_PREDRAFT_DEPTH),
    "probs_top_k": (1, MAX_VOCAB),
    "ngram_min_n": (1, None),
    "ngram_max_n": (1, None),
    "suffix_max_depth": (1, None),
    "suffix_spec_factor": (0.1, None),
    "suffix_min_token_prob": (0, 1),
    "suffix_cache_tokens": (0, None),
    "suffix_confidence": (0, 1),
    "grammar_cache_size": (1, None),
    "grace_seconds": (0, None),
    "max_message_bytes": (1, None),
}


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _check_ranges(config: DraftConfig) -> None:
    for name, (low, high) in _RANGES.items():
        value = getattr(config, name)
        if value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f"at least {low}"
            raise ValueError(f"--{_flag(name)} must be {bound}, got {value}")


def parse_config(argv: Sequence[str] | None = None) -> DraftConfig:
    """DraftConfig from command-line flags; a value that fails validation exits with usage."""
    parser = argparse.ArgumentParser(
        prog="draft-service", description="Tandem's draft service: streams draft tokens to a target service.")
    add_dataclass_flags(parser, DraftConfig, HELP)
    try:
        return dataclass_from_args(DraftConfig, parser.parse_args(argv))
    except ValueError as e:
        parser.error(str(e))
