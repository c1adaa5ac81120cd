"""Big video transformers on one GPU through ``litegen launch``, and FP8 linear training.

Each case is a recipe for ``real_model_entry.py`` (random weights at the published config,
synthetic latents, the zoo's flow-matching loss), written to the work folder and run by
``litegen launch`` on one rank in a process of its own; a case that runs out of device memory
is reported as such. From each run's ``metrics.jsonl``: samples/s and tokens/s (median of the
steps after ``--first``), the largest peak allocated, and the loss of every step.

Cases (``--cases``, comma-separated):

    wan14b-lora-ac        Wan 2.1 14B, LoRA rank 32, bf16-mixed, every block checkpointed
    wan14b-lora-fp8-swap  the same with the frozen base in fp8 and block swap (20 on the device)
    wan14b-full           Wan 2.1 14B, full fine-tuning: bf16 weights and AdamW state, checkpointed
    wan14b-full-offload   the same under fsdp2 with parameters, gradients and state in host memory
    hunyuan-lora-fp8-swap HunyuanVideo 13B, LoRA with fp8 base and block swap, checkpointed
    dit-bf16, dit-fp8     DiT-XL/2 compiled, bf16 autocast, without and with fp8_linear (rowwise);
                          dit-fp8-tensorwise with the tensorwise recipe
    wan-bf16, wan-fp8     Wan 2.1 1.3B compiled, the same three (wan-fp8-tensorwise)

``--tokens`` picks the length of the Wan 14B cases (latent frames, height, width), e.g.
``21x90x160`` (75,600 tokens, 81 frames at 720x1280). The FP8 pairs also print how far the fp8
loss curve is from the bf16 one, against the bf16 curve's own step-to-step noise.

    python3 -m scripts.bench.big_models --cases wan14b-lora-fp8-swap,wan14b-lora-ac --out big.json
    python3 -m scripts.bench.big_models --cases dit-bf16,dit-fp8 --steps 300 --out fp8.json
    python -m scripts.bench.big_models --tiny --device cpu --cases all    # CPU check of the recipes
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ENTRY = Path(__file__).resolve().parent / "real_model_entry.py"
CHECKPOINT_ALL = {"activation_checkpoint": {"enabled": True, "selective_ratio": 0}}
LORA = {"rank": 32, "alpha": 32, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}
BF16_MIXED = {"precision": {"preset": "bf16-mixed"}}
DIT = {"name": "dit", "samples": 256}
WAN_1_3B = {"name": "wan", "frames": 3, "samples": 8}
# Case -> (model settings, optimization section, compiled, global batch).
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], bool, int]] = {
    "wan14b-lora-ac": ({"name": "wan_14b"}, BF16_MIXED | {"lora": LORA}, False, 1),
    "wan14b-lora-fp8-swap": (
        {"name": "wan_14b"},
        BF16_MIXED | {"lora": LORA | {"fp8_base": "rowwise"}},
        False,
        1,
    ),
    "wan14b-full": (
        {"name": "wan_14b", "frames": 11, "height": 60, "width": 104},
        {"precision": {"cast_model": "bf16"}},
        False,
        1,
    ),
    "wan14b-full-offload": (
        {"name": "wan_14b", "frames": 11, "height": 60, "width": 104},
        {
            "precision": {"cast_model": "bf16"},
            "parallel": {"strategy": "fsdp2", "fsdp2": {"cpu_offload": True}},
        },
        False,
        1,
    ),
    "hunyuan-lora-fp8-swap": (
        {"name": "hunyuan_video", "frames": 16, "height": 90, "width": 160},
        BF16_MIXED | {"lora": LORA | {"fp8_base": "rowwise"}},
        False,
        1,
    ),
    "dit-bf16": (DIT, {}, True, 128),
    "wan-bf16": (WAN_1_3B, {}, True, 1),
}
# The FP8 linear training cases: each model's bf16 case with one of torchao's recipes.
for _model, _settings, _batch in (("dit", DIT, 128), ("wan", WAN_1_3B, 1)):
    for _recipe in ("rowwise", "tensorwise"):
        _name = f"{_model}-fp8" + ("" if _recipe == "rowwise" else f"-{_recipe}")
        CASES[_name] = (_settings, {"precision": {"fp8_linear": _recipe}}, True, _batch)
SWAP = {"block_swap": {"blocks_on_device": 20}}


def write_recipe(folder: Path, case: str, args: argparse.Namespace) -> Path:
    settings, optimization, compiled, batch = CASES[case]
    settings = {"size": "tiny" if args.tiny else "reference", "samples": 2} | settings
    if args.tokens and settings["name"] == "wan_14b" and "frames" not in settings:
        frames, height, width = (int(n) for n in args.tokens.split("x"))
        settings |= {"frames": frames, "height": height, "width": width}
    if args.tiny:  # the tiny configs' own shapes
        settings = {k: v for k, v in settings.items() if k not in ("frames", "height", "width")}
        batch = min(batch, 2)
    optimization = json.loads(json.dumps(optimization))  # a copy to add to
    if "lora" in optimization or case.startswith(("wan14b-full", "hunyuan")):
        optimization["memory"] = dict(CHECKPOINT_ALL)
    if case.endswith("swap"):
        optimization["memory"] |= SWAP
    optimization["compile"] = {"enabled": compiled}
    cuda = args.device == "cuda"
    # bf16 autocast on the GPU, also under fp8_linear (whose matmuls are FP8 and the rest bf16),
    # except where the precision preset sets it or the model is cast to bf16.
    precision = optimization.get("precision", {})
    autocast = cuda and not {"preset", "cast_model"} & precision.keys()
    recipe = {
        "launch": {"entry": str(ENTRY), "nproc_per_node": 1},
        "exp_name": case,
        "runtime": {"device": args.device, "distributed": {"backend": "nccl" if cuda else "gloo"}},
        "max_steps": args.steps,
        "global_batch_size": batch,
        "lr": 1e-4,
        "trainer": {"log_every": 1, "save_final": False}
        | ({"autocast": "bf16"} if autocast else {}),
        "optimization": optimization,
        "model": settings,
    }
    path = folder / f"{case}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path


def run_case(case: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    recipe = write_recipe(work, case, args)
    results = work / case
    command = [sys.executable, "-m", "litegen_cli.app", "launch", str(recipe), "--overwrite"]
    command += [f"results_dir={results}", *args.override]
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (work / f"{case}.log").write_text(proc.stdout, encoding="utf-8")
    row: dict[str, Any] = {"case": case, "rc": proc.returncode}
    if proc.returncode != 0:
        row["error"] = "out of memory" if "out of memory" in proc.stdout.lower() else "failed"
        print(f"{case}: {row['error']} (exit {proc.returncode}); log: {work / f'{case}.log'}")
        print(proc.stdout[-3000:])
        return row
    lines = (results / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    steps = [r for r in records if "samples_per_s" in r]
    timed = [r for r in steps if r["step"] > args.first] or steps[-1:]
    row["samples_per_s"] = statistics.median(r["samples_per_s"] for r in timed)
    if timed[0].get("tokens_per_s") is not None:
        row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in timed)
    row["peak_gib"] = max((r.get("peak_allocated_gib") or 0.0) for r in records)
    row["reserved_gib"] = max((r.get("peak_reserved_gib") or 0.0) for r in records)
    row["losses"] = [r["loss"] for r in steps]
    return row


def window_means(losses: list[float], window: int) -> list[float]:
    """The mean loss of each ``window`` consecutive steps.

    Example:
        >>> window_means([1.0, 3.0, 2.0, 2.0, 5.0], 2)
        [2.0, 2.0]
    """
    return [statistics.fmean(losses[i : i + window]) for i in range(0, len(losses) - 1, window)][
        : len(losses) // window
    ]


def curve_gap(reference: list[float], other: list[float], window: int = 20) -> dict[str, float]:
    """How far ``other``'s loss curve is from ``reference``'s, in the reference's own noise.

    ``gap``: the mean absolute difference of their ``window``-step means; ``noise``: the standard
    deviation of the reference's per-step loss around its window means, over sqrt(window) (the
    spread one window mean has from step-to-step noise alone).

    Example:
        >>> curve_gap([1.0, 2.0] * 10, [1.5] * 20, window=2)["gap"]
        0.0
    """
    n = min(len(reference), len(other))
    ref, oth = window_means(reference[:n], window), window_means(other[:n], window)
    gap = statistics.fmean(abs(a - b) for a, b in zip(ref, oth, strict=True))
    residuals = [x - ref[i // window] for i, x in enumerate(reference[: len(ref) * window])]
    noise = statistics.pstdev(residuals) / window**0.5
    return {"gap": gap, "noise": noise}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'case':24} {'samples/s':>10} {'tokens/s':>10} {'peak GiB':>9} {'reserved':>9}")
    for row in rows:
        if "error" in row:
            print(f"{row['case']:24} {row['error']}")
            continue
        tokens = row.get("tokens_per_s")
        print(
            f"{row['case']:24} {row['samples_per_s']:10.4f} "
            f"{'-' if tokens is None else f'{tokens:10.0f}':>10} "
            f"{row['peak_gib']:9.2f} {row['reserved_gib']:9.2f}"
        )
    by_case = {row["case"]: row for row in rows if "losses" in row}
    for case, fp8 in by_case.items():
        bf16 = by_case.get(case.split("-fp8")[0] + "-bf16")
        if "-fp8" in case and bf16 and min(len(bf16["losses"]), len(fp8["losses"])) >= 40:
            gap = curve_gap(bf16["losses"], fp8["losses"])
            speed = fp8["samples_per_s"] / bf16["samples_per_s"]
            print(
                f"{case}: fp8/bf16 speed {speed:.3f}; loss curves (20-step means) differ by "
                f"{gap['gap']:.4f}, bf16's own noise {gap['noise']:.4f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="wan14b-lora-fp8-swap,wan14b-lora-ac")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--first", type=int, default=1, help="steps left out of the rates")
    parser.add_argument("--tokens", default="21x90x160", help="Wan 14B latent frames x h x w")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny configs (a CPU check)")
    parser.add_argument("--work", default="/tmp/big_models")
    parser.add_argument("--override", action="append", default=[], help="a recipe override")
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cases = list(CASES) if args.cases == "all" else args.cases.split(",")
    rows = []
    for case in cases:
        rows.append(run_case(case, args, work))
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    print_table(rows)


if __name__ == "__main__":
    main()
