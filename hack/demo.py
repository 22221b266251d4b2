"""`make demo`: the CPU quickstart end to end on this machine.

Starts the local control plane, a node agent that runs pods as real processes, and the operator;
applies examples/quickstart-cpu.yaml (2 nodes x 2 processes, FSDP2, gloo); shows progress as it
trains; prints the final status and the checkpoint tree. `--keep` leaves everything up for kubectl.
`--finetune` runs examples/finetune-lora-cpu.yaml instead: a tiny Hugging Face model and chat records are
written to a claim of their own, the job fine-tunes LoRA adapters on them and exports the adapter, and the
demo then asks the exported model the task's questions.
`--containers` builds the operator and trainer images (hack/images.py) and runs each pod in a container
of the trainer image, as uid 1000 with the claim's fsGroup, instead of as a process.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import time
from pathlib import Path

import yaml

from localstack.nodeagent import can_isolate
from localstack.processes import stop_dir
from localstack.stack import ROOT, LocalStack
from sharded_operator.api.models import GROUP, PLURAL, VERSION
from sharded_operator.api.status import FINISHED, Phase, Progress, ShardedTrainingJobStatus


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def tree(path: Path, limit: int = 40) -> list[str]:
    lines = []
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        size = f"  ({p.stat().st_size} bytes)" if p.is_file() else "/"
        lines.append(f"  {'  ' * (len(rel.parts) - 1)}{rel.name}{size}")
    return lines[:limit] + ([f"  ... {len(lines) - limit} more"] if len(lines) > limit else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="keep the cluster, agent and operator up afterwards")
    parser.add_argument("--example", default=str(ROOT / "examples" / "quickstart-cpu.yaml"))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--containers", action="store_true", help="run the pods in containers of the trainer image")
    parser.add_argument("--finetune", action="store_true", help="fine-tune a Hugging Face model with LoRA instead")
    args = parser.parse_args(argv)
    if args.finetune and args.example == parser.get_default("example"):
        args.example = str(ROOT / "examples" / "finetune-lora-cpu.yaml")
    if not can_isolate():
        say("the demo runs each pod in its own network namespace: run it as root with iproute2 (ip) installed")
        return 2

    workdir = ROOT / ".cluster"
    stop_dir(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    job = yaml.safe_load(Path(args.example).read_text())
    if args.containers:
        import images

        say("building the images from the repo's Dockerfiles (cached after the first time) ...")
        job["spec"]["image"] = images.build_all()["trainer"]
    say("starting the local control plane, 2 local nodes and the operator ...")
    stack = LocalStack(workdir, containers=args.containers).start()
    ok = False
    name, ns = job["metadata"]["name"], "default"
    try:
        if args.finetune:
            inputs = fine_tuning_inputs(stack, ns, "finetune-inputs")
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}"
        stack.cluster.api("POST", path, job)
        spec = job["spec"]
        say(f"applied {Path(args.example).name}: {spec['nodes']} nodes, strategy {spec['strategy']['type']}")
        started, last = time.monotonic(), None
        raw: dict = {}
        status = ShardedTrainingJobStatus()
        while time.monotonic() - started < args.timeout:
            raw = stack.cluster.api("GET", f"{path}/{name}").get("status", {})
            status = ShardedTrainingJobStatus.model_validate(raw)
            prog, ck = status.progress or Progress(), status.last_checkpoint
            evaluated = f"  eval_loss={prog.eval_loss:.4f}" if prog.eval_loss is not None else ""
            line = (
                f"phase={status.phase}  ready={status.ready}  step={prog.step}/{prog.total_steps or '-'}  "
                f"loss={prog.loss if prog.loss is not None else '-'}{evaluated}  "
                f"tokens/s={prog.tokens_per_second or '-'}  "
                f"checkpoint={ck.step if ck else '-'}  restarts={status.restarts}"
            )
            if line != last:  # print only what changed
                print(f"{time.monotonic() - started:5.0f}s  {line}", flush=True)
                last = line
            if status.phase in FINISHED:
                break
            time.sleep(1)
        say("final status:")
        print(yaml.safe_dump(raw, sort_keys=False), flush=True)
        claim = f"{name}-checkpoints"
        ckpt = stack.claim_dir(ns, claim) / name
        say(f"checkpoints on claim {claim} ({ckpt}):")
        print("\n".join(tree(ckpt)), flush=True)
        ok = status.phase == Phase.SUCCEEDED
        if ok and args.finetune:
            ok = ask_the_export(ckpt / "export", inputs / "model")
        if not ok:
            for log in sorted((workdir / "nodeagent" / "pods").glob("*/container.log")):
                say(f"--- {log.parent.name} ---")
                print(log.read_text()[-2000:])
        if args.keep:
            say(f"cluster kept up: export KUBECONFIG={stack.cluster.kubeconfig}")
            say(f"                 export PATH={stack.cluster.bin_dir}:$PATH; kubectl get stj,pods")
            say("press Ctrl-C to stop everything")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    finally:
        # Delete the job while the operator runs, so its finalizer is released, then stop everything.
        with contextlib.suppress(Exception):  # already gone
            stack.cluster.api("DELETE", f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/{name}")
            time.sleep(2)
        stack.stop()
        say("stopped the cluster, the node agent and the operator")
    say("demo " + ("succeeded" if ok else "FAILED"))
    return 0 if ok else 1


def fine_tuning_inputs(stack: LocalStack, ns: str, claim: str) -> Path:
    """A claim holding a tiny Llama-architecture model (random weights, a word-level tokenizer with a chat
    template) and 400 chat records of a task it can learn: what a user would download to a claim."""
    import tinyhf

    inputs = stack.new_claim(ns, claim)
    tinyhf.write_model(inputs / "model", "llama")
    tinyhf.write_chat_data(inputs / "chat.jsonl", 400)
    say(f"wrote a tiny Llama model and 400 chat records ('next wK' -> 'wK+1 wK+2') to claim {claim}")
    return inputs


def ask_the_export(export: Path, base: Path) -> bool:
    """Load the exported adapter with peft on its base model and ask it the task's questions."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tinyhf

    say(f"the export ({export}): {', '.join(sorted(p.name for p in export.iterdir()))}")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(export))
    tokenizer = AutoTokenizer.from_pretrained(str(export))
    right = 0
    for k in range(len(tinyhf.WORDS)):
        got = tinyhf.greedy_answer(model, tokenizer, k)
        right += got == tinyhf.answer(k)
        if k < 5:
            print(f"  user: next w{k}   model: {got}   (expected {tinyhf.answer(k)})", flush=True)
    say(f"the fine-tuned model answers {right} of {len(tinyhf.WORDS)} questions right")
    return right >= len(tinyhf.WORDS) * 0.8


if __name__ == "__main__":
    sys.exit(main())
