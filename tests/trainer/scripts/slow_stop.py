"""A worker that needs longer than torchrun's own 30 s to stop: on SIGTERM it 'saves' for 35 s, writes a
marker, and exits 75 as the trainer does after a final checkpoint."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from sharded_api.contract import ExitCode, WorkerEnv
from sharded_trainer.launch import record_exit

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
Path(args.out, f"started-{os.environ[WorkerEnv.RANK]}").touch()
while not stopping:
    time.sleep(0.1)
time.sleep(35)
Path(args.out, f"saved-{os.environ[WorkerEnv.RANK]}").touch()
sys.exit(record_exit(ExitCode.PREEMPTED))
