"""The target service's configuration: one field per CLI flag."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from target_service.front_doors.tool_parsers import TOOL_PARSERS
from target_service.speculation.addresses import DrafterAddresses
from tandem.model.batch import DEFAULT_MAX_NUM_BATCHED_TOKENS, MIN_PREFILL_TOKENS
from tandem.model.kv_cache import DEFAULT_BLOCK_SIZE, PAGE_SIZE
from tandem.quantization import QUANTIZATIONS, check_block_activations
from tandem.runtime import check_kv_cache_dtype
from tandem.tls import ClientTls, ServerTls, read_token


CHAT_TEMPLATES = Path(__file__).parent / "chat_templates"


def chat_template_source(name_or_path: str) -> str:
    """The text of --chat-template: a file, or a template shipped in target_service/chat_templates/."""
    shipped = CHAT_TEMPLATES / f"{name_or_path}.jinja"
    path = shipped if shipped.is_file() else Path(name_or_path)
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in CHAT_TEMPLATES.glob("*.jinja")))
        raise ValueError(f"--chat-template {name_or_path!r} is neither a file nor a shipped template ({names})")
    return path.read_text()


@dataclass(slots=True)
class TargetConfig:
    model: str = "smollm2-135m"
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9091  # 0 turns /metrics off
    http_port: int = 0  # the OpenAI-compatible HTTP API; 0 turns it off
    vllm_grpc_port: int = 0  # vLLM's engine protocol alone, without the bearer token, for a gateway; 0: off
    device: str = "cpu"
    dtype: str = "auto"  # bf16 on CUDA and on CPUs with the native decoder, else fp32
    quantization: str = "auto"  # one of tandem.quantization.QUANTIZATIONS; auto: a GGUF in its own block types
    block_activations: str = "int16"  # one of tandem.quantization.BLOCK_ACTIVATIONS
    threads: int = 1  # torch threads; one core per service by default (docs/design/runtime.md, CPU threads)
    max_num_seqs: int = 8  # running sequences, one KV slot (block table) each
    max_model_len: int = 2048
    kv_cache_tokens: int = 0  # the KV cache's size in tokens, in whole blocks; 0: max_num_seqs x max_model_len
    kv_cache_dtype: str = "auto"  # a key of tandem.model.kv_cache.KV_CACHE_DTYPES
    block_size: int = DEFAULT_BLOCK_SIZE  # KV positions per block, a multiple of 16: the unit of allocation and prefix caching
    # tokens one step runs at most, running sequences' first; longer prompts are prefilled in chunks
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_queue: int = 64  # waiting requests beyond which new ones get RESOURCE_EXHAUSTED
    prefix_caching: bool = True  # full KV blocks stay cached, found by later prompts that start with their tokens
    # host:port of a draft service, several comma-separated, or dns:///host:port; empty: no speculation
    drafter: str = ""
    num_speculative_tokens: int = 4
    draft_wait_ms: float = 50.0  # the most a step waits for drafts (the policy usually waits less); 0 never waits
    sync_speculation: bool = False  # wait for each step's drafts (the pre-non-blocking baseline)
    local_drafts: bool = True  # where the drafter's proposals miss, verify the sequence's own lookup (local_drafts.py)
    reconnect_max_seconds: float = 5.0
    grammar_cache_size: int = 256  # compiled structured-output grammars kept, by content hash
    grammar_compile_timeout: float = 10.0  # seconds; a constraint that takes longer gets INVALID_ARGUMENT
    # a Jinja chat template file, or the name of one shipped in target_service/chat_templates/
    # (smollm2_tool_use: the embedded model's, showing it function tools); empty: the model's own
    chat_template: str = ""
    tool_call_parser: str = ""  # how the model writes calls, for tool_choice auto (hermes, llama3_json); empty: off
    max_stored_responses: int = 1000  # Responses API: responses kept for previous_response_id; 0 keeps none
    grace_seconds: float = 30.0
    max_message_bytes: int = 16 * 1024 * 1024
    log_level: str = "INFO"
    # Client link (clients to this target). tls_client_ca turns on mTLS.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth_token: str = ""  # a bearer token that client calls must carry; prefer auth_token_file
    auth_token_file: str = ""
    # Drafter link (this target to the draft service). Any of these turns TLS on.
    drafter_tls: bool = False  # TLS with the system's roots when no drafter_ca is given
    drafter_ca: str = ""  # the CA that signed the drafter's certificate
    drafter_client_cert: str = ""  # this target's certificate, for a drafter that requires mTLS
    drafter_client_key: str = ""

    def __post_init__(self) -> None:
        positive = {"max_num_seqs": self.max_num_seqs, "max_model_len": self.max_model_len,
                    "threads": self.threads, "max_message_bytes": self.max_message_bytes,
                    "grammar_cache_size": self.grammar_cache_size}
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        non_negative = {"http_port": self.http_port, "vllm_grpc_port": self.vllm_grpc_port,
                        "max_queue": self.max_queue, "kv_cache_tokens": self.kv_cache_tokens,
                        "num_speculative_tokens": self.num_speculative_tokens,
                        "draft_wait_ms": self.draft_wait_ms, "grace_seconds": self.grace_seconds,
                        "grammar_compile_timeout": self.grammar_compile_timeout,
                        "max_stored_responses": self.max_stored_responses}
        for name, value in non_negative.items():
            if value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {value}")
        if self.max_num_batched_tokens < MIN_PREFILL_TOKENS:
            raise ValueError(f"--max-num-batched-tokens must be at least {MIN_PREFILL_TOKENS}, "
                             f"got {self.max_num_batched_tokens}")
        if self.block_size < PAGE_SIZE or self.block_size % PAGE_SIZE:
            raise ValueError(f"--block-size must be a multiple of {PAGE_SIZE} (16, 32, 64, ...), got {self.block_size}")
        if 0 < self.kv_cache_tokens < self.max_model_len:
            raise ValueError(f"--kv-cache-tokens {self.kv_cache_tokens} holds less than one sequence of "
                             f"--max-model-len {self.max_model_len}")
        self.server_tls()
        self.drafter_link_tls()
        if self.drafter:
            DrafterAddresses.parse(self.drafter)
        if self.chat_template:
            chat_template_source(self.chat_template)
        if self.tool_call_parser and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not one of {', '.join(TOOL_PARSERS)}")
        if self.auth_token and self.auth_token_file:
            raise ValueError("give --auth-token or --auth-token-file, not both")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        check_block_activations(self.block_activations)
        check_kv_cache_dtype(self.kv_cache_dtype, self.dtype, self.device)

    def server_tls(self) -> ServerTls | None:
        return ServerTls.from_flags(self.tls_cert, self.tls_key, self.tls_client_ca)

    def drafter_link_tls(self) -> ClientTls | None:
        return ClientTls.from_flags(self.drafter_ca, self.drafter_client_cert, self.drafter_client_key,
                                    enabled=self.drafter_tls, prefix="drafter-")

    def read_auth_token(self) -> str:
        return read_token(self.auth_token, self.auth_token_file)
