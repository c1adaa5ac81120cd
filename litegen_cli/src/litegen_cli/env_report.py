"""`litegen env` and `litegen --version`: versions and hardware, as text for a bug report.

    $ litegen env
    ## LiteGen environment
    - litegen-core: 0.1.0
    ...

torch is imported only when the report is built; optional packages are looked up, not
imported (diffusers and peft alone take seconds to import).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import shutil
import subprocess

LITEGEN_PACKAGES = ("litegen-core", "litegen-cli")
# import name -> distribution name, for the optional packages LiteGen can use.
OPTIONAL_PACKAGES = {
    "diffusers": "diffusers",
    "peft": "peft",
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "torchdata": "torchdata",
    "triton": "triton",
    "flash_attn": "flash-attn",
    "apex": "apex",
    "omegaconf": "omegaconf",
}


def distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None.

    Example:
        >>> distribution_version("litegen-cli")
        '0.1.0'
    """
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_lines() -> list[str]:
    """``litegen --version``: one ``name version`` line per LiteGen package.

    Example:
        >>> version_lines()
        ['litegen-core 0.1.0', 'litegen-cli 0.1.0']
    """
    return [f"{name} {distribution_version(name) or 'not installed'}" for name in LITEGEN_PACKAGES]


def optional_package(module: str, distribution: str) -> str:
    """``"<version>"``, ``"found (version unknown)"`` or ``"not installed"``, without importing."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return "not installed"
    return distribution_version(distribution) or "found (version unknown)"


def torch_lines() -> list[tuple[str, str]]:
    """torch, how it was built (CUDA, cuDNN, NCCL), and the GPUs and driver it sees."""
    try:
        import torch
    except ImportError:
        return [("torch", "not installed")]
    built = torch.version.cuda or "CPU only"
    rows = [("torch", f"{torch.__version__} (CUDA build: {built})")]
    if torch.backends.cudnn.is_available():
        major, rest = divmod(torch.backends.cudnn.version(), 10_000)  # 90100 is 9.1.0
        rows.append(("cuDNN", f"{major}.{rest // 100}.{rest % 100}"))
    rows.append(("NCCL", _nccl_version(torch)))
    available = torch.cuda.is_available()
    rows.append(("CUDA available", "yes" if available else "no"))
    if available:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            memory = props.total_memory / 2**30
            sm = f"sm_{props.major}{props.minor}"
            rows.append((f"GPU {index}", f"{props.name}, {memory:.1f} GiB, {sm}"))
        rows.append(("NVIDIA driver", _driver_version()))
    return rows


def _nccl_version(torch) -> str:
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return "not available"
    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version())
    except (RuntimeError, AttributeError, TypeError):
        return "unknown"


def _driver_version() -> str:
    """The NVIDIA driver, from nvidia-smi (torch reports only the CUDA driver API level)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown (no nvidia-smi)"
    try:
        done = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (nvidia-smi failed)"
    return done.stdout.splitlines()[0].strip() if done.stdout.strip() else "unknown"


def environment_report() -> str:
    """The whole report as Markdown: LiteGen, platform, torch and GPUs, optional packages.

    Example::

        print(environment_report())
    """
    rows = [(name, distribution_version(name) or "not installed") for name in LITEGEN_PACKAGES]
    rows += [
        ("Python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("OS", platform.platform()),
        *torch_lines(),
    ]
    lines = ["## LiteGen environment", "", *(f"- {label}: {value}" for label, value in rows)]
    lines += ["", "### Optional packages", ""]
    lines += [
        f"- {module}: {optional_package(module, dist)}"
        for module, dist in OPTIONAL_PACKAGES.items()
    ]
    return "\n".join(lines)
