"""Shared-memory segments for moving CPU tensors between ranks on one host.

Two ranks can share memory when they run on the same host and see the same /dev/shm:
`host_token` names that shared-memory domain (boot id, host name, the device and inode of
/dev/shm, and the node name NODE_ENV when set), so two ranks compare tokens instead of
guessing from rank numbers. A rank that cannot share (no /dev/shm, not Linux) gets a token
no other rank has. Every same-host path (these segments, the state arena) decides by this
token, so two launchers on one machine given two node names run as two nodes: their ranks
meet only through the process group's backend.

A sender stages pieces in a segment it creates (a file in /dev/shm mapped MAP_SHARED),
the receiver maps the same file and copies the pieces out: one memory copy on each side,
no sockets. Segments are pooled per peer and reused by later calls, so a repeated
reshard (a weight sync every RL step) touches no fresh pages. The receiver unlinks the
file as soon as it has mapped it (the mappings outlive the name), and an exit hook
unlinks any name a crashed or absent peer never opened; `release_segments` unmaps them.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Where segments live: a tmpfs every process on the host can map.
SHM_ROOT = Path("/dev/shm")

#: Names this process's node (e.g. torchrun's node rank, or any label): ranks whose node
#: names differ never share memory, even on one host. Unset: the host is the node.
NODE_ENV = "NEREUS_NODE_ID"

#: Length of a host token, of a process nonce and of a segment name on the wire, in bytes.
TOKEN_BYTES = 32
NONCE_BYTES = 16
NAME_BYTES = 64

#: Segment offsets are aligned to a cache line so every piece copies at full speed.
ALIGN = 64


def _fingerprint() -> bytes:
    """The token of this process's shared-memory domain, or random bytes when it has none."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = SHM_ROOT.stat()
        if not os.access(SHM_ROOT, os.W_OK):
            raise OSError(f"{SHM_ROOT} is not writable")
    except OSError:
        return secrets.token_bytes(TOKEN_BYTES)  # matches no other rank: always the network path
    node = os.environ.get(NODE_ENV, "")
    domain = f"{boot_id}\0{socket.gethostname()}\0{stat.st_dev}\0{stat.st_ino}\0{node}"
    return hashlib.sha256(domain.encode()).digest()


#: Computed once: the process's shared-memory domain does not change while it runs.
_HOST_TOKEN = _fingerprint()
#: Tells this process from an earlier one at the same rank (a pooled segment is per peer process).
PROCESS_NONCE = secrets.token_bytes(NONCE_BYTES)


def host_token() -> bytes:
    """This rank's shared-memory domain: equal on two ranks exactly when they can share segments."""
    return _HOST_TOKEN


def private_token() -> bytes:
    """A token no other rank has: for a rank that must not use shared memory (e.g. CUDA tensors)."""
    return secrets.token_bytes(TOKEN_BYTES)


@dataclass
class Segment:
    """One mapped shared-memory file, seen as a flat byte tensor."""

    name: str
    data: torch.Tensor
    """The mapping as uint8; views of it are the staged pieces."""

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


# Process-wide on purpose: segments are files in /dev/shm that outlive whoever created them
# unless this process unlinks them (the exit hook reads `_unopened`), and a pooled segment is
# reused by every later reshard of the process with that peer, whichever engine calls.
#: Names this process created and no receiver has unlinked yet (removed at exit).
_unopened: set[str] = set()
#: Segments this rank stages into, by receiving peer, with that peer's process nonce.
_outgoing: dict[int, tuple[bytes, Segment]] = {}
#: Segments this rank reads from, by sending peer.
_incoming: dict[int, Segment] = {}


def map_file(path: Path, nbytes: int) -> torch.Tensor:
    """The first `nbytes` of the shared-memory file `path`, mapped MAP_SHARED, as uint8."""
    import torch

    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def create_file(name: str, nbytes: int) -> Path:
    """A new zeroed file `name` in /dev/shm of `nbytes`, unlinked at exit unless `forget_unopened`
    says a peer has taken it over. Its pages are reserved now: a full /dev/shm fails here
    (OSError) instead of killing the rank with SIGBUS when a copy first touches a missing page."""
    path = SHM_ROOT / name
    descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(descriptor, 0, max(nbytes, 1))
    except OSError:
        path.unlink()
        raise
    finally:
        os.close(descriptor)
    _unopened.add(name)
    return path


def outgoing_segment(peer: int, nonce: bytes, nbytes: int) -> Segment:
    """The pooled segment this rank stages `nbytes` for `peer` in.

    A new one when the pooled one is too small or was made for an earlier process at
    that rank (which has unlinked its name: the new process could not map it). Raises
    OSError when /dev/shm cannot hold it.
    """
    pooled = _outgoing.get(peer)
    if pooled is not None and pooled[0] == nonce and pooled[1].nbytes >= nbytes:
        return pooled[1]
    _outgoing.pop(peer, None)  # unmapped once no view of it is left
    name = f"nereus-{os.getpid()}-{peer}-{secrets.token_hex(8)}"
    path = create_file(name, nbytes)
    segment = Segment(name, map_file(path, max(nbytes, 1)))
    _outgoing[peer] = (nonce, segment)
    return segment


def incoming_segment(peer: int, name: str, nbytes: int) -> Segment:
    """The segment `peer` staged into under `name`, mapped once and reused while the name stays."""
    segment = _incoming.get(peer)
    if segment is not None and segment.name == name and segment.nbytes >= nbytes:
        return segment
    path = SHM_ROOT / name
    segment = Segment(name, map_file(path, max(nbytes, 1)))
    path.unlink()  # both sides hold the mapping now; nothing is left in /dev/shm
    _incoming[peer] = segment
    return segment


def forget_unopened(name: str) -> None:
    """The receiver has mapped and unlinked `name`: nothing to clean at exit."""
    _unopened.discard(name)


def pooled() -> list[tuple[str, int]]:
    """(name, bytes) of every segment this rank keeps mapped: staging ones first, then reading ones."""
    staging = [(segment.name, segment.nbytes) for _, segment in _outgoing.values()]
    return staging + [(segment.name, segment.nbytes) for segment in _incoming.values()]


def release_segments() -> None:
    """Drop every pooled segment (their memory returns once no tensor views them)."""
    _outgoing.clear()
    _incoming.clear()
    _unlink_unopened()


@atexit.register
def _unlink_unopened() -> None:
    for name in list(_unopened):
        (SHM_ROOT / name).unlink(missing_ok=True)
        _unopened.discard(name)


def encode_name(name: str) -> bytes:
    raw = name.encode()
    assert len(raw) <= NAME_BYTES, name
    return raw.ljust(NAME_BYTES, b"\0")


def decode_name(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode()


def aligned(nbytes: int, to: int = ALIGN) -> int:
    """`nbytes` rounded up to a multiple of `to` (a cache line unless told)."""
    return -(-nbytes // to) * to


#: Contiguous CPU copies of at least this many bytes go through libc's memmove (see `copy_bulk`).
BULK_COPY_BYTES = 1 << 20


def copy_bulk(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, through libc's memmove when both are contiguous CPU tensors of one
    dtype and at least BULK_COPY_BYTES long.

    Why: torch's copy kernel always stores through the cache, so a copy of cold memory reads
    every destination line before overwriting it; glibc's memmove streams stores past the
    cache above its non-temporal threshold (`spawn.spawn` lowers it for its ranks), which
    moved 1.6x the bytes per second with two ranks copying at once on the machine measured.
    """
    nbytes = src.numel() * src.element_size()
    if (
        nbytes >= BULK_COPY_BYTES
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.device.type == src.device.type == "cpu"
        and dst.is_contiguous()
        and src.is_contiguous()
    ):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    else:
        dst.copy_(src)
