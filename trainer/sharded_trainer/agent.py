"""torchrun's agent with the trainer's imports paid once per pod, not once per worker start.

    python -m sharded_trainer.agent [torchrun's arguments] --run-path WORKER --config FILE

Importing torch and the trainer takes a worker about 5 s of CPU, and on a small node every worker of every
start pays it at once (4 workers on 2 cores: 8-10 s before a process group). torchrun can run its workers
as a function (`--run-path`) started through a multiprocessing start method; with `forkserver`, one server
process holds everything imported, and every start, an in-place restart above all, forks workers that have
it already. The agent imports torch for torchrun anyway: it imports the trainer too and forks the server
from itself before torchrun starts a thread, so the imports are paid once per pod, not twice (a server
spawned the usual way imports torch again: about 4 s of CPU per node start). Neither the agent before the
fork nor the server ever touches CUDA (a CUDA context does not survive a fork) or imports DeepSpeed (whose
accelerator probe may), so the workers begin exactly as spawned ones do, with the imports done.

Everything else is torchrun's own (`torch.distributed.run.main`): the PET_* settings, the rendezvous,
restarts, the exit codes. A worker's exit code is its own (SystemExit carries it out of the forked
process), as with spawned workers.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from multiprocessing import forkserver
from pathlib import Path

from sharded_api.contract import PodEnv

# What a worker imports on the way to its first step (measured on an FSDP run: torch._dynamo and the DCP
# state-dict helpers are imported lazily by FSDP2 and the checkpoint load, another 2 s).
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch._dynamo",
    "sharded_trainer.train",
    "sharded_trainer.strategies.fsdp",
    "sharded_trainer.strategies.zero2",
    "sharded_trainer.strategies.pick",
]

# What a worker also imports when it trains a Hugging Face model (about 1.5 s of CPU each, peft's most of
# it): preloaded only for such a job, which a preset job would pay for and never use, and only on a node
# without GPUs. Importing transformers probes CUDA (torchao's import asks torch.cuda.is_available(), which
# initializes the driver), and a driver initialized before the fork does not work in the forked workers.
HF_PRELOAD = ["transformers", "sharded_trainer.modeling.hf"]
GPU_DEVICES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's and AMD's, present wherever a GPU is mounted


def preload(args: list[str]) -> list[str]:
    """The modules the server imports for the job whose trainer config `args` names (`--config FILE`)."""
    import yaml

    if any(Path(device).exists() for device in GPU_DEVICES):
        return PRELOAD
    path = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
    if path is None and "--config" in args[:-1]:
        path = args[args.index("--config") + 1]
    try:
        body = yaml.safe_load(Path(path).read_text()) if path else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        body = None  # the worker reports an unreadable config as it should; here it only means no extras
    model = body.get("model") if isinstance(body, dict) else None
    if not (isinstance(model, dict) and model.get("huggingface")):
        return PRELOAD
    return [*PRELOAD, *HF_PRELOAD, *(["peft"] if body.get("lora") else [])]


# The script torchrun runs in each worker (`--run-path`): the trainer's own entry point.
WORKER = str(Path(__file__).with_name("__main__.py"))
START_METHOD = "forkserver"


def torchrun_args(target: list[str], start: str | None = None) -> list[str]:
    """torchrun's arguments for `target` (`-m sharded_trainer ...` or a user's command): the trainer's own
    entry point runs through the preloading server unless `start` (default: the pod's SHARDED_WORKER_START)
    is `spawn`; anything else is spawned as torchrun always does."""
    start = start or os.environ.get(PodEnv.WORKER_START) or START_METHOD
    if start not in (START_METHOD, "spawn"):
        raise ValueError(f"{PodEnv.WORKER_START} must be {START_METHOD} or spawn, not {start!r}")
    if target[:2] == ["-m", "sharded_trainer"] and start == START_METHOD:
        return ["--run-path", f"--start-method={START_METHOD}", WORKER, *target[2:]]
    return target


def helper(pid: int) -> str | None:
    """Which of multiprocessing's own processes `pid` is (the agent's fork server or resource tracker, which
    are not workers), or None."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        if Path(f"/proc/{pid}/comm").read_bytes().strip() == SERVER_NAME:
            return "forkserver"  # forked from the agent (start_server): the agent's own command line
    except OSError:
        return None
    for name in ("forkserver", "resource_tracker"):
        if f"multiprocessing.{name}".encode() in argv:
            return name
    return None


SERVER_NAME = b"sharded-forksrv"  # the fork server's /proc/<pid>/comm, where it is forked (15 bytes at most)


def start_server(modules: list[str]) -> None:
    """Import `modules` here, then fork the fork server from this process: the agent imports torch for
    torchrun anyway, so the server begins with everything in memory and pays no import of its own (a
    spawned server imports torch a second time: about 4 s of CPU per node start).

    Forked only while no Python thread runs (torchrun's start later); anywhere else the server is spawned and
    imports `modules` itself, as multiprocessing always does."""
    import threading

    for name in modules:
        __import__(name)
    if threading.active_count() > 1 or forkserver._forkserver._forkserver_pid is not None:
        multiprocessing.set_forkserver_preload(modules)
        forkserver.ensure_running()
        return
    import socket
    from multiprocessing import connection, resource_tracker, util

    resource_tracker.ensure_running()  # before the fork: the server and its workers share the agent's
    sys.stdout.flush()
    sys.stderr.flush()
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        # Every client holds the write end of the "alive" pipe: the server exits once all of them are gone.
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the server: it never returns into the agent's code
            code = 0
            try:
                os.close(alive_w)  # a spawned server never had it; holding it, this one would never see EOF
                _name_this_process(SERVER_NAME)
                # The agent's streams were set up before main() asked for unbuffered output (a spawned server
                # reads it from the environment): the workers' lines reach the pod's log as they are written.
                for stream in (sys.stdout, sys.stderr):
                    if stream is not None:
                        stream.reconfigure(line_buffering=True, write_through=True)
                forkserver.main(listener.fileno(), alive_r, [])
            except SystemExit:
                pass
            except BaseException:
                code = 1
                sys.excepthook(*sys.exc_info())
            finally:
                os._exit(code)
        os.close(alive_r)
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def _name_this_process(name: bytes) -> None:
    """Set /proc/self/comm (what `ps` and `helper` read) through prctl(PR_SET_NAME)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)


def name_worker() -> None:
    """In a worker forked by that server: the interpreter's name back, so `ps` and `top` show it as what it is."""
    with contextlib.suppress(OSError):
        if Path("/proc/self/comm").read_bytes().strip() == SERVER_NAME:
            _name_this_process(Path(sys.executable).name.encode()[:15])


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    # The server's (and so the forked workers') output reaches the pod's log line by line, as `python -u`
    # gives spawned workers.
    os.environ["PYTHONUNBUFFERED"] = "1"
    if f"--start-method={START_METHOD}" in args:
        # OpenMP reads its thread count once, when torch loads: in the server, so before it starts. torchrun
        # sets 1 thread per worker where a node runs several, but only later, for the workers it spawns.
        procs = os.environ.get(PodEnv.NPROC_PER_NODE, "")
        if procs.isdigit() and int(procs) > 1:
            os.environ.setdefault("OMP_NUM_THREADS", "1")
        start_server(preload(args))
    from torch.distributed.run import main as torchrun

    torchrun(args)


if __name__ == "__main__":
    main()
