"""Reading a GGUF's metadata fields, shared by the weight and tokenizer readers."""

from __future__ import annotations

from jspec.checkpoint.common import CheckpointError


def field(reader, key: str, default=None, *, required: bool = False):
    """A metadata value as Python data (strings decoded, arrays as lists)."""
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise CheckpointError(f"{reader.path}: GGUF metadata has no field {key!r}")
        return default
    try:
        return f.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{reader.path}: GGUF field {key!r} is malformed ({e})") from e
