"""Stand-ins for the GPU listing tools launch-pd asks (``nvidia-smi``, ``amd-smi``, ``rocm-smi``).

The real tools cannot exist on a CPU-only test machine (they need a GPU driver), so tests write
these executables into a folder and put only that folder on ``PATH``. Each prints the output
form its vendor documents, with values made up here: ``nvidia-smi -L`` one ``GPU i: ...`` line
per GPU; ``amd-smi list`` (AMD SMI CLI, ROCm 6.x docs) one unindented ``GPU: i`` line per GPU
followed by indented ``BDF:``/``UUID:``/``KFD_ID:``/``NODE_ID:``/``PARTITION_ID:`` lines;
``rocm-smi --showid`` (ROCm 6.x) several ``GPU[i]<tabs>: field: value`` lines per GPU between
banner lines. A stand-in called with other arguments fails (exit 64), so a test also pins the
arguments the code passes.
"""

import sys
import textwrap

NVIDIA_SMI_L = "".join(
    f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-0000000{i}-1111-2222-3333-444444444444)\n" for i in range(2)
)


def amd_smi_list(n, with_cpu=False):
    blocks = [
        f"GPU: {i}\n    BDF: 0000:{0x10 * (i + 1):02x}:00.0\n"
        f"    UUID: 12ff74a5-0000-1000-80{i:02d}-0123456789ab\n    KFD_ID: {1000 + i}\n"
        f"    NODE_ID: {i + 2}\n    PARTITION_ID: 0\n"
        for i in range(n)
    ]
    if with_cpu:  # amd-smi lists CPU sockets too where the CPU driver is loaded
        blocks.append("CPU: 0\n    CPU_SOCKET: 0\n")
    return "\n".join(blocks)


def rocm_smi_showid(n):
    lines = ["", "", "=" * 28 + " ROCm System Management Interface " + "=" * 28,
             "=" * 43 + " ID " + "=" * 43]
    for i in range(n):
        lines += [f"GPU[{i}]\t\t: Device Name: \t\tAMD Instinct MI300X",
                  f"GPU[{i}]\t\t: Device ID: \t\t0x74a1",
                  f"GPU[{i}]\t\t: Device Rev: \t\t0x00",
                  f"GPU[{i}]\t\t: Subsystem ID: \t0x74a1",
                  f"GPU[{i}]\t\t: GUID: \t\t{20000 + i}"]
    lines += ["=" * 90, "=" * 34 + " End of ROCm SMI Log " + "=" * 35, ""]
    return "\n".join(lines)


def fake_tool(bin_dir, name, args, stdout="", returncode=0, stderr=""):
    """A stand-in for ``name``: prints ``stdout`` when called with exactly ``args``."""
    script = bin_dir / name
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        if sys.argv[1:] != {list(args)!r}:
            sys.stderr.write("unexpected arguments: %r\\n" % sys.argv[1:])
            sys.exit(64)
        sys.stdout.write({stdout!r})
        sys.stderr.write({stderr!r})
        sys.exit({returncode})
        """))
    script.chmod(0o755)
