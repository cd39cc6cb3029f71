"""The frameworks stay optional: importing onebit, its integrations package or the DeepSpeed
translator imports none of them."""

import subprocess
import sys

FRAMEWORKS = ["transformers", "accelerate", "lightning", "deepspeed", "torchtitan"]


def test_importing_onebit_imports_no_framework():
    code = (
        "import sys, onebit, onebit.integrations, onebit.integrations.deepspeed; "
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
