"""Launch the 2-process ``train-chameleon-drafter`` run of tests/test_train_distributed.py N times
and count the ranks that abort in C++ (issue 30: "terminate called without an active exception").

    PYTHONPATH=. python scripts/distributed_abort_loop.py --runs 50 [--busy 2] [--keep-going]

The tiny inputs (a random Chameleon folder, five prompts) are written once into ``--work``
(default: a temporary folder). ``--busy K`` runs K busy-loop processes beside the launches, the
load under which the abort was seen. The last line is the summary:
``50 launches: 0 aborts, 0 other failures``; the exit status is 1 if any launch failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIGNATURE = "terminate called without an active exception"
PROMPTS = "a red car\na cat on the grass\nthe dog\nan image of a car\na dog\n"
LOOP = ["--steps", "6", "--batch-size", "4", "--warmup-steps", "1", "--precision", "fp32", "--checkpoint-every", "3",
        "--no-progress"]


def make_inputs(work: Path) -> list[str]:
    """The test's Chameleon-drafter command line, without ``--out``; the inputs written once."""
    chameleon, prompts = work / "chameleon", work / "prompts.txt"
    if not (chameleon / "generation.json").is_file():
        from lantern.testing import make_tiny_chameleon_folder

        make_tiny_chameleon_folder(chameleon)
    prompts.write_text(PROMPTS)
    return ["train-chameleon-drafter", "--model", str(chameleon), "--image-size", "64", "--prompts", str(prompts),
            "--eval-prompts", "1", "--dtype", "float32", *LOOP]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    """One ``torchrun --nproc_per_node 2 -m lantern.cli ARGS --out OUT``, as the test launches it."""
    head = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
            str(_free_port())]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *head, "-m", "lantern.cli", *args, "--out", str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def _busy() -> None:
    while True:  # load beside the launches: the abort was seen on a busy machine
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--busy", type=int, default=0, help="busy-loop processes beside the launches")
    parser.add_argument("--work", type=Path, default=None, help="folder for the inputs and outputs (temp)")
    parser.add_argument("--log", type=Path, default=None, help="append each failed launch's stderr here")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="lantern-abort-"))
    work.mkdir(parents=True, exist_ok=True)
    command = make_inputs(work)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through ``finally``: stop the busy loops
    busy = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    aborts = others = 0
    try:
        for i in range(args.runs):
            out = work / f"run-{i:03d}"
            proc = launch(command, out)
            aborted = proc.returncode != 0 and SIGNATURE in proc.stderr
            aborts += aborted
            others += proc.returncode != 0 and not aborted
            status = "ok" if proc.returncode == 0 else ("ABORT" if aborted else f"FAIL rc={proc.returncode}")
            print(f"launch {i + 1}/{args.runs}: {status}", flush=True)
            if proc.returncode != 0 and args.log is not None:
                with open(args.log, "a") as f:
                    f.write(f"===== launch {i + 1} rc={proc.returncode}\n{proc.stderr}\n")
            if proc.returncode == 0:
                shutil.rmtree(out, ignore_errors=True)
    finally:
        for p in busy:
            p.terminate()
    print(f"{args.runs} launches: {aborts} aborts, {others} other failures", flush=True)
    return 1 if aborts or others else 0


if __name__ == "__main__":
    sys.exit(main())
