#!/usr/bin/env python3
"""Compiles the kernel files of kernels/src/cuda (SOURCES in nvrtc.rs, in its order, as one
program) with NVRTC, as the kernels crate does at run time, for
each target architecture, then (where ptxas is on PATH) assembles the PTX and prints registers,
spill bytes and static shared memory per entry point. Needs libnvrtc, not a GPU.

    . ~/.cache/cuda13-pip/env.sh            # scripts/cuda-toolchain.sh: NVRTC 13 + ptxas
    python3 scripts/kernel_report.py --arch compute_75:sm_75 compute_80:sm_90 --match attn_

    # another NVRTC (e.g. 12.9 from `pip install nvidia-cuda-nvrtc-cu12`), compile only:
    python3 scripts/kernel_report.py --nvrtc .../libnvrtc.so.12 --arch default compute_60

--arch takes VIRTUAL[:REAL]: VIRTUAL is NVRTC's --gpu-architecture ("default" gives NVRTC none,
its own default), REAL the sm_ target for ptxas. --source compiles another program text instead
(e.g. an older revision's files concatenated). Exit status 1 if a compile fails.
"""
import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_DIR = os.path.join(ROOT, "kernels/src/cuda")


def program_text():
    """The kernel files in the order of SOURCES in nvrtc.rs, joined as the crate joins them."""
    nvrtc = open(os.path.join(CUDA_DIR, "nvrtc.rs")).read()
    files = re.findall(r'include_str!\("([\w.]+)"\)', nvrtc)
    if not files:
        sys.exit("no SOURCES found in kernels/src/cuda/nvrtc.rs")
    return "\n".join(open(os.path.join(CUDA_DIR, f)).read() for f in files), files


def nvrtc_lib(path):
    if path:
        return ctypes.CDLL(path)
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for d in ("lib", "lib64"):
        for name in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
            p = os.path.join(home, d, name)
            if os.path.exists(p):
                return ctypes.CDLL(p)
    sys.exit("libnvrtc not found: pass --nvrtc or set CUDA_HOME")


def compile_ptx(lib, src, arch):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"ft_kernels.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [] if arch == "default" else [f"--gpu-architecture={arch}".encode()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    ptx = None
    if rc == 0:
        lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetPTX(prog, buf)
        ptx = buf.value.decode()
    return rc, log.value.decode(errors="replace").strip(), ptx


def ptxas_table(ptx, real, match):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run(["ptxas", f"-arch={real}", "-v", f.name, "-o", os.devnull],
                         capture_output=True, text=True)
    os.unlink(f.name)
    rows, name = [], None
    spill = regs = smem = None
    for line in out.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spill = (int(m.group(1)), int(m.group(2)))
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)
        if m and name:
            regs, smem = int(m.group(1)), int(m.group(2))
            if match in name:
                rows.append((name, regs, spill, smem))
            name = None
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nvrtc", help="path of libnvrtc.so.N (default: $CUDA_HOME's)")
    ap.add_argument("--source", help="a program text to compile instead of the kernel files")
    ap.add_argument("--arch", nargs="+", default=["compute_75:sm_75", "compute_80:sm_90"])
    ap.add_argument("--match", default="", help="only entry points whose name contains this")
    a = ap.parse_args()
    lib = nvrtc_lib(a.nvrtc)
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    if a.source:
        src, what = open(a.source).read(), os.path.relpath(a.source)
    else:
        src, files = program_text()
        what = "kernels/src/cuda: " + ", ".join(files)
    print(f"NVRTC {major.value}.{minor.value}, {what}")
    failed = False
    for spec in a.arch:
        virt, _, real = spec.partition(":")
        rc, log, ptx = compile_ptx(lib, src, virt)
        print(f"\n## {virt}: {'compiled' if rc == 0 else f'FAILED (nvrtc {rc})'}")
        if log:
            print(log)
        if rc:
            failed = True
            continue
        if not real:
            continue
        if not shutil.which("ptxas"):
            print("(no ptxas on PATH: registers not reported)")
            continue
        print(f"\n| {real} entry point | registers | spill stores / loads (bytes) | static smem |")
        print("|---|---|---|---|")
        for name, regs, spill, smem in ptxas_table(ptx, real, a.match):
            print(f"| {name} | {regs} | {spill[0]} / {spill[1]} | {smem} |")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
