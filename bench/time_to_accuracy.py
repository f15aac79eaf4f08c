"""Time to accuracy: the defaults against the fastest configuration, each launched as a user
launches it on the built-in data, from the launch to its done line. The benchmark's `tta` check.

What a user waits for is the whole run: start-up, the compiler's first epoch, every epoch, the
evaluations and the final weights; img/s of steady steps (the rows) leaves most of that out. Each
configuration runs to its end on --dataset synthetic (no download), its wall time taken around the
process and its test accuracy read from its done line. Those that compile run twice: the first
launch compiles cold, as every launch of the scripts does (each process compiles into a cache of
its own: common.recipe.compiling); the second finds the first's cache, which the benchmark names
(TORCHINDUCTOR_CACHE_DIR in its own folder): their first epochs say what the compile costs.

On a GPU: train_single with every default (ResNet-18, 15 epochs, batch 128, --compile auto: CUDA
graphs); the same with --compile none (the defaults before --compile auto); train_amp in bf16 at
batch 512 with CUDA graphs, the fastest configuration measured (docs/gpu/nvidia-h200.md). On a CPU,
where ResNet-18 takes 17 minutes an epoch: `make demo`'s run (ResNet-20, 8 epochs), and the same in
bf16, the CPU's fastest.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench import tools

ROOT = Path(__file__).resolve().parents[1]
DONE = re.compile(r"^done: step (\d+), test_acc (\d+\.\d+)", re.MULTILINE)
DEMO = ("--model", "resnet20", "--epochs", "8")  # the Makefile's demo, on a CPU


def configurations(gpus: int) -> dict[str, tuple[str, ...]]:
    """name: the script and its flags, beyond --dataset synthetic and --report-to none."""
    if gpus:
        return {"defaults": ("train_single.py",),
                "defaults, eager": ("train_single.py", "--compile", "none"),
                "fastest: bf16, batch 512, CUDA graphs": (
                    "train_amp.py", "--mixed-precision", "bf16", "--batch-size", "512",
                    "--compile", "--compile-mode", "reduce-overhead")}
    return {"defaults (make demo)": ("train_single.py", *DEMO),
            "fastest: bf16": ("train_amp.py", *DEMO, "--mixed-precision", "bf16")}


def launch(script: str, flags: list[str], output_dir: Path, timeout: float) -> dict:
    """One run to its end: wall seconds from launch to exit, its done line's accuracy and step, and
    its first epoch's seconds (metrics.jsonl); its compiler's cache in the folder of its run folder."""
    command = [sys.executable, f"scripts/{script}", "--dataset", "synthetic", "--report-to", "none",
               *flags, "--output-dir", str(output_dir)]
    start = time.perf_counter()
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(output_dir.parent.absolute() / "compile-cache")}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **cache})
    wall = time.perf_counter() - start
    found = DONE.search(done.stdout)
    if done.returncode != 0 or not found:
        last = tools.last_line(done.stdout, done.stderr)
        raise RuntimeError(f"{script}: exit status {done.returncode}: {last}")
    epochs = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((output_dir / "config.json").read_text())
    return {"wall_s": round(wall, 1), "test_acc": float(found.group(2)),
            "steps": int(found.group(1)), "epochs": len(epochs),
            "first_epoch_s": epochs[0]["epoch_time_s"], "compile": config.get("compile"),
            "command": " ".join(command[1:-2])}


def tta_check(gpus: int, workdir: Path, extra: list[str], timeout: float = 1800) -> list[dict]:
    """A check result per configuration (reported): its wall time to the done line and accuracy;
    those that compile, also the second launch's. ``extra`` flags go after each configuration's
    (the tests' shorter runs)."""
    results, runs = [], workdir / "tta"  # one folder of run folders: one compile cache, made here
    for number, (name, (script, *flags)) in enumerate(configurations(gpus).items()):
        try:
            first = launch(script, [*flags, *extra], runs / f"{number}-first", timeout)
            compiled = "cached in" in (first["compile"] or "")
            second = launch(script, [*flags, *extra], runs / f"{number}-second",
                            timeout) if compiled else None
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            results.append({"check": f"tta: {name}", "value": None, "passed": None,
                            "measured": f"failed: {str(error)[:200]}", "target": "reported",
                            "note": ""})
            continue
        again = (f"; second launch {second['wall_s']:.0f} s, first epoch {second['first_epoch_s']:.1f}"
                 f" s (compiled: {first['first_epoch_s']:.1f} s)" if second else "")
        results.append({
            "check": f"tta: {name}", "value": first["wall_s"], "passed": None,
            "measured": f"{first['wall_s']:.0f} s to test_acc {first['test_acc']:.4f} "
                        f"({first['epochs']} epochs, {first['steps']} steps){again}",
            "target": "reported", "note": f"{first['command']}; {first['compile'] or 'eager'}",
            "first": first, "second": second})
    return results
