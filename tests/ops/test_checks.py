"""Shared entry-point checks (kdaserve/ops/kda/checks.py): metadata only, no device sync.

The host copy `cu_seqlens_cpu` sizes every prefill grid and token range (conv token blocks,
flash plan): a copy that disagrees with the step's T would make kernels read and write past
the step's rows (the interpreter crashed with heap corruption), so it is checked on the host."""

from dataclasses import replace

import pytest
import torch

from kdaserve.ops.kda.checks import check_prefill
from kdaserve.ops.kda.conv import causal_conv_varlen_fwd
from kdaserve.ops.kda.flash import kda_prefill_flash
from kdaserve.testing import make_kda_case

DEV = "cuda" if torch.cuda.is_available() else "cpu"
I32 = dict(dtype=torch.int32)
BAD_HOST_COPIES = {
    "past_T": ([0, 5, 20], r"cu_seqlens_cpu must run from 0 to T = 8"),
    "short_of_T": ([0, 5, 6], r"cu_seqlens_cpu must run from 0 to T = 8"),
    "not_from_0": ([1, 5, 8], r"cu_seqlens_cpu must run from 0 to T = 8"),
    "decreasing": ([0, 9, 8], r"cu_seqlens_cpu must run from 0 to T = 8"),
    "wrong_count": ([0, 8], r"cu_seqlens_cpu must be \[N\+1\] = \[3\]"),
}


@pytest.mark.parametrize("host, msg", BAD_HOST_COPIES.values(), ids=BAD_HOST_COPIES.keys())
def test_check_prefill_refuses_a_host_copy_that_disagrees_with_the_step(host, msg):
    idx, his, cu = torch.tensor([1, 2], **I32), torch.ones(2, dtype=torch.bool), torch.tensor([0, 5, 8], **I32)
    with pytest.raises(ValueError, match=msg):
        check_prefill(8, cu, idx, his, cu_seqlens_cpu=torch.tensor(host, **I32))
    assert check_prefill(8, cu, idx, his, cu_seqlens_cpu=torch.tensor([0, 5, 8], **I32)) == 2
    assert check_prefill(8, cu, idx, his, cu_seqlens_cpu=torch.tensor([0, 8, 8], **I32)) == 2  # empty sequence


def test_check_prefill_wants_the_host_copy_on_the_host():
    if not torch.cuda.is_available():
        pytest.skip("needs a device tensor")
    cu = torch.tensor([0, 5, 8], **I32)
    with pytest.raises(ValueError, match="host"):
        check_prefill(8, cu.cuda(), torch.tensor([1, 2], **I32).cuda(), torch.ones(2, dtype=torch.bool).cuda(),
                      cu_seqlens_cpu=cu.cuda())


def _conv_varlen(inputs, weights, cache, seqs, out):
    causal_conv_varlen_fwd(inputs.qkv, weights.conv_weight, cache.conv_state, seqs.cu_seqlens, seqs.state_indices,
                           seqs.has_initial_state, cache.conv_layout, cu_seqlens_cpu=seqs.cu_seqlens_cpu)


@pytest.mark.parametrize("fn", [kda_prefill_flash, _conv_varlen], ids=["flash", "conv_varlen"])
def test_prefill_entry_points_refuse_a_host_copy_past_T_before_any_write(fn):
    case = make_kda_case([5, 3], H=2, D=16, seed=1, device=DEV)
    conv0, rec0 = case.conv_state.clone(), case.recurrent_state.clone()
    args = case.prefill_args()
    args["seqs"] = replace(args["seqs"], cu_seqlens_cpu=torch.tensor([0, 5, 20], **I32))
    with pytest.raises(ValueError, match="cu_seqlens_cpu must run from 0 to T = 8"):
        fn(out=case.new_out(), **args)
    assert torch.equal(case.conv_state, conv0) and torch.equal(case.recurrent_state, rec0)


def test_check_prefill_says_which_index_dtype_it_got():
    cu, his = torch.tensor([0, 5, 8], **I32), torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"must be int32 \(or int64\), got torch.int32 and torch.float32"):
        check_prefill(8, cu, torch.tensor([1.0, 2.0]), his)
