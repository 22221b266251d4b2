"""What one optimizer step costs on the output head's shape (128256 x 4096, the 8B shape's largest parameter),
in bf16: torchao's stochastically rounded AdamW (precision bf16-pure) against torch's fused AdamW on the same
bf16 weights (what a Trainer that loads in bf16 runs), as a plain tensor and as FSDP2's DTensor on one rank.
Prints, per arm, the memory the step allocates above the state it keeps and the median step time.

    python bench/sr_adamw_probe.py [ROWS COLS]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torchao.optim import _AdamW

rows, cols = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (128256, 4096)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29631", rank=0, world_size=1)
mesh = init_device_mesh("cuda", (1,))


def arm(name: str, sharded: bool, make) -> None:
    torch.cuda.empty_cache()
    weight = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    param = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]) if sharded else weight)
    del weight
    param.grad = torch.randn_like(param) * 1e-3
    optimizer = make([param])
    optimizer.step()  # state created (and, for torchao, the step compiled)
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        optimizer.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    extra = (torch.cuda.max_memory_allocated() - base) / (rows * cols)
    print(
        "PROBE "
        + json.dumps(
            {
                "arm": name,
                "dtensor": sharded,
                "step_ms": round(1000 * statistics.median(times), 2),
                "step_bytes_per_element": round(extra, 2),
                "shape": [rows, cols],
            }
        ),
        flush=True,
    )
    del optimizer, param


for sharded in (False, True):
    arm("torchao-sr", sharded, lambda ps: _AdamW(ps, lr=1e-4, bf16_stochastic_round=True))
    arm("torch-fused", sharded, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))
dist.destroy_process_group()
