"""The GPU check's report: gpu-check.json (every figure) and gpu-check.md, rewritten as each row of
the plan ends, so a check cut short still leaves what finished; the targets, each met or missed.
"""

import re
from pathlib import Path

from bench import tools
from common.files import write_json

LARGE_MODEL, LARGE_SIZE = "torchvision:resnet50", 224
TARGETS = {  # the targets the reports in docs/gpu/ are held to
    "overhead": "train_single within 3 % of the plain loop (ResNet-18, 32 px, fp32, 1 GPU)",
    "data_wait": "data wait under 1 % (every ResNet-18 script row)",
    "epoch": "a 50,000-image epoch of ResNet-18 at 32 px in bf16 on one H100 in under 2 s",
    "graphs_epoch": "that epoch with CUDA graphs (--compile-mode reduce-overhead) in under 0.7 s",
    "defaults": "train_single's defaults (--compile auto, batch 128) at >= 0.85x the img/s of the "
                "fastest train_single row measured (ResNet-18, 1 GPU)",
}
# What a check on one GPU, its processes sharing it, proves and does not (said in every report).
LIMITS = ("Several processes on one GPU (--share-gpus) prove the multi-process code paths on CUDA "
          "tensors: the collectives (NCCL's or gloo's), SyncBatchNorm, FSDP2's sharding and sharded "
          "checkpoints, each process's RNG, CUDA graphs under DDP. They do not prove speed or "
          "scaling (the processes take turns on one GPU; their img/s and memory are no multi-GPU "
          "figures), nor device placement (a process that used cuda:0 instead of its own GPU is "
          "invisible when there is one), nor copies between GPUs, peer-to-peer or NVLink: those "
          "need a machine with several GPUs.")


def device_slug(name: str) -> str:
    """The report's file name under docs/gpu/ for a device kind: 'NVIDIA H100 80GB HBM3' ->
    nvidia-h100-80gb-hbm3."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-gpu"


def evaluate_targets(rows: list[dict], gpu_names: list[str]) -> list[dict]:
    """Each target with what was measured and whether it was met (None: not measured, or not
    applicable)."""
    ok = [r for r in rows if r.get("img_per_s")]
    results = {key: {"target": text, "measured": "not measured", "met": None}
               for key, text in TARGETS.items()}
    single = next((r for r in ok if r["strategy"] == "single" and r["per_gpu_batch"] == 128
                   and r["vs_plain"]), None)
    if single:
        results["overhead"].update(measured=f"{single['vs_plain']:.3f}x the plain loop",
                                   met=single["vs_plain"] >= 0.97)
    worst = max((r for r in ok if r["data_wait_frac"] is not None),
                key=lambda r: r["data_wait_frac"], default=None)
    if worst:
        results["data_wait"].update(met=worst["data_wait_frac"] < 0.01, measured=(
            f"at most {100 * worst['data_wait_frac']:.2f} % ({worst['label']}, "
            f"batch {worst['per_gpu_batch']})"))
    defaults = next((r for r in ok if r["strategy"] == "defaults" and r["per_gpu_batch"] == 128),
                    None)
    fastest = max((r for r in ok if r["script"] == "train_single.py" and r["gpus"] == 1),
                  key=lambda r: r["img_per_s"], default=None)
    if defaults and fastest:
        ratio = defaults["img_per_s"] / fastest["img_per_s"]
        results["defaults"].update(met=ratio >= 0.85, measured=(
            f"{ratio:.2f}x ({defaults['img_per_s']:,.0f} vs {fastest['img_per_s']:,.0f} img/s, "
            f"{fastest['label']}, batch {fastest['per_gpu_batch']})"))
    on_h100 = any("H100" in name for name in gpu_names)
    for key, graphs, limit in (("epoch", False, 2), ("graphs_epoch", True, 0.7)):
        fastest = min((r for r in ok if r["precision"] == "bf16" and r["gpus"] == 1
                       and (r["strategy"] == "bf16-graphs") == graphs),
                      key=lambda r: r["epoch_50k_s"], default=None)
        if fastest:
            results[key].update(met=fastest["epoch_50k_s"] < limit if on_h100 else None, measured=(
                f"{fastest['epoch_50k_s']:.2f} s ({fastest['label']}, batch "
                f"{fastest['per_gpu_batch']})" + ("" if on_h100 else
                f"; set for an H100, this is {', '.join(sorted(set(gpu_names)))}")))
    return list(results.values())


def _cell(value, form: str, unit: str = "", scale: float = 1) -> str:
    return "-" if value is None else format(value * scale, form) + unit


def _figures(figures: dict) -> str:
    shown = [f"{k} {format(v, '.4g') if isinstance(v, float) else v}" for k, v in figures.items()
             if k != "criterion"]
    return _escape("; ".join(shown)) or "-"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")  # a table cell ends at a bare |


def render_markdown(report: dict) -> str:
    """gpu-check.md from the report (gpu-check.json's content)."""
    m, checks = report["machine"], report["checks"]
    counts = {s: sum(c["status"] == s for c in checks)
              for s in ("passed", "failed", "error", "skipped")}
    gpus = ", ".join(f"{g['name']} (cc {g['capability']}, {g['memory_gb']} GB)"
                     for g in m["gpus"]) or "none"
    v = m["versions"]
    lines = [f"# GPU check: {report['device']}", "",
             f"{verdict(report)}. Checks: {counts['passed']} passed, "
             f"{counts['failed']} failed, {counts['error']} errors, {counts['skipped']} skipped. "
             f"Started {report['started']}, {report['duration_s'] / 60:.0f} min. "
             f"Command: `{report['command']}`", "",
             "## Machine", "",
             f"- GPUs ({len(m['gpus'])}, CUDA_VISIBLE_DEVICES {m['cuda_visible_devices']}): {gpus}",
             f"- driver {m['driver']}; torch {v['torch']}, CUDA {m['cuda']}, cuDNN {m['cudnn']}, "
             f"NCCL {m['nccl']}, accelerate {v['accelerate']}, Python {v['python']}",
             f"- CPU: {m['cpu']}, {m['cpu_cores']} cores; {m['platform']}", "",
             *plan_section(report.get("plan", [])),
             "## Targets", "", tools.markdown_table(["target", "measured", "result"], [
                 [t["target"], t["measured"],
                  {True: "met", False: "**missed**", None: "-"}[t["met"]]]
                 for t in report["targets"]]), "",
             "## Checks (tests/test_gpu.py)", "",
             tools.markdown_table(["check", "result", "figures", "s"], [
                 [c["name"], c["status"] if c["status"] == "passed" else
                  f"**{c['status']}**: {_escape(c['message'])}",
                  _figures(c["figures"]), f"{c['seconds']:.0f}"] for c in checks]), ""]
    criteria = {c["figures"]["criterion"] for c in checks if "criterion" in c["figures"]}
    lines += ["Pass criteria:", "", *sorted(f"- {text}" for text in criteria), ""]
    rows = [r for run in report["benchmark"] for r in run["rows"]]
    if report["benchmark"]:
        lines += ["## ResNet-18, 32 px, synthetic data: the scripts (scripts/benchmark.py)", "",
                  tools.markdown_table(["script", "precision", "GPUs", "batch per GPU", "img/s",
                                        "50,000-image epoch", "speed-up", "vs plain loop",
                                        "data wait", "peak memory per GPU (GB)"], [
                      [f"`{r['strategy']}`: {r['label']}", r["precision"], str(r["gpus"]),
                       str(r["per_gpu_batch"]),
                       *([f"failed: {_escape(r['error'])}"] + [""] * 5 if r["error"] else
                         [_cell(r["img_per_s"], ",.0f"), _cell(r["epoch_50k_s"], ".2f", " s"),
                          _cell(r["speedup"], ".2f", "x"), _cell(r["vs_plain"], ".3f", "x"),
                          _cell(r["data_wait_frac"], ".2f", " %", scale=100),
                          ", ".join(f"{gb:.2f}" for gb in r["peak_memory_gb"]) or "-"])]
                      for r in rows]), "",
                  "vs plain loop: img/s over GPUs x the img/s of bench/tools.py's PlainLoop (same "
                  "model, precision and batch per GPU, batches already normalised on the GPU, "
                  "nothing but forward, loss, backward, step), measured in the same benchmark run; "
                  "fp16 has no plain loop. The plain fp32 loop runs in NCHW without "
                  "cudnn.benchmark, the scripts in channels_last with it; the bf16 loop in "
                  "channels_last. Peak memory, as benchmark.py measured it: " + ("; ".join(sorted(
                      {r["memory_kind"] for r in rows
                       if r["peak_memory_gb"] and r["memory_kind"]})) or "-")
                  + " (nvidia-smi: the largest rise of memory.used, CUDA context included).", ""]
        for run in report["benchmark"]:
            state = "ran" if run["returncode"] == 0 else f"**exit status {run['returncode']}**"
            lines.append(f"- `{run['name']}` ({state}, {run['folder']}/): `{run['command']}`")
        lines.append("")
        bench_checks = [{**c, "check": f"{run['name']}: {c['check']}"}
                        for run in report["benchmark"] for c in run["checks"]]
        if bench_checks:
            lines += ["Benchmark checks:", "", tools.check_table(bench_checks), ""]
    if report["resnet50"]:
        lines += [f"## ResNet-50 ({LARGE_MODEL}), {LARGE_SIZE} px, synthetic data: "
                  f"the plain loop", "",
                  tools.markdown_table(["precision", "batch", "img/s", "ms per image",
                                        "50,000-image epoch", "peak memory (GB, allocated)"], [
                      [r["precision"], str(r["batch"]),
                       *([f"not run: {r['error']}", "", "", ""] if r["error"] else
                         [f"{r['img_per_s']:,.0f}", f"{1000 / r['img_per_s']:.2f}",
                          f"{r['epoch_50k_s']:.1f} s",
                          _cell(r["peak_memory_gb"], ".2f")])] for r in report["resnet50"]]), "",
                  "The training script's row at this size, train_single.py --image-size 224 "
                  "through --loader workers with its data wait, is the benchmark's workers check "
                  "above (1gpu-b128). The plain loop runs with TF32, cudnn.benchmark and "
                  "channels_last, as the scripts do.", ""]
    lines += [f"Every figure: gpu-check.json. Keep this report as docs/gpu/{report['slug']}.md.",
              ""]
    return "\n".join(lines)


def build_report(machine_info: dict, checks: list[dict], benchmark: list[dict],
                 resnet50: list[dict], started: str, duration_s: float, command: str,
                 plan: list[dict] = ()) -> dict:
    """The report; ``plan``: each row of the plan with its status ("planned" before it runs, "not
    run" with its reason, or how it ended) and seconds."""
    names = [g["name"] for g in machine_info["gpus"]]
    rows = [r for run in benchmark for r in run["rows"]]
    passed = (all(c["status"] in ("passed", "skipped") for c in checks)
              and all(run["returncode"] == 0 and not any(r["error"] for r in run["rows"])
                      for run in benchmark)
              and not any(p["status"] in ("failed", "error") for p in plan))  # pytest died early
    device = names[0] if len(set(names)) == 1 else " + ".join(sorted(set(names))) or "no GPU"
    return {"device": f"{len(names)} x {device}" if len(names) > 1 else device,
            "slug": device_slug(device), "started": started, "duration_s": round(duration_s, 1),
            "command": command, "passed": passed, "machine": machine_info,
            "targets": evaluate_targets(rows, names), "checks": checks,
            "benchmark": benchmark, "resnet50": resnet50, "plan": list(plan),
            "unfinished": [p["name"] for p in plan if p["status"] in UNFINISHED
                           or p["status"] == "not run" and "out of time" in p["message"]]}


def write_report(folder: Path, report: dict) -> None:
    write_json(folder / "gpu-check.json", report)
    (folder / "gpu-check.md").write_text(render_markdown(report))


UNFINISHED = ("planned", "running", "cut")  # a row the check's time ran out on is one of these


def verdict(report: dict) -> str:
    """FAIL where a check failed, INCOMPLETE where planned rows did not finish (both can hold)."""
    unfinished = report.get("unfinished", [])
    incomplete = f"INCOMPLETE ({len(unfinished)} planned rows did not finish)" if unfinished else ""
    if not report["passed"]:
        return "FAIL" + (f", {incomplete}" if incomplete else "")
    return incomplete or "PASS"


def plan_section(plan: list[dict]) -> list[str]:
    """The plan in its order: each row, its estimate and what became of it."""
    if not plan:
        return []
    return ["## Plan (bench/gpu_plan.py, in order of value)", "", tools.markdown_table(
        ["row", "what it proves", "estimate", "took", "result"],
        [[f"`{p['name']}`", _escape(p["proves"]), f"{p['estimate_s']} s",
          _cell(p.get("seconds"), ".0f", " s"),
          _escape(p["status"] + (f": {p['message']}" if p.get("message") else ""))]
         for p in plan]), "", "Limits: " + LIMITS, ""]
