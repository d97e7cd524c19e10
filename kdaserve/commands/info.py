"""`kdaserve info`: the platform, library versions, the GPU, which KDA backends can run here, and
what the MLA / MoE layers and fp32 dots use on this machine."""

from __future__ import annotations

import platform
import sys


def register(sub) -> None:
    p = sub.add_parser("info", help="platform, versions, GPU, and the KDA backends that can run here")
    p.set_defaults(func=run)


def gpu_description() -> str:
    import torch

    if not torch.cuda.is_available():
        return "none"
    props = torch.cuda.get_device_properties(0)
    kind = "ROCm" if torch.version.hip else "CUDA"
    arch = getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"
    version = torch.version.hip or torch.version.cuda
    return f"{props.name} ({kind} {version}, {arch}, {props.total_memory / 2**30:.0f} GiB) x{torch.cuda.device_count()}"


def run(args) -> int:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    from kdaserve import __version__
    from kdaserve.backends import describe_backends

    rows = [
        ("kdaserve", __version__),
        ("platform", f"{platform.system()} {platform.machine()}"),
        ("python", sys.version.split()[0]),
        ("torch", torch.__version__),
        ("triton", triton_version),
        ("gpu", gpu_description()),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("\nKDA backends (default layer settings for this machine):")
    print(f"  {'phase':<8} {'backend':<10} {'runs here':<10} why not")
    for b in describe_backends():
        why = "; ".join(b["unmet"]) if b["unmet"] else ""
        print(f"  {b['phase']:<8} {b['name']:<10} {'yes' if b['runnable'] else 'no':<10} {why}")
    from kdaserve.layers.kernel_choice import resolve_kernel_choice
    from kdaserve.ops.precision import device_target, dot_precision

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    p = dot_precision(device)
    print(f"\nMLA, MoE (routing included) and RMSNorm kernels (auto): {resolve_kernel_choice('MLA', 'auto', device)}; "
          f"fp32 dot precision on {device_target(device)}: {p.tensor_core} (tensor-core role), {p.exact} (exact role)")
    return 0
