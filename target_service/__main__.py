"""`target-service`: serve a model to clients, verifying drafts from a draft service."""
from __future__ import annotations

import argparse
import asyncio
import logging

from target_service.config import TargetConfig
from tandem.cli_args import add_dataclass_flags, dataclass_from_args
from tandem.grpc_server import install_event_loop, set_torch_threads
from tandem.model.kv_cache import KV_CACHE_DTYPE_HELP
from tandem.quantization import BLOCK_ACTIVATIONS_HELP, QUANTIZATION_HELP

HELP = {
    "model": "embedded model name (smollm2-135m) or a path to a .gguf file or an HF folder",
    "metrics_port": "port of the Prometheus /metrics endpoint; 0 turns it off",
    "http_port": "port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/responses, "
                 "/v1/models, /health, /metrics, /tokenize, /detokenize), with the gRPC port's TLS and bearer token; "
                 "0 turns it off",
    "vllm_grpc_port": "a second gRPC port serving vLLM's engine protocol (VllmEngine) alone and without the bearer "
                      "token, for a gateway (smg), which sends none: open it only to the gateway's network; "
                      "0 turns it off (VllmEngine is always on --port, behind the token)",
    "dtype": "auto, float32 or bfloat16 (auto: bfloat16 on CUDA and on x86 CPUs the native decoder runs on, "
             "else float32)",
    "quantization": QUANTIZATION_HELP,
    "block_activations": BLOCK_ACTIVATIONS_HELP,
    "kv_cache_dtype": KV_CACHE_DTYPE_HELP,
    "threads": "torch CPU threads; give each service its own cores",
    "max_num_seqs": "running sequences, each with its own KV block table",
    "kv_cache_tokens": "the KV cache's size in tokens, in whole blocks (0: max-num-seqs x max-model-len); "
                       "sequences take blocks as they grow, and when none are left the newest is preempted "
                       "and recomputed later; at least max-model-len",
    "max_num_batched_tokens": "tokens one step runs at most (vLLM's token budget): running sequences' tokens and "
                              "drafts first, then prompts, a longer one in chunks over several steps, so that a "
                              "long prompt does not stall the running streams; prompts always get 16",
    "max_queue": "waiting requests beyond which new ones get RESOURCE_EXHAUSTED",
    "block_size": "KV positions per block, a multiple of 16: the unit sequences take KV in and the prefix cache "
                  "finds prefixes in",
    "prefix_caching": "cache every full KV block by a hash of the tokens up to it, so that a prompt starting with "
                      "cached blocks (another turn, a shared system prompt) prefills only the rest; published as "
                      "KV events (--no-prefix-caching: prefill every prompt whole)",
    "drafter": "host:port of a draft service; several, comma-separated, or dns:///host:port (every address the "
               "name resolves to): the target streams to one and fails over to the next; empty serves without "
               "speculation",
    "draft_wait_ms": "the most a step waits for late drafts; it waits less when the drafts are worth less "
                     "(expected accepted tokens x step time) and not at all for a drafter slower than that; "
                     "0 never waits",
    "sync_speculation": "wait for the drafter every step (the blocking baseline, for benchmarks)",
    "local_drafts": "where no proposal of the drafter's continues a sequence's tokens (its answer is still on the "
                    "way), verify what a lookup of the sequence's own prompt and output drafts, if it is confident",
    "grammar_cache_size": "structured output: compiled grammars kept, by content hash (least recently used go first)",
    "grammar_compile_timeout": "structured output: seconds a constraint may take to compile before its request "
                               "gets INVALID_ARGUMENT",
    "chat_template": "a Jinja chat template file, or a shipped one by name (smollm2_tool_use: the embedded "
                     "model's template, showing it function tools in the Hermes format); default: the model's own",
    "tool_call_parser": "how the model writes function calls, for tool_choice auto: hermes (<tool_call> blocks, "
                        "as smollm2_tool_use shows it) or llama3_json; unset, auto is refused",
    "max_stored_responses": "Responses API: responses kept in memory (the least recently used forgotten first) for "
                            "previous_response_id and GET /v1/responses/{id}; 0 keeps none",
    "grace_seconds": "on SIGTERM, how long running requests may take to finish",
    "max_message_bytes": "the largest gRPC message either way, on both links, and the largest HTTP body",
    "tls_cert": "PEM certificate (chain) served to clients; with --tls-key turns TLS on",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA bundle: require client certificates signed by it (mTLS)",
    "auth_token": "bearer token that client calls must carry (health checks excepted); visible in ps",
    "auth_token_file": "file holding the bearer token (preferred over --auth-token)",
    "drafter_tls": "connect to the drafter over TLS (implied by the --drafter-* files below)",
    "drafter_ca": "PEM CA bundle that verifies the drafter's certificate; empty uses the system roots",
    "drafter_client_cert": "PEM certificate this target presents to a drafter requiring mTLS",
    "drafter_client_key": "PEM private key of --drafter-client-cert",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="target-service", description=__doc__)
    add_dataclass_flags(parser, TargetConfig, HELP)
    try:
        config = dataclass_from_args(TargetConfig, parser.parse_args(argv))
    except ValueError as err:
        parser.error(str(err))
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_torch_threads(config.threads)
    install_event_loop()
    asyncio.run(_serve(config))


async def _serve(config: TargetConfig) -> None:
    """Imported here so that --help answers without loading torch."""
    from target_service.server import serve

    await serve(config)


if __name__ == "__main__":
    main()
