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


def _write_halves(cu13, payload):
    import hashlib
    cu13.mkdir(parents=True)
    half = (len(payload) + 1) // 2
    lines = []
    for i, chunk in enumerate((payload[:half], payload[half:])):
        (cu13 / f"part{i}").write_bytes(chunk)
        lines.append(f"{hashlib.sha256(chunk).hexdigest()}  part{i}\n")
    (cu13 / "parts.sha256").write_text("".join(lines))


def _xz_tar_of(tmp_path, files):
    import io
    import lzma
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return lzma.compress(buf.getvalue())


def test_library_halves_over_two_calls(tmp_path):
    payload = _xz_tar_of(tmp_path, {"lib/x.so": "x" * 5000, "lib/y.py": "Y = 1\n"})
    src = tmp_path / "all" / "cu13"
    _write_halves(src, payload)
    cu13 = tmp_path / "carry" / "cu13"
    cu13.mkdir(parents=True)
    # First call: one half and the manifest; nothing unpacked yet.
    for f in ("part0", "parts.sha256"):
        (cu13 / f).write_bytes((src / f).read_bytes())
    r = run(["unpack"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "waiting for part1" in r.stdout and not (tmp_path / "site" / "lib").exists()
    # Second call: the other half only (the first one's carry is gone); the library comes out whole.
    (cu13 / "part0").unlink()
    (cu13 / "part1").write_bytes((src / "part1").read_bytes())
    r = run(["unpack"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "site" / "lib" / "x.so").read_text() == "x" * 5000


def test_a_damaged_half_is_refused(tmp_path):
    payload = _xz_tar_of(tmp_path, {"lib/x.so": "x" * 5000})
    cu13 = tmp_path / "carry" / "cu13"
    _write_halves(cu13, payload)
    data = bytearray((cu13 / "part1").read_bytes())
    data[-1] ^= 0xFF
    (cu13 / "part1").write_bytes(bytes(data))
    r = run(["unpack"], tmp_path)
    assert r.returncode == 1 and "damaged" in r.stderr
    assert not (tmp_path / "site" / "lib").exists()
