"""Shared fixtures: the embedded model, and tiny random checkpoints written by the tests."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# Triton picks interpreter or compiler when tandem_kernels/ is imported. Without CUDA only the
# interpreter can run the kernels, and tests compare them with their references on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tandem import launch
from tandem.registry import resolve_model_path


def pytest_configure(config) -> None:
    """Each test worker picks service ports from a range of its own. A port free_port finds free stays
    unbound until its service has loaded its model, seconds later; another worker that picked it
    meanwhile would start a second service on it, and each test would then talk to the other's."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker is None or count is None:
        return
    ports, index = launch.PORT_RANGE, int(worker.removeprefix("gw"))
    size = len(ports) // int(count)
    launch.PORT_RANGE = range(ports.start + index * size, ports.start + (index + 1) * size)


@pytest.fixture(scope="session")
def smollm2_path():
    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_path):
    """(config, float32 weights) of the embedded GGUF, read once per test session."""
    from tandem.loaders import load_checkpoint

    return load_checkpoint(smollm2_path)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    """transformers' own tokenizer from the same GGUF file (slow to build: one per session)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' own loading of the same GGUF file: the oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def shared_drafter(tmp_path_factory):
    """An n-gram draft service that several targets may share."""
    from tandem.launch import ServiceProcess

    logs = tmp_path_factory.mktemp("shared-drafter")
    draft = ServiceProcess("draft_service", ["--drafter", "ngram", "--threads", "1"], log_path=logs / "draft.log")
    try:
        yield draft.start().wait_healthy()
    finally:
        draft.kill()


@pytest.fixture(scope="session")
def front_doors(shared_drafter, tmp_path_factory):
    """A target serving every front door, speculating with the shared drafter: Generation and
    VllmEngine on its gRPC port, the OpenAI API on its HTTP port; its chat template shows tools (the
    shipped smollm2_tool_use, which renders chats without tools as the model's own does), and the
    Hermes parser reads the calls of tool_choice auto."""
    from tandem.launch import ServiceProcess, free_port

    logs = tmp_path_factory.mktemp("front-doors")
    target = ServiceProcess("target_service", ["--threads", "1", "--max-model-len", "512",
                                               "--drafter", shared_drafter.address,
                                               "--chat-template", "smollm2_tool_use", "--tool-call-parser", "hermes"],
                            log_path=logs / "target.log", http_port=free_port())
    try:
        yield target.start().wait_healthy().wait_metric("tandem_drafter_connected", 1)
    finally:
        target.kill()
