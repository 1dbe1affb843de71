"""What the trainer and the inference server agree on for a weight transfer through shared
memory (``inference.weight_sync: transfer``). Pure data: both sides import it, the
trainer without vLLM and the server without the trainer.

A bucket is one file in the transfer directory holding tensors back to back, each at its
byte offset in its dtype; ``/update_weights`` names the file and says how to read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# The name the server's engine is registered under (vLLM ``--weight-transfer-config``).
SHM_BACKEND = "carryover_shm"
# The trainer's transfer folders, in /dev/shm; the server reads from no other folder.
FOLDER_PREFIX = "carryover-transfer-"
# Tensors start at this alignment inside a bucket: a view of any dtype is aligned.
ALIGN = 64


@dataclass
class ShmInit:
    """``/init_weight_transfer_engine`` body's ``init_info``: the folder buckets appear in
    (on the server's host: shared memory is not shared across hosts)."""

    directory: str


@dataclass
class ShmBucket:
    """``/update_weights`` body's ``update_info``: one bucket file and its tensors."""

    file: str                   # a plain name inside the init's directory
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)   # byte offset of each tensor
    nbytes: int = 0             # the file's size

    def as_json(self) -> dict[str, object]:
        return asdict(self)

    def check(self) -> None:
        n = len(self.names)
        if not (len(self.dtype_names) == len(self.shapes) == len(self.offsets) == n):
            raise ValueError(f"bucket {self.file!r}: names, dtype_names, shapes and offsets "
                             "must have one entry per tensor")
        if not self.file or "/" in self.file or self.file.startswith("."):
            raise ValueError(f"bucket file {self.file!r} is not a plain file name")


def aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN
