"""``benchmarks/lamb_layers.py``: what it measures of each layer's step is what LAMB defines."""

import json
import math
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.slow
def test_lamb_moves_each_layer_by_lr_times_its_norm_and_the_compression_stage_is_measured(
    tmp_path,
):
    """Plain LAMB moves every nonzero layer whose trust ratio is not clipped by exactly
    ``lr·||p||``, so its relative step must measure 1; after 1-bit LAMB's freeze every layer gets
    the two parts of its trust ratio, which multiply to the ratio the step used."""
    text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text()
    (tmp_path / "data.txt").write_text(text)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "lamb_layers.py", "--data", str(tmp_path / "data.txt"),
         "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--workers", "2",
         "--layers", "1", "--width", "32", "--heads", "2", "--block-size", "16",
         "--batch-size", "2", "--steps", "6", "--eval-every", "3", "--eval-windows", "8",
         "--no-progress", "--compare", "lamb,onebit-lamb:warmup=fp32:freeze=3"],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lamb, onebit = json.loads((out / "layers.json").read_text())
    assert lamb["layers"] == onebit["layers"] and len(lamb["records"]) == 6
    checked = 0
    for record in lamb["records"]:
        for rel, coeff in zip(record["rel"], record["coeff"]):
            if 0.01 < coeff < 10.0 and not math.isnan(rel):  # nan: ||p|| was 0 (a bias)
                assert rel == pytest.approx(1.0, rel=1e-3)
                checked += 1
    assert checked > len(lamb["layers"])
    after = [r for r in onebit["records"] if r["stage"] == "compression"]
    assert [r["step"] for r in after] == [4, 5, 6]
    for record in after:
        for frozen, factor, coeff in zip(record["frozen"], record["factor"], record["coeff"]):
            assert coeff == pytest.approx(frozen * factor, rel=1e-5)
    summary = (out / "layers.md").read_text()
    assert all(f"| {name} |" in summary for name in onebit["layers"])
