"""The error of a checkpoint that cannot be loaded, shared by its readers (safetensors in ``safetensors_file.py``,
GGUF in ``gguf_file.py``): a module of its own, so the two readers import it and not each other."""


class CheckpointError(ValueError):
    """A tensor is missing from the checkpoint or has the wrong shape; a file that cannot be read."""


class GGUFError(CheckpointError):
    """A GGUF file pipejax cannot load: unreadable, truncated, another architecture or tensor type."""
