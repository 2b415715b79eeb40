"""The README's "Use it" example runs as pasted."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def use_it_block() -> str:
    """The first ```python block under "## Use it"."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Use it\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"^```python\n(.*?)^```$", section, re.S | re.M)
    assert match, 'README.md has no ```python block under "## Use it"'
    return match.group(1)


def test_use_it_runs(tmp_path):
    script = tmp_path / "use_it.py"
    script.write_text(use_it_block())
    env = {**os.environ, "IRMINSUL_COMPILE_DECODE": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
