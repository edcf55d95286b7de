"""scripts/sdpa_backends.py, the probe of the masked attention's kernels, on the CPU: it runs the kernels the CPU
has, checks them against float64, lists the others with their error, and writes its JSON (on a GPU the same
script times them: docs/gpu/2026-11-28-budget)."""

import json
import os
import subprocess
import sys

from conftest import REPO


def test_the_probe_checks_each_kernel_against_float64_and_names_those_it_cannot_run(tmp_path):
    out = tmp_path / "sdpa.json"
    script = os.path.join(REPO, "scripts", "sdpa_backends.py")
    done = subprocess.run(
        [sys.executable, script, "--out", str(out), "--repeats", "1"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["heads"] == 8 and report["head_dim"] == 64
    assert [s["attention"] for s in report["shapes"]] == ["self", "cross"]
    for shape in report["shapes"]:
        assert shape["math"]["ms"] > 0 and shape["math"]["max_err"] < 1e-4, shape  # float32 against float64
        assert shape["flash_unmasked"]["ms"] > 0, shape  # a bound: no error to check
        assert "error" in shape["efficient"] and "error" in shape["cudnn"], shape  # kernels a CPU lacks
        assert "flex" not in shape, shape  # compiled on a GPU only
