"""What distcomm finds on this machine, for bug reports: `python -m distcomm.info [--json]`.

Modelled on torch's `collect_env` and Open MPI's `ompi_info`: distcomm's version,
Python, numpy, mpi4py and the MPI library, CuPy with CUDA, NCCL and the GPUs, which
backends can run here (and why not), thread settings and CPU affinity, the size and free
space of /dev/shm, the launcher this process was started by, and the DISTCOMM_*
variables set. Nothing is initialised: MPI is asked only what MPI allows before
`MPI_Init` (its version and library string), and no group or store is made, so it runs
as well under `mpiexec` or `srun` as in a shell.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from collections.abc import Mapping
from typing import Any

from .errors import BackendUnavailableError

__all__ = ["collect", "main", "render"]


def _mpi() -> dict[str, Any]:
    try:
        import mpi4py
    except ImportError:
        return {"mpi4py": None, "why_not": "mpi4py is not installed: pip install 'distcomm[mpi]'"}
    info: dict[str, Any] = {"mpi4py": mpi4py.__version__}
    if "mpi4py.MPI" not in sys.modules:
        # MPI_Get_version and MPI_Get_library_version may be called before MPI_Init
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
    try:
        from mpi4py import MPI
    except Exception as exc:  # the MPI library itself failed to load
        info["why_not"] = f"mpi4py.MPI failed to import: {exc}"
        return info
    info["mpi_standard"] = "{}.{}".format(*MPI.Get_version())
    info["library"] = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    info["initialized"] = bool(MPI.Is_initialized())
    return info


def _gpu() -> dict[str, Any]:
    from .gpu.runtime import INSTALL_HINT, load_cupy

    try:
        cupy = load_cupy()
    except BackendUnavailableError as exc:  # the message says which case, and what to do
        return {"cupy": None, "why_not": str(exc)}
    except Exception as exc:  # a CUDA library that fails to load
        return {
            "cupy": None,
            "why_not": f"CuPy failed to import ({type(exc).__name__}: {exc}); {INSTALL_HINT}",
        }
    info: dict[str, Any] = {"cupy": cupy.__version__}
    runtime = cupy.cuda.runtime
    try:
        info["cuda_runtime"] = runtime.runtimeGetVersion()
        info["cuda_driver"] = runtime.driverGetVersion()
        count = runtime.getDeviceCount()
        info["devices"] = [
            runtime.getDeviceProperties(i)["name"].decode(errors="replace") for i in range(count)
        ]
    except Exception as exc:  # no driver, no device
        info["devices"] = []
        info["why_not"] = f"CUDA: {exc}"
    try:
        from cupy.cuda import nccl

        from .gpu.nccl import build_version, version_text

        if not getattr(nccl, "available", False):  # CuPy without an NCCL library
            raise ImportError("CuPy found no NCCL library")
        info["nccl"] = int(nccl.get_version())
        info["nccl_version"] = version_text(info["nccl"])
        built = build_version(nccl)
        info["nccl_built"] = ".".join(map(str, built)) if built is not None else None
    except Exception as exc:
        info["nccl"] = None
        info["nccl_why_not"] = f"{type(exc).__name__}: {exc}"
    return info


def _nccl_line(gpu: dict[str, Any]) -> str:
    """ "2.28.9 (CuPy built against 2.27.7)", or why there is no NCCL."""
    if gpu.get("nccl") is None:
        return f"N/A ({gpu['nccl_why_not']})" if gpu.get("nccl_why_not") else "N/A"
    built = gpu.get("nccl_built")
    return gpu["nccl_version"] + (f" (CuPy built against {built})" if built else "")


def _backends() -> dict[str, Any]:
    from .backends import registered_backends

    found: dict[str, Any] = {}
    for name, record in sorted(registered_backends().items()):
        try:
            why = record.availability()
        except Exception as exc:  # a plug-in whose module does not import
            why = f"its factory failed to load: {type(exc).__name__}: {exc}"
        found[name] = {
            "devices": list(record.devices),
            "available": not why,
            "why_not": why or None,
        }
    return found


def _threads() -> dict[str, Any]:
    from .parallel import get_num_interop_threads, get_num_threads, physical_cores

    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "num_threads": get_num_threads(),
        "num_interop_threads": get_num_interop_threads(),
        "physical_cores": physical_cores(),
        "logical_cpus": os.cpu_count(),
        "affinity": affinity,
        "variables": {
            name: os.environ[name]
            for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
            if name in os.environ
        },
    }


def _shm(path: str = "/dev/shm") -> dict[str, Any]:
    try:
        usage = shutil.disk_usage(path)
    except OSError as exc:
        return {"path": path, "why_not": str(exc)}
    return {"path": path, "total_bytes": usage.total, "free_bytes": usage.free}


def _launcher(env: Mapping[str, str]) -> dict[str, Any]:
    from .launcher_env import mpi_launcher, srun_task

    started_by = []
    if env.get("DISTCOMM_RUN_ID") or env.get("TORCHELASTIC_RUN_ID"):
        started_by.append("distcomm-run or torchrun")
    mpi = mpi_launcher(env)
    if mpi is not None:
        started_by.append(f"{mpi[1]} (mpiexec/mpirun; {mpi[0]} is set)")
    if srun_task(env):
        started_by.append("srun (Slurm job step)")
    elif env.get("SLURM_JOB_ID"):
        started_by.append("inside a Slurm allocation, not by srun")
    keys = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "PMIX_RANK",
        "SLURM_JOB_ID",
        "SLURM_PROCID",
        "SLURM_NTASKS",
    )
    return {
        "started_by": started_by or ["a shell (no launcher detected)"],
        "variables": {k: env[k] for k in keys if k in env},
    }


def collect(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Everything `python -m distcomm.info` reports, as a JSON-ready dict."""
    import numpy

    from . import __file__ as package_file
    from . import __version__

    env = os.environ if env is None else env
    return {
        "distcomm": {"version": __version__, "path": os.path.dirname(package_file)},
        "python": {
            "version": platform.python_version(),
            "executable": sys.executable,
            "platform": platform.platform(),
        },
        "numpy": numpy.__version__,
        "mpi": _mpi(),
        "gpu": _gpu(),
        "backends": _backends(),
        "threads": _threads(),
        "shm": _shm(),
        "launcher": _launcher(env),
        "distcomm_variables": {k: v for k, v in sorted(env.items()) if k.startswith("DISTCOMM_")},
    }


def _size(n: int) -> str:
    """Bytes in GiB, or MiB below 1 GiB (a container's 64 MiB /dev/shm reads as such)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _backend_state(backend: Mapping[str, Any], gpu: Mapping[str, Any]) -> str:
    """ "available", or "unavailable: why"; a why that repeats the GPU line's (the nccl
    backend without CuPy) points there instead of saying it twice."""
    if backend["available"]:
        return "available"
    why = str(backend["why_not"])
    said = gpu.get("why_not") if not gpu.get("cupy") else None
    if said and said in why:
        why = why.replace(said, "").rstrip(" :;,.") + " (see GPU above)"
    return f"unavailable: {why}"


def render(info: Mapping[str, Any]) -> str:
    """The report as text, one `name: value` line each, grouped like torch's collect_env."""
    mpi, gpu, shm, th = info["mpi"], info["gpu"], info["shm"], info["threads"]
    lines = [
        f"distcomm version: {info['distcomm']['version']} ({info['distcomm']['path']})",
        f"Python version: {info['python']['version']} ({info['python']['executable']})",
        f"OS: {info['python']['platform']}",
        f"numpy version: {info['numpy']}",
        "",
        f"mpi4py version: {mpi.get('mpi4py') or 'N/A'}",
    ]
    if "library" in mpi:
        lines += [f"MPI library: {mpi['library']}", f"MPI standard: {mpi['mpi_standard']}"]
    if mpi.get("why_not"):
        lines.append(f"MPI: {mpi['why_not']}")
    lines += ["", f"CuPy version: {gpu.get('cupy') or 'N/A'}"]
    if gpu.get("cupy"):
        lines += [
            f"CUDA runtime / driver: {gpu.get('cuda_runtime')} / {gpu.get('cuda_driver')}",
            f"NCCL version: {_nccl_line(gpu)}",
            f"GPUs: {', '.join(gpu.get('devices') or []) or 'none'}",
        ]
    if gpu.get("why_not"):
        lines.append(f"GPU: {gpu['why_not']}")
    lines += ["", "Backends:"]
    for name, b in info["backends"].items():
        lines.append(f"  {name} ({', '.join(b['devices'])}): {_backend_state(b, gpu)}")
    affinity = th["affinity"]
    lines += [
        "",
        f"Threads: num_threads {th['num_threads']}, num_interop_threads "
        f"{th['num_interop_threads']}",
        f"CPUs: {th['physical_cores']} physical cores, {th['logical_cpus']} logical; "
        f"affinity: {'unknown' if affinity is None else f'{len(affinity)} CPUs {affinity}'}",
    ]
    lines += [f"  {k}={v}" for k, v in th["variables"].items()]
    if "why_not" in shm:
        lines.append(f"{shm['path']}: {shm['why_not']}")
    else:
        lines.append(
            f"{shm['path']}: {_size(shm['total_bytes'])} total, {_size(shm['free_bytes'])} free"
        )
    launcher = info["launcher"]
    lines += ["", f"Launcher: {'; '.join(launcher['started_by'])}"]
    lines += [f"  {k}={v}" for k, v in launcher["variables"].items()]
    variables = info["distcomm_variables"]
    lines += ["", "DISTCOMM_* variables set:" + ("" if variables else " none")]
    lines += [f"  {k}={v}" for k, v in variables.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distcomm.info",
        description="Print what distcomm finds on this machine (versions, MPI, GPUs, "
        "backends, threads, /dev/shm, launcher, DISTCOMM_* variables), for bug reports.",
    )
    parser.add_argument("--json", action="store_true", help="print it as JSON")
    args = parser.parse_args(argv)
    info = collect()
    sys.stdout.write(json.dumps(info, indent=2) + "\n" if args.json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
