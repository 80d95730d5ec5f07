"""A wheel built from the repository, installed in a fresh virtual environment outside the
checkout, runs `specdec up` with the default head: the built-in heads are package data, and
the standalone draft model of the repository's drafts/ is not shipped."""

from __future__ import annotations

import os
import re
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True, text=True)
    (built,) = out.glob("specdec-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory, wheel) -> Path:
    """A new venv holding only the wheel; its third-party dependencies are this environment's
    site-packages, added as a path (their .pth files, the editable install's among them, are
    not run from there, so the checkout stays invisible)."""
    env = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(env)
    python = env / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, text=True)
    return env


def test_wheel_ships_the_heads_and_not_the_standalone_draft(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "specdec/drafts/smollm2-135m-eagle90/model.safetensors" in names
    assert not [n for n in names if "smollm2-135m-draft" in n]


def test_wheel_leaves_bench_dependencies_to_its_extras(wheel):
    metadata = zipfile.ZipFile(wheel).read(next(n for n in zipfile.ZipFile(wheel).namelist()
                                                if n.endswith("METADATA"))).decode()
    base = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert not [line for line in base if "matplotlib" in line or "tqdm" in line]


@pytest.mark.slow
def test_installed_wheel_runs_up_with_the_default_head(fresh_env, tmp_path):
    env = {**os.environ, "PATH": f"{fresh_env / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": ""}
    where = subprocess.run([str(fresh_env / "bin" / "python"), "-c", "import specdec; print(specdec.__file__)"],
                           cwd=tmp_path, env=env, check=True, capture_output=True, text=True).stdout
    assert str(fresh_env) in where and str(ROOT) not in where
    up = subprocess.Popen([str(fresh_env / "bin" / "specdec"), "up", "--port", "0", "--http-port", "0"], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, address = [], None
        for line in up.stdout:
            lines.append(line)
            found = re.match(r"coordinator\s+listening on (\S+)", line)
            if found:
                address = found.group(1)
                break
        assert address, "".join(lines)
        assert any("head smollm2-135m-eagle90" in line for line in lines), "".join(lines)
        result = subprocess.run([str(fresh_env / "bin" / "specdec"), "generate", "--addr", address, "--json",
                                 "--max-new-tokens", "8", "What is 2+2?"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=START_TIMEOUT_S)
        assert result.returncode == 0, result.stderr
        assert '"generated_tokens": 8' in result.stdout or '"token_ids"' in result.stdout
    finally:
        up.terminate()
        up.wait(timeout=60)
