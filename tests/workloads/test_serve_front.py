"""The replica's front never imports torch: only its engine's process does (runners.workloads.serve_engine).

Each replica start paid torch's import twice (about 1.5 CPU-seconds each) while the front only parses
arguments, checks requests, speaks HTTP and forwards requests over a pipe. This runs the front's work in a
fresh interpreter, where nothing else imported torch already; test_serve.py checks a running replica's two
processes (the front maps no torch library, its engine does).
"""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e

FRONT = """
import pickle, sys
from runners.workloads import serve
args = serve.parse_args(["--checkpoint", "x", "--device", "auto"], {})
settings = serve.settings_from(args)
assert serve.check_request({"prompt": "hi", "max_tokens": 4}, settings, frozenset(b"hi"))[1] == 4
serve.FrontMetrics()
# What the spawned engine's process is handed: named by reference; it, not the front, imports the engine.
assert pickle.loads(pickle.dumps(serve._engine_process)) is serve._engine_process
print(sorted(name for name in sys.modules if name.split(".")[0] == "torch"))
print(sorted(name for name in sys.modules if name.startswith("runners.")))
"""


def test_the_front_imports_no_torch_and_not_the_engine():
    done = subprocess.run([sys.executable, "-c", FRONT], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    torch_modules, runners_modules = done.stdout.splitlines()
    assert torch_modules == "[]", torch_modules
    assert "'runners.workloads.serve'" in runners_modules
    assert "serve_engine" not in runners_modules and "'runners.workloads.train'" not in runners_modules
