"""Start a real `tritonserver` (from the nvidia-pytriton wheel) on a model repository, no Docker.

The wheel carries the server, the Python backend and one backend stub per Python version. The server wants a
backend directory holding `python/` = the backend library + triton_python_backend_utils.py + the stub for the
running Python, the wheel's bundled libraries on LD_LIBRARY_PATH, and this venv's bin/ first on PATH so that the
stub's embedded Python imports this project's packages.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..core.seal import SECRET_VARIABLE, create_secret_file

RUN_VARIABLE = "MOL2_SERVER_RUN"  # a fresh id per server start, seen by every model process of that run
# Triton's APIs that change the server rather than ask it for inference: loading a model is running its code (a
# Python-backend model.py sent in the load request runs as the server's user), unloading one stops its turns, and
# shared memory, trace and logging settings reach into the process. Closed on every port to any request without
# ADMIN_HEADER = the key of that start; health, metadata, model config, statistics and inference stay open.
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
ADMIN_HEADER = "mol2-admin-key"


class LaunchError(RuntimeError):
    pass


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002
    host: str = "127.0.0.1"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc}"

    @classmethod
    def free(cls) -> "Ports":
        """Three different loopback ports nothing listens on now (tests and benchmarks run their own servers). All
        three stay bound until the last is chosen: a port released at once can be handed out again (a test's
        server once got the same port for gRPC and metrics and could not start)."""
        with contextlib.ExitStack() as held:
            sockets = [held.enter_context(socket.socket()) for _ in range(3)]
            for s in sockets:
                s.bind(("127.0.0.1", 0))
            return cls(*(s.getsockname()[1] for s in sockets))


def _wheel_root() -> Path:
    try:
        import pytriton
    except ImportError:
        raise LaunchError("nvidia-pytriton is not installed: run `bash scripts/setup.sh`") from None
    return Path(pytriton.__file__).parent


def backend_directory(dest: Path) -> Path:
    """Assemble `dest/python/` from the wheel's backend and the stub for this Python version."""
    wheel = _wheel_root() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = wheel / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise LaunchError(f"the nvidia-pytriton wheel has no Python-backend stub for Python {version}")
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for source in (wheel / "backends" / "python" / "libtriton_python.so",
                   wheel / "backends" / "python" / "triton_python_backend_utils.py", stub):
        target = python_dir / source.name
        if not target.exists():
            shutil.copy2(source, target)
    return dest


def server_environment(overrides: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(overrides or {})}
    libs = _wheel_root().parent / "nvidia_pytriton.libs"
    # The stub links libpython3.X.so: make it the running interpreter's, or its stdlib's extension modules
    # (e.g. _ssl, which transformers imports) fail with undefined symbols against the system's libpython.
    own_libpython = sysconfig.get_config_var("LIBDIR") if sysconfig.get_config_var("Py_ENABLE_SHARED") else None
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [own_libpython, str(libs), env.get("LD_LIBRARY_PATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("MOL2_PYTHON", sys.executable)  # the engine model's core process runs on it (engine_model.py)
    project = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [project, env.get("PYTHONPATH")]))
    return env


def admin_key_path(workdir: Path, ports: Ports) -> Path:
    """Where a start keeps its admin key (0600): whoever may read it may use the restricted APIs."""
    return Path(workdir).resolve() / "secrets" / f"admin-{ports.http}"


def restricted_api_args(key: str) -> list[str]:
    """tritonserver's own switches that refuse RESTRICTED_APIS on HTTP and gRPC without ADMIN_HEADER: key."""
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{ADMIN_HEADER}={key}",
            f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={key}"]


def _new_admin_key(path: Path) -> str:
    key = secrets.token_hex(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(key)
    return key


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def start(model_repository: Path, ports: Ports, workdir: Path, log_path: Path | None = None,
          extra_args: list[str] = (), env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start tritonserver; `env` adds variables for its model processes (e.g. MOL2_MODEL_DIR). Each start gets a
    run id of its own (RUN_VARIABLE, for whoever needs to tell one run from another), and, unless
    `env` names one (MOL2_SECRET_FILE), a fresh secret for the seals of its internal stages (python_backend/core/seal.py):
    a file of the work folder named by the HTTP port, which no other live server can hold. The model-repository,
    shared-memory, trace and logging APIs answer only requests carrying this start's admin key (RESTRICTED_APIS),
    kept in `admin_key_path(workdir, ports)`."""
    busy = [port for port in (ports.http, ports.grpc, ports.metrics) if port_in_use(ports.host, port)]
    if busy:  # checked first: the ready probe would otherwise find the other server and report it as ours
        raise LaunchError(f"port(s) {', '.join(map(str, busy))} on {ports.host} already in use (another server?): "
                          "stop it or choose other ports (--http-port, --grpc-port, --metrics-port)")
    env = {RUN_VARIABLE: uuid.uuid4().hex, **(env or {})}
    model_repository, workdir = Path(model_repository).resolve(), Path(workdir).resolve()  # the server runs in workdir
    if not (env.get(SECRET_VARIABLE) or os.environ.get(SECRET_VARIABLE)):  # internal stages check seals with it
        env[SECRET_VARIABLE] = str(create_secret_file(workdir / "secrets" / f"http-{ports.http}", replace=True))
    admin_key = _new_admin_key(admin_key_path(workdir, ports))
    server = _wheel_root() / "tritonserver" / "bin" / "tritonserver"
    command = [str(server), f"--model-repository={model_repository}",
               f"--backend-directory={backend_directory(workdir / 'backends')}",
               f"--http-port={ports.http}", f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}",
               f"--http-address={ports.host}", f"--grpc-address={ports.host}", "--allow-metrics=true",
               "--allow-gpu-metrics=false", "--log-verbose=0",
               # Triton loads 4 models at a time by default: a fifth Python model waited for the first four
               "--model-load-thread-count=16",
               # no auto-complete: every config.pbtxt is complete, and auto-complete starts one more stub per
               # model that imports its model.py (torch for three of them) before the instance's own stub starts
               "--disable-auto-complete-config", *restricted_api_args(admin_key), *extra_args]
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    # cwd: the work folder (it holds only backends/), so that no folder of the caller's working directory can
    # shadow a package the model processes import (their Python puts the working directory on its path)
    return subprocess.Popen(command, env=server_environment(env), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=workdir)


def wait_ready(process: subprocess.Popen, ports: Ports, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LaunchError(f"tritonserver exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://{ports.http_url}/v2/health/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise LaunchError(f"tritonserver was not ready within {timeout_s:.0f} s")


def stop(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Stop the server and its whole process group: the model stubs too, even when the server died first."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:  # the group is already empty
        return
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # what is left of the group (stubs outliving the server)
    process.wait()


@contextlib.contextmanager
def running(model_repository: Path, ports: Ports, workdir: Path, log_path: Path | None = None,
            env: dict[str, str] | None = None, timeout_s: float = 300.0, extra_args: list[str] = ()):
    """A server that is ready inside the block and stopped after it."""
    process = start(model_repository, ports, workdir, log_path, extra_args, env=env)
    try:
        wait_ready(process, ports, timeout_s)
        yield ports
    finally:
        stop(process)
