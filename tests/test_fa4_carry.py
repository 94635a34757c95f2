"""benchmarks/peers/fa4_carry.sh: unpacks what came of its two carries and refuses what it cannot do
(CPU; `prepare` needs the package registry and is not run here)."""

import os
import subprocess
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "fa4_carry.sh"


def run(args, tmp_path):
    env = os.environ | {"FA4_CARRY": str(tmp_path / "carry"), "FA4_SITE": str(tmp_path / "site")}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_usage_and_nothing_to_unpack(tmp_path):
    r = run([], tmp_path)
    assert r.returncode == 2 and "usage" in r.stderr
    r = run(["unpack"], tmp_path)
    assert r.returncode == 2 and "nothing to unpack" in r.stderr


def test_wheels_are_unzipped_into_one_folder(tmp_path):
    wheels = tmp_path / "carry" / "wheels"
    wheels.mkdir(parents=True)
    # Two wheels sharing a package folder, as the DSL's do: both files must survive.
    for name, member in (("a-1-py3-none-any.whl", "pkg/a.py"), ("b-1-py3-none-any.whl", "pkg/b.py")):
        with zipfile.ZipFile(wheels / name, "w") as z:
            z.writestr(member, f"X = {name!r}\n")
    r = run(["unpack"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "site" / "pkg" / "a.py").exists() and (tmp_path / "site" / "pkg" / "b.py").exists()
