"""scripts/k2's reinstall rule (README, "Set up and go"): `pip install -e '.[dev]'` runs on the first call,
again whenever pyproject.toml changed since the last successful install (its sha256 in
.venv/.k2-pyproject.sha256) or the entry points are missing, and never otherwise; a failed install marks
nothing installed, so the next call retries.

The script runs for real, on a copy of the checkout whose .venv holds stand-ins: ``bin/python`` logs
every ``-m pip`` call and passes every other call to this interpreter (the script's own checks: Python
3.12, the sha256), ``bin/uv`` logs its install and creates the ``k2-train`` entry point. Nothing is
downloaded or installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from support import REPO


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "k2", root / "scripts" / "k2")
    (root / "pyproject.toml").write_text('[project]\nname = "k2-launcher"\nversion = "0"\n')
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    _executable(
        bin_dir / "python",
        f"""#!/usr/bin/env bash
if [[ "$1" == "-m" && "$2" == "pip" ]]; then
  echo "pip $*" >> {log}
  [[ " $* " == *" -e "* && -n "${{K2_TEST_FAIL_INSTALL:-}}" ]] && exit 1
  cat > "$(dirname "$0")/uv" <<'EOF'
#!/usr/bin/env bash
echo "uv $*" >> {log}
[[ -n "${{K2_TEST_FAIL_INSTALL:-}}" ]] && exit 1
touch "$(dirname "$0")/k2-train" && chmod +x "$(dirname "$0")/k2-train"
EOF
  chmod +x "$(dirname "$0")/uv"
  exit 0
fi
exec {sys.executable} "$@"
""",
    )
    return root


def _setup(root: Path, **env: str) -> tuple[int, list[str]]:
    log = root.parent / "calls.log"
    log.unlink(missing_ok=True)
    proc = subprocess.run(
        [str(root / "scripts" / "k2"), "setup"], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return proc.returncode, [c for c in calls if c.startswith("uv pip install") or " -e " in c]


def _stamp(root: Path) -> str | None:
    path = root / ".venv" / ".k2-pyproject.sha256"
    return path.read_text().strip() if path.exists() else None


def _sha(root: Path) -> str:
    return hashlib.sha256((root / "pyproject.toml").read_bytes()).hexdigest()


def test_install_runs_on_first_call_on_change_and_after_a_failure_only(tmp_path):
    root = _checkout(tmp_path)

    rc, installs = _setup(root)  # first call: install, then stamp
    assert rc == 0 and len(installs) == 1 and "-e .[dev]" in installs[0], installs
    assert _stamp(root) == _sha(root)

    rc, installs = _setup(root)  # nothing changed: no install
    assert rc == 0 and installs == []

    with open(root / "pyproject.toml", "a") as f:  # a dependency changed
        f.write('dependencies = ["tqdm"]\n')
    old = _stamp(root)
    rc, installs = _setup(root, K2_TEST_FAIL_INSTALL="1")  # uv fails, pip's fallback fails too
    assert rc != 0 and len(installs) == 2, installs  # uv, then pip -e
    assert _stamp(root) == old != _sha(root)  # nothing marked installed

    rc, installs = _setup(root)  # the next call retries, and succeeds
    assert rc == 0 and len(installs) == 1
    assert _stamp(root) == _sha(root)

    (root / ".venv" / "bin" / "k2-train").unlink()  # entry points gone: reinstall though the stamp matches
    rc, installs = _setup(root)
    assert rc == 0 and len(installs) == 1 and (root / ".venv" / "bin" / "k2-train").exists()


def test_the_test_command_says_first_whether_the_slurm_tests_change_this_machine(tmp_path):
    """`scripts/k2 test` (README): without Slurm installed, one note before the suite says that the Slurm
    tests are skipped and that K2_INSTALL_SLURM=1 installs it and runs them; with K2_INSTALL_SLURM=1 the note
    says they install it (as CI asks, .ci/run); with Slurm installed and no opt-in, no note. pytest is a
    stand-in (nothing runs); pyproject's `-ra` has pytest count the skips with their reasons. "Installed"
    is slurmctld and munged on PATH: stand-ins in a directory of this test's."""
    root = _checkout(tmp_path)
    python = root / ".venv" / "bin" / "python"
    text = python.read_text()
    _executable(
        python,
        text.replace(
            'if [[ "$1" == "-m" && "$2" == "pip" ]]; then',
            'if [[ "$1" == "-m" && "$2" == "pytest" ]]; then exit 0; fi\nif [[ "$1" == "-m" && "$2" == "pip" ]]; then',
            1,
        ),
    )
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    # PATH without the system's sbin directories (where Debian puts slurmctld and munged)
    path = ":".join(d for d in os.environ["PATH"].split(":") if "sbin" not in d)
    env = {k: v for k, v in os.environ.items() if k not in ("K2_INSTALL_SLURM", "PATH")}

    def run(**extra):
        return subprocess.run(
            [str(root / "scripts" / "k2"), "test"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, "PATH": path, **extra},
        )

    p = run()
    assert p.returncode == 0, p.stderr
    assert (
        "Slurm is not installed here, so the Slurm tests" in p.stderr
        and "K2_INSTALL_SLURM=1 scripts/k2 test installs slurm-wlm and munge" in p.stderr
    ), p.stderr
    assert p.stderr.index("slurm-wlm") < p.stderr.index("+ python -m pytest"), p.stderr
    p = run(K2_INSTALL_SLURM="1")
    assert p.returncode == 0 and "the Slurm tests (tests/integration/test_slurm_*.py) install slurm-wlm" in p.stderr
    for name in ("slurmctld", "munged"):
        _executable(sbin / name, "#!/bin/sh\n")
    p = run(PATH=f"{sbin}:{path}")
    assert p.returncode == 0 and "slurm-wlm" not in p.stderr, p.stderr
