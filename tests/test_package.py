"""The distribution: one `stalwart` namespace from the top-level folders, normal and editable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SUBPACKAGES = ["proto", "coord", "ckpt", "daemon", "agent", "trainer", "chaos", "cli"]
IMPORT_ALL = "; ".join(f"import stalwart.{p}" for p in SUBPACKAGES)


def test_editable_install_maps_every_folder() -> None:
    code = IMPORT_ALL + "; import stalwart.coord as c; print('PATH=' + c.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert Path(_marked(out.stdout)[0]).resolve() == REPO / "coord" / "__init__.py"


def _marked(stdout: str) -> list[str]:
    """Lines the test printed (imported libraries may print their own)."""
    return [line[5:] for line in stdout.splitlines() if line.startswith("PATH=")]


def test_normal_install_imports_every_subpackage(tmp_path: Path) -> None:
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir),
         str(REPO)], capture_output=True, text=True)
    if build.returncode != 0:
        pytest.fail(f"building the wheel failed:\n{build.stderr}")
    wheels = list(wheel_dir.glob("stalwart-*.whl"))
    assert len(wheels) == 1
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    str(wheels[0])], check=True, capture_output=True)
    code = (f"import sys; sys.path.insert(0, {str(target)!r}); " + IMPORT_ALL +
            "; import stalwart.coord as c, stalwart.proto.agent_pb2 as a; print('PATH=' + c.__file__); "
            "print('PATH=' + a.__file__)")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd="/",
                         env={"PYTHONPATH": ":".join(p for p in sys.path if "site-packages" in p)})
    assert out.returncode == 0, out.stderr
    paths = _marked(out.stdout)
    assert len(paths) == 2
    for line in paths:
        assert line.startswith(str(target)), line
    assert (target / "stalwart" / "proto" / "agent.proto").is_file()
    assert not (target / "stalwart" / "tests").exists()


def test_cli_help_and_version() -> None:
    exe = Path(sys.executable).parent / "stalwart"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True)
    for command in ("version", "demo"):
        assert command in out.stdout
    out = subprocess.run([str(exe), "version", "--json"], capture_output=True, text=True, check=True)
    import json

    versions = json.loads(out.stdout)
    assert versions["stalwart"] == "0.1.0"
    assert versions["torch"].startswith("2.13.0")
    bad = subprocess.run([str(exe), "no-such-command"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
