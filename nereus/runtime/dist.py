"""Devices, backends and process launch: the one module that chooses gloo or NCCL.

`spawn` starts N local ranks that meet through a file in a temporary folder (no port
races between parallel tests); `init_from_env` joins a job started by torchrun. Either
way the rest of the runtime sees an initialised default process group.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nereus.errors import NereusError

#: How long a collective may wait before the job is declared hung.
DEFAULT_TIMEOUT = timedelta(seconds=120)


def backend() -> str:
    """NCCL when CUDA is present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    """This rank's device: its local GPU, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def init_from_env(timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Join the job torchrun (or any env:// launcher) started."""
    missing = [key for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
    if missing:
        raise NereusError(f"not launched by torchrun: environment variables {', '.join(missing)} are unset")
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
    dist.init_process_group(backend(), init_method="env://", timeout=timeout)


def _child(
    rank: int, world_size: int, folder: str, fn: Callable[..., Any], args: tuple[Any, ...], num_threads: int
) -> None:
    torch.set_num_threads(num_threads)
    os.environ["LOCAL_RANK"] = str(rank)
    result_path = Path(folder) / f"result-{rank}.pkl"
    try:
        if torch.cuda.is_available():
            torch.cuda.set_device(device())
        dist.init_process_group(
            backend(),
            init_method=f"file://{folder}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=DEFAULT_TIMEOUT,
        )
        outcome: tuple[bool, Any] = (True, fn(rank, world_size, *args))
    except BaseException as exc:  # report any failure to the parent, which raises it
        outcome = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    result_path.write_bytes(pickle.dumps(outcome))


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, num_threads: int = 1) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` local ranks; return each rank's result.

    `fn` must be importable (a module-level function). A rank that raises makes `spawn`
    raise RuntimeError with that rank's traceback.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="nereus-rdzv-") as folder:
        mp.start_processes(
            _child, args=(world_size, folder, fn, args, num_threads), nprocs=world_size, join=True, start_method="spawn"
        )
        outcomes = [pickle.loads((Path(folder) / f"result-{rank}.pkl").read_bytes()) for rank in range(world_size)]
    failures = [f"rank {rank}: {value}" for rank, (ok, value) in enumerate(outcomes) if not ok]
    if failures:
        raise RuntimeError("\n".join(failures))
    return [value for _, value in outcomes]
