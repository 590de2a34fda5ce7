"""DraftConfig: every field is a `draft-service` flag, and bad values are refused with the field's name."""
from __future__ import annotations

from dataclasses import asdict, fields

import pytest

from draft_service.config import DraftConfig, parse_config

VALUES = {
    "host": "0.0.0.0", "port": 6000, "metrics_port": 0, "drafter": "ngram", "model": "/models/x.gguf",
    "drafter_target": "/models/target.gguf",
    "device": "cpu", "dtype": "bfloat16", "quantization": "q8_0", "block_activations": "int8", "kv_cache_dtype": "float32", "threads": 2, "num_slots": 3, "max_num_batched_tokens": 64, "max_seqs_per_target": 2, "max_model_len": 512, "max_k": 5,
    "max_fanout": 3, "predraft_guesses": 2, "max_predraft_depth": 2,
    "probs_top_k": 4, "ngram_min_n": 2, "ngram_max_n": 3, "suffix_max_depth": 16, "suffix_spec_factor": 2.0,
    "suffix_min_token_prob": 0.2, "suffix_cache_tokens": 1000, "suffix_confidence": 0.5, "grammar_cache_size": 32, "grace_seconds": 1.5,
    "log_level": "debug", "max_message_bytes": 1024, "tls_cert": "d.crt", "tls_key": "d.key", "tls_client_ca": "ca.crt",
}
SWITCHES = {"prefix_caching": False, "lookahead": False}  # --x / --no-x flags


def test_every_field_is_a_flag():
    assert set(VALUES) | set(SWITCHES) == {f.name for f in fields(DraftConfig)}
    argv = [arg for name, value in VALUES.items() for arg in ("--" + name.replace("_", "-"), str(value))]
    argv += ["--" + ("" if on else "no-") + name.replace("_", "-") for name, on in SWITCHES.items()]
    assert asdict(parse_config(argv)) == VALUES | SWITCHES


def test_defaults(capsys):
    config = parse_config([])
    assert (config.port, config.metrics_port, config.drafter, config.model, config.threads, config.max_k) \
        == (50052, 9092, "suffix", "smollm2-135m-draft", 1, 8)
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert all("--" + f.name.replace("_", "-") in help_text for f in fields(DraftConfig))


@pytest.mark.parametrize("field, value", [
    ("port", 70000), ("metrics_port", -1), ("drafter", "eagle"), ("threads", 0), ("num_slots", 0), ("max_num_batched_tokens", 15), ("max_seqs_per_target", -1),
    ("max_model_len", 0), ("max_k", 0), ("max_fanout", -2), ("predraft_guesses", 0), ("predraft_guesses", 17), ("max_predraft_depth", 0), ("max_predraft_depth", 9), ("probs_top_k", 0), ("ngram_min_n", 0), ("ngram_min_n", 5),
    ("suffix_max_depth", 0), ("suffix_spec_factor", 0.0), ("suffix_min_token_prob", 1.5), ("suffix_cache_tokens", -1),
    ("suffix_confidence", 1.5), ("grammar_cache_size", 0),
    ("grace_seconds", -1.0), ("max_message_bytes", 0), ("tls_cert", "only-a-cert.crt"),
    ("tls_client_ca", "ca-without-a-cert.crt"), ("log_level", "loud"), ("dtype", "int3"), ("block_activations", "int4"), ("kv_cache_dtype", "fp8"), ("device", "abacus"),
])
def test_bad_values_are_refused(field, value):
    with pytest.raises(ValueError, match="--" + field.split("_")[0]):
        DraftConfig(**{field: value})


def test_bad_flags_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--max-k", "0"])
    assert exit_info.value.code == 2
    assert "--max-k" in capsys.readouterr().err
