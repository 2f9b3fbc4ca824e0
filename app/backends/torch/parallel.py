"""Tensor parallelism: one process per rank, joined by torch.distributed (gloo on CPU, NCCL on CUDA).

Rank 0 lives in the caller's process. Ranks 1..tp-1 are worker processes (`worker.py`) that load their
own rank file, then loop: receive a step's host inputs from rank 0 over a pipe, run the same forward
pass (the collectives inside it keep the ranks in lockstep), repeat. Steps travel over a pipe rather
than a collective so that an idle server never trips the process group's timeout, and a worker whose
parent dies sees end-of-file and exits.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from app.backends.base import BackendSpec
from app.backends.torch.model import DecodeStep, PrefillStep
from app.errors import ArtifactError, GenerationError
from app.llama import LlamaSpec

STOP = "stop"
READY = "ready"
LOAD_TIMEOUT_S = 600.0
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
JOIN_TIMEOUT_S = 10.0


class TorchDistributedGroup:
    """The collectives of one backend's ranks over its own store and process group (never the
    process-wide default group), so several tensor-parallel backends can live in one process."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.group: dist.ProcessGroup | None = None

    def join(self, store: dist.Store, rank: int, device: torch.device) -> None:
        """Rendezvous with the other ranks; blocks until every rank has joined."""
        if device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, rank, self.world_size)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, self.world_size, COLLECTIVE_TIMEOUT)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._joined().allreduce([tensor]).wait()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._joined().allgather([parts], [tensor.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def _joined(self) -> dist.ProcessGroup:
        if self.group is None:
            raise GenerationError("the tensor-parallel process group has not been joined")
        return self.group


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def master_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`store.port`), not waiting for the others."""
    return dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False
    )


def worker_store(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """What a spawned rank needs, sent as the first message on its pipe."""

    rank: int
    artifact_dir: Path
    spec: BackendSpec
    llama: LlamaSpec  # the artifact's model/config.json, read once by rank 0
    device: str
    port: int
    threads: int


@dataclass(slots=True)
class Worker:
    rank: int
    process: subprocess.Popen[bytes]
    to_worker: Connection
    from_worker: Connection

    def close_pipes(self) -> None:
        self.to_worker.close()
        self.from_worker.close()


class WorkerPool:
    """The ranks 1..tp-1 of one backend, each a `python -m app.backends.torch.worker` process talking
    to rank 0 over a pair of pipes (a fresh interpreter: the caller's `__main__` is never re-imported)."""

    def __init__(self, workers: list[Worker], store: dist.TCPStore) -> None:
        self.workers = workers
        self.store = store

    @classmethod
    def start(
        cls, artifact_dir: Path, spec: BackendSpec, llama: LlamaSpec, device: torch.device
    ) -> WorkerPool:
        """Spawn the workers; they load their weights while rank 0 loads its own."""
        store = master_store(spec.tp_degree)
        threads = max(1, torch.get_num_threads() // spec.tp_degree)
        pool = cls([], store)
        try:
            for rank in range(1, spec.tp_degree):
                args = WorkerArgs(
                    rank, artifact_dir, spec, llama, str(rank_device(device, rank)), store.port, threads
                )
                pool.workers.append(_spawn(args))
        except BaseException:
            pool.close()
            raise
        return pool

    def wait_loaded(self, timeout_s: float = LOAD_TIMEOUT_S) -> None:
        """Block until every worker has loaded its weights; raise a worker's own error if one failed."""
        for worker in self.workers:
            if not worker.from_worker.poll(timeout_s):
                raise ArtifactError(
                    f"tensor-parallel rank {worker.rank} did not load within {timeout_s:.0f} s"
                )
            try:
                message = worker.from_worker.recv()
            except EOFError:
                message = f"exited with code {worker.process.wait(JOIN_TIMEOUT_S)} while loading"
            if message != READY:
                raise ArtifactError(f"tensor-parallel rank {worker.rank} failed: {message}")

    def send(self, step: PrefillStep | DecodeStep) -> None:
        for worker in self.workers:
            if worker.process.poll() is not None:
                raise GenerationError(
                    f"tensor-parallel rank {worker.rank} exited with code {worker.process.returncode}"
                )
            worker.to_worker.send(step)

    def close(self) -> None:
        """Ask every worker to stop, then wait a bounded time; terminate, then kill, what is left."""
        for worker in self.workers:
            with contextlib.suppress(OSError):
                worker.to_worker.send(STOP)
        for worker in self.workers:
            _reap(worker.process)
            worker.close_pipes()
        self.workers = []


def _spawn(args: WorkerArgs) -> Worker:
    to_worker_read, to_worker_write = os.pipe()
    from_worker_read, from_worker_write = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "app.backends.torch.worker", str(to_worker_read), str(from_worker_write)],
            pass_fds=(to_worker_read, from_worker_write),
        )
    except BaseException:
        for fd in (to_worker_write, from_worker_read):
            os.close(fd)
        raise
    finally:
        os.close(to_worker_read)
        os.close(from_worker_write)
    worker = Worker(
        args.rank,
        process,
        Connection(to_worker_write, readable=False),
        Connection(from_worker_read, writable=False),
    )
    worker.to_worker.send(args)
    return worker


def _reap(process: subprocess.Popen[bytes]) -> None:
    """Wait for a process to exit, escalating to SIGTERM and then SIGKILL after bounded waits."""
    for escalate in (None, process.terminate, process.kill):
        if escalate is not None:
            escalate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(JOIN_TIMEOUT_S)
            return
