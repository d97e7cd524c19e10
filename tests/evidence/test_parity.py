"""`kdaserve parity`: the table, the exit codes, and that it catches a backend that is off, that
touches slots outside the batch, or that corrupts conv states."""

import pytest
import torch

from kdaserve.backends import BackendSpec, register_backend, unregister_backend
from kdaserve.cli import main
from kdaserve.evidence.parity import ParityConfig, parse_lengths, run_parity
from kdaserve.ops.kda.reference import kda_decode_reference, kda_prefill_reference
from kdaserve.ops.kda.types import conv_state_rows

SMALL = dict(heads=1, head_dim=8, hidden=16, lengths=[9, 3], decode_steps=2, mixed_chunk=5)


def off_by(rel):
    def decode(inputs, weights, cache, seqs, out):
        kda_decode_reference(inputs, weights, cache, seqs, out)
        out.mul_(1 + rel)

    return decode


def touches_last_slot(inputs, weights, cache, seqs, out):
    kda_decode_reference(inputs, weights, cache, seqs, out)
    cache.recurrent_state[-1].add_(1.0)  # the last slot is never in a batch


def corrupts_conv(inputs, weights, cache, seqs, out, **kw):
    kda_prefill_reference(inputs, weights, cache, seqs, out, **kw)
    rows = conv_state_rows(cache.conv_state, cache.conv_layout)
    rows[seqs.state_indices.long()] += 1e-3


@pytest.fixture
def toys():
    specs = [BackendSpec("off_1e-3", "decode", "test", lambda: off_by(1e-3), lambda: ()),
             BackendSpec("off_1e-7", "decode", "test", lambda: off_by(1e-7), lambda: ()),
             BackendSpec("toucher", "decode", "test", lambda: touches_last_slot, lambda: ()),
             BackendSpec("conv_bug", "prefill", "test", lambda: corrupts_conv, lambda: ())]
    for s in specs:
        register_backend(s)
    yield
    for s in specs:
        unregister_backend(s.phase, s.name)


def test_parse_lengths():
    assert parse_lengths("8192,1024x3") == [8192, 1024, 1024, 1024]
    assert parse_lengths("5") == [5]
    with pytest.raises(ValueError, match="positive token counts"):
        parse_lengths("0x2")


def test_reference_passes_and_the_table_comes_last(capsys):
    cfg = ParityConfig(["reference"], ["reference"], spec_tokens=1, **SMALL)
    assert run_parity(cfg) == 0
    out = capsys.readouterr().out
    table = out[out.index("phase "):]
    rows = [line for line in table.splitlines() if line.split(" ")[0] in ("prefill", "decode", "mixed", "speculative")]
    assert [r.split()[0] for r in rows] == ["prefill", "decode", "mixed", "speculative"]
    assert all(r.rstrip().endswith("ok") for r in rows)
    assert out.rstrip().endswith("4/4 comparisons within limits")


def test_a_backend_off_by_1e_3_fails_and_1e_7_passes(toys, capsys):
    cfg = ParityConfig(["reference"], ["off_1e-7", "off_1e-3"], **SMALL)
    assert run_parity(cfg) == 1
    out = capsys.readouterr().out
    def row(name, vs):
        return next(l for l in out.splitlines() if l.startswith("decode") and l.split()[2] == name and l.split()[3] == vs)
    assert row("off_1e-7", "reference(fp64)").endswith("ok")
    assert row("off_1e-3", "reference(fp64)").endswith("FAIL")
    assert row("off_1e-7", "off_1e-3").endswith("FAIL")  # pairs are judged too


def test_touching_a_slot_outside_the_batch_fails(toys, capsys):
    assert run_parity(ParityConfig(["reference"], ["toucher"], **SMALL)) == 1
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("decode") and "toucher" in l)
    assert "TOUCHED" in line and line.endswith("FAIL")


def test_a_wrong_conv_state_fails(toys, capsys):
    assert run_parity(ParityConfig(["conv_bug"], ["reference"], **SMALL)) == 1
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("prefill") and "conv_bug" in l)
    assert "DIFF" in line and line.endswith("FAIL")


def test_cli_on_the_cpu_finishes_and_passes(capsys):
    assert main(["parity", "--device", "cpu", "--prefill-backends", "reference", "--decode-backends", "reference",
                 "--lengths", "12,5x2", "--decode-steps", "2"]) == 0
    assert "comparisons within limits" in capsys.readouterr().out


def test_cli_defaults_take_every_backend_that_runs_here(monkeypatch):
    from kdaserve.cli import build_parser
    from kdaserve.commands.parity import build_config

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = build_config(build_parser().parse_args(["parity", "--device", "cpu"]))
    assert (cfg.prefill_backends, cfg.decode_backends) == (["reference"], ["reference"])
    assert (cfg.heads, cfg.head_dim, cfg.dtype, cfg.lengths, cfg.decode_steps) == (2, 32, torch.float32, [40, 7, 7, 7], 4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = build_config(build_parser().parse_args(["parity", "--device", "cpu"]))
    assert "chain" in cfg.decode_backends or "fused" in cfg.decode_backends


def test_cli_reports_an_unusable_backend_with_exit_2(capsys):
    assert main(["parity", "--device", "cpu", "--decode-backends", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown KDA decode backend 'nope'" in err and "fused" in err
    assert main(["parity", "--device", "cpu", "--prefill-backends", "flashkda"]) == 2
    assert "unmet requirement" in capsys.readouterr().err


# Our backends must hold docs/kda-semantics.md's tolerances. FLA 0.6.0 (an external baseline whose
# precision we do not own) keeps bf16 intermediates and measured 5.15e-3 output / 5.25e-3 state
# error on this case on the H200 (limit 5e-3); its adapter's plumbing is checked against the
# reference in tests/backends/test_adapters_gpu.py, and `kdaserve parity` reports it as it is.
GPU_PREFILL = "reference,chunk,flash"
GPU_DECODE = "reference,chain,fused"


def _gpu_names(csv, phase, **settings):
    """The backends of `csv` that resolve here (the others are listed, and are their own tests' business)."""
    from kdaserve.backends import BackendError, LayerSettings, Machine, resolve_backend

    names = []
    for n in csv.split(","):
        try:
            resolve_backend(phase, n, LayerSettings(**settings), Machine.detect("cuda"))
            names.append(n)
        except BackendError as err:
            print(f"parity test leaves out {phase} backend {n}: {err}")
    return ",".join(names)


@pytest.mark.gpu
@pytest.mark.parametrize("state", ["fp32", "bf16"])
def test_gpu_parity_of_every_gpu_backend(state, capsys):
    """bf16 inputs, H=8 x 128, mixed lengths, 32 decode steps, speculative verify: every runnable
    GPU backend within docs/kda-semantics.md's tolerances of the fp64 reference and of each other."""
    sd = torch.float32 if state == "fp32" else torch.bfloat16
    args = ["parity", "--device", "cuda", "--prefill-backends", _gpu_names(GPU_PREFILL, "prefill", state_dtype=sd,
                                                                           num_spec_tokens=2),
            "--decode-backends", _gpu_names(GPU_DECODE, "decode", state_dtype=sd, num_spec_tokens=2), "--heads", "8",
            "--lengths", "3000,700,64x4,1",
            "--decode-steps", "32", "--spec-tokens", "2", "--state-dtype", state, "--slow-decay-heads", "2"]
    rc = main(args)
    print(capsys.readouterr().out)
    assert rc == 0


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_parity_at_128k_tokens(capsys):
    args = ["parity", "--device", "cuda", "--prefill-backends", _gpu_names(GPU_PREFILL, "prefill"),
            "--decode-backends", _gpu_names(GPU_DECODE, "decode"), "--heads", "16", "--lengths", "131072",
            "--decode-steps", "16", "--slow-decay-heads", "4"]
    rc = main(args)
    print(capsys.readouterr().out)
    assert rc == 0
