"""scripts/gpu_verify_next.sh says what it owes in a form a program reads: `--owed` prints one part
a line (nothing when nothing is owed), and each one it prints is a part the script can run."""

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_verify_next.sh"


def test_every_owed_part_is_one_the_script_runs():
    done = subprocess.run(["bash", str(SCRIPT), "--owed"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stderr == ""
    owed = done.stdout.splitlines()
    defined = set(re.findall(r'^if \[ "\$PART" = (\w+) \]; then$', SCRIPT.read_text(), flags=re.M))
    assert all(re.fullmatch(r"\w+", part) for part in owed), owed   # one bare name a line
    assert set(owed) <= defined, set(owed) - defined
    assert len(owed) == len(set(owed))
