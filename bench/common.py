"""What every benchmark records next to its numbers: the machine, the commit, where output goes."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def machine() -> dict:
    import torch
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=OUT.parent).stdout.strip()
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": commit,
            "cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def out_path(name: str) -> Path:
    """bench/out/<name>-<timestamp> without a suffix; callers add .json and .png."""
    OUT.mkdir(exist_ok=True)
    return OUT / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def save(name: str, result: dict, plot) -> Path:
    """Writes bench/out/<name>-<timestamp>.json and the PNG that `plot(result, png_path)` draws."""
    import json

    import matplotlib
    matplotlib.use("Agg")  # no screen needed
    path = out_path(name)
    path.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path.with_suffix('.json')} and .png")
    return path
