"""An interactive job's pod (spec.interactive): JupyterLab on node 0, an idle shell on the others.

    python -m sharded_trainer.interactive --config FILE [--port 8888] [--root-dir DIR]

Every rendezvous variable the operator sets for training is set here too, so a run started by hand on
each node (`sharded exec JOB --node N -- python -m sharded_trainer.launch --config FILE`, or torchrun with
a script of one's own: it reads PET_* from the environment) forms the same gang a training job would,
reports progress into the job's status and writes checkpoints to the same claim.

JupyterLab listens on the pod's loopback only, with a token it prints in the log: it is reached through
the API server's port-forward (`sharded port-forward JOB PORT`), so whoever may read the pod's log and
forward its ports, and nobody else, can use it. The session ends when JupyterLab exits; its exit code is
the pod's, and 0 ends the job as Succeeded.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import tempfile

from sharded_api.contract import ExitCode, PodEnv
from sharded_api.loading import ConfigError, load_config


def log(msg: str) -> None:
    print(f"[interactive] {msg}", file=sys.stderr, flush=True)


def by_hand(env: dict[str, str], config: str) -> list[str]:
    """What to run on every node to train by hand, with the values this pod was given."""
    job = env.get(PodEnv.JOB_NAME, "JOB")
    return [
        f"node {env.get(PodEnv.NODE_RANK, '0')} of {env.get(PodEnv.NNODES, '1')} ({env.get(PodEnv.NPROC_PER_NODE, '1')}"
        f" processes each); rendezvous {env.get(PodEnv.RDZV_ENDPOINT, '-')}, id {env.get(PodEnv.RDZV_ID, '-')}",
        f"train by hand: on every node at once (sharded exec {job} --node N -- ...) run",
        f"    python -m sharded_trainer.launch --config {config}",
        f"  or torchrun with a script of your own (it reads {PodEnv.NNODES}, {PodEnv.RDZV_ENDPOINT} and the rest from "
        "the environment).",
        "  A rendezvous id serves one run: give each later run a new one on every node, e.g. "
        f"{PodEnv.RDZV_ID}={env.get(PodEnv.RDZV_ID, 'ID')}-2.",
    ]


def jupyter_argv(port: int, token: str, root_dir: str, *, root: bool) -> list[str]:
    """JupyterLab on loopback: a port-forward connects from 127.0.0.1 inside the pod, nothing else can."""
    argv = [
        sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root_dir}", f"--IdentityProvider.token={token}",
    ]  # fmt: skip
    return [*argv, "--allow-root"] if root else argv


def idle() -> int:
    """An idle shell's process: nothing but waiting to be stopped (the pod is deleted with its job). PID 1 of a
    container must handle SIGTERM itself; it ends as the signal would have ended it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    log("this node idles: JupyterLab runs on node 0")
    while True:
        signal.pause()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sharded_trainer.interactive", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, default=8888)
    parser.add_argument("--root-dir", default=None, help="JupyterLab's file browser root (default: the working dir)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:  # a config no run could use is refused now, not at the first run by hand
        load_config(args.config)
    except (ConfigError, ValueError) as e:
        log(f"error: {e}")
        return ExitCode.INVALID_CONFIG
    env = dict(os.environ)
    for line in by_hand(env, args.config):
        log(line)
    if env.get(PodEnv.NODE_RANK, "0") != "0":
        return idle()
    token = secrets.token_hex(24)
    # Jupyter's runtime files (connection files, the server's cookie secret) in a directory of the pod's own.
    state = tempfile.mkdtemp(prefix="jupyter-")
    env.update(JUPYTER_RUNTIME_DIR=f"{state}/runtime", JUPYTER_DATA_DIR=f"{state}/data",
               JUPYTER_CONFIG_DIR=f"{state}/config", IPYTHONDIR=f"{state}/ipython")  # fmt: skip
    job = env.get(PodEnv.JOB_NAME, "JOB")
    log(f"JupyterLab: sharded port-forward {job} {args.port}, then open http://127.0.0.1:{args.port}/lab?token={token}")
    cmd = jupyter_argv(args.port, token, args.root_dir or os.getcwd(), root=os.geteuid() == 0)
    os.execve(cmd[0], cmd, env)  # its exit is the pod's: the session ends with it


if __name__ == "__main__":
    sys.exit(main())
