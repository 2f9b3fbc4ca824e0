"""Entry point of a spawned tensor-parallel rank (`python -m app.backends.torch.worker IN_FD OUT_FD`):
receive `WorkerArgs`, load this rank's weights, report, join the process group, then run every step
rank 0 sends until told to stop or until rank 0's process is gone (end of file on the pipe)."""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Connection

import torch

from app.backends.torch.model import LlamaRunner
from app.backends.torch.parallel import READY, STOP, TorchDistributedGroup, WorkerArgs, worker_store


def main(inbox: Connection, outbox: Connection) -> int:
    args: WorkerArgs = inbox.recv()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        group = TorchDistributedGroup(args.spec.tp_degree)
        runner = LlamaRunner.from_artifact(args.artifact_dir, args.spec, args.llama, device, args.rank, group)
    except Exception as error:  # reported to rank 0, which raises it
        outbox.send(getattr(error, "message", repr(error)))
        return 1
    outbox.send(READY)
    group.join(worker_store(args.port, args.spec.tp_degree), args.rank, device)
    serve_steps(runner, inbox)
    return 0


def serve_steps(runner: LlamaRunner, inbox: Connection) -> None:
    with torch.inference_mode():
        while True:
            try:
                step = inbox.recv()
            except EOFError:  # rank 0's process is gone
                return
            if step == STOP:
                return
            runner.run(step)


if __name__ == "__main__":
    try:
        sys.exit(
            main(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
        )
    except Exception:
        traceback.print_exc()
        os._exit(1)  # skip teardown: closing our sockets at once makes rank 0's pending collective fail
