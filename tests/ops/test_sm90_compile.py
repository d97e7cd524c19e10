"""tools.sm90_compile: compiling for sm_90 without a GPU, and reading the result back
(ptxas resources, the SASS instruction mix that docs/perf-notes.md quotes for flash's K1)."""

from compiled_mode import run_compiled

_MIX = r'''
import re
import triton
import triton.language as tl
from tools.sm90_compile import compile_for_sm90, ptxas_report, sass_loops, sass_mix

@triton.jit
def dot_then_cumsum(a_ptr, b_ptr, o_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    a = tl.load(a_ptr + r[:, None] * N + r[None, :])
    b = tl.load(b_ptr + r[:, None] * N + r[None, :])
    c = tl.dot(a, b)                       # tensor cores
    c = tl.cumsum(c, axis=0)               # a scan across warps: shared memory and barriers
    tl.store(o_ptr + r[:, None] * N + r[None, :], tl.exp(c))

@triton.jit
def copy(a_ptr, o_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(o_ptr + r, tl.load(a_ptr + r))

@triton.jit
def running_sum(a_ptr, o_ptr, n, N: tl.constexpr):
    r = tl.arange(0, N)
    acc = tl.zeros([N], tl.float32)
    for i in range(n):                     # a runtime trip count: a loop in the SASS
        acc = acc * 0.5 + tl.exp(tl.load(a_ptr + i * N + r))
    tl.store(o_ptr + r, acc)

mix = sass_mix(compile_for_sm90(dot_then_cumsum, dict(a_ptr="*fp16", b_ptr="*fp16", o_ptr="*fp32"), dict(N=64)))
counts = dict(kv.split("=") for kv in mix.split())
mma = int(counts.get("HMMA", 0)) + int(counts.get("HGMMA", 0))   # mma.sync or Hopper's wgmma
assert mma > 0 and int(counts.get("BAR", 0)) > 0 and int(counts.get("MUFU", 0)) > 0, mix
assert int(counts["sass"]) > sum(int(v) for k, v in counts.items() if k != "sass"), mix
copy_k = compile_for_sm90(copy, dict(a_ptr="*fp32", o_ptr="*fp32"), dict(N=128))
plain = sass_mix(copy_k)
assert "HMMA" not in plain and "BAR" not in plain and "LDG" in plain and "STG" in plain, plain
assert re.match(r"regs=\d+ spill_st=0 smem=\d+", ptxas_report(copy_k))
assert sass_loops(copy_k) == [], sass_loops(copy_k)
loop_k = compile_for_sm90(running_sum, dict(a_ptr="*fp32", o_ptr="*fp32", n="i32"), dict(N=128), num_stages=1)
loops, total = sass_loops(loop_k), int(sass_mix(loop_k).split()[0].split("=")[1])
assert loops and all(4 <= n < total for n in loops), (loops, total)   # the compiler may unroll it: a main loop and a rest
print("ok")
'''


def test_sass_mix_counts_what_the_kernel_does(tmp_path):
    """A dot + cross-warp scan + exp kernel shows tensor-core, barrier and MUFU instructions; a
    plain copy shows global loads and stores and none of those, and no loop; a kernel with a
    runtime loop has loops (a main one and a remainder, as the compiler unrolls), each a part of
    its instructions. (A script file: @triton.jit needs its source on disk.)"""
    script = tmp_path / "mix.py"
    script.write_text(_MIX)
    run_compiled([str(script)], timeout=300)
