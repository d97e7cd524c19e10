"""Every Triton kernel compiles for AMD (gfx950: MI355X, gfx942: MI300X) and NVIDIA Blackwell
(sm_100) at a representative serving shape, on this CPU (tools/compile_check.py --quick): a kernel
that stops compiling on one of them, spills there where the sm_90 build does not, or outgrows its
shared memory / LDS fails CI."""

import re

from compiled_mode import run_compiled


def test_every_kernel_compiles_for_gfx950_gfx942_and_sm100():
    out = run_compiled(["-m", "tools.compile_check", "--arch", "gfx950,gfx942,sm_100", "--quick", "--markdown"],
                       timeout=1200)
    for target in ("gfx950", "gfx942", "sm_100"):
        assert f"{target} flash prepare" in out and f"{target} moe down" in out and f"{target} mla decode" in out, target
        assert f"{target} hc pre" in out and f"{target} dsa index scores" in out and f"{target} mla sparse decode" in out
    # --markdown: docs/portability.md's table, a row per kernel, the targets in TARGETS' order
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0] == "| kernel | sm_100 | gfx942 | gfx950 |", table[:2]
    plan = next(line for line in table if line.startswith("| flash plan |"))
    assert re.fullmatch(r"\| flash plan \| \d+ r, \d+ K \| \d+ v, \d+ K \| \d+ v, \d+ K \|", plan), plan
    assert any("not launched" in line for line in table if line.startswith("| fp8 "))   # gfx942's FP8 is fnuz


def test_precision_by_target():
    from kdaserve.ops.precision import IEEE, precision_for_target

    assert precision_for_target("sm_90").tensor_core == "tf32" and precision_for_target("sm_100").exact == "tf32x3"
    assert precision_for_target("gfx950").tensor_core == "bf16x3" and precision_for_target("gfx950").exact == "bf16x6"
    assert precision_for_target("gfx942").exact == "ieee"           # ROCm's Triton has no tf32x3
    assert precision_for_target("gfx90a") == IEEE and precision_for_target("cpu") == IEEE


def test_sass_loop_counts_the_longest_loop_and_the_decode_work_per_value():
    """tools/sass_loop on the 4-bit decode kernels, compiled for sm_90 on this CPU: the K loop found,
    the bf16 decoding's budget held (about 5.5 instructions a weight value; the fp32 decoding it
    replaced took about 10), and the scales pipelined with the packed bytes: no global load waited
    on inside the loop and no trip through shared memory of its own (ops/fp4/tiles.fp4_scale_pair)."""
    from tools.sass_loop import longest_loop

    sass = "\n".join(["        /*0000*/  MOV R1, R2 ;", ".L_x_1:", "        /*0010*/  IMAD R1, R1, 0x2, RZ ;",
                      ".L_x_2:", "        /*0020*/  HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",
                      "        /*0030*/  @P0 BRA `(.L_x_2) ;", "        /*0040*/  @P1 BRA `(.L_x_1) ;"])
    assert longest_loop(sass) == {"IMAD": 1, "HMMA": 1, "BRA": 2}
    out = run_compiled(["-m", "tools.sass_loop", "--arch", "sm_90", "--top", "80", "--kernels",
                        "moe mxfp4 gate_up decode,moe mxfp4 down decode"], timeout=600)
    # sm_90's decode (tiles left of the dots, the words program and its WIDE one) and the right side's (bitwise,
    # as elsewhere), each kernel
    per_value = [float(m) for m in re.findall(r"decode BM=16(?: right| wide)?: loop \d+ instructions, ([\d.]+) non-MMA",
                                              out)]
    assert len(per_value) == 6 and all(v < 7 for v in per_value), out
    loops = [line for line in out.splitlines() if "decode BM=16" in line]
    assert len(loops) == 6 and not any(re.search(r" (LDG|STS)=", line) for line in loops), out
    assert all("HGMMA" in line for line in loops if "right" not in line), out   # wgmma, the weights from registers
    # and ptxas lets those wgmma overlap (compile_check fails a case whose wgmma it serialized: warning C7515)
    checked = run_compiled(["-m", "tools.compile_check", "--arch", "sm_90", "--kernels",
                            "moe mxfp4 gate_up decode BM=16,moe mxfp4 down decode BM=16"], timeout=600)
    assert "WGMMA SERIALIZED" not in checked and checked.count("decode BM=16") == 6, checked
