"""How accurate each fp32 dot precision of kdaserve/ops/precision.py is, emulated on the CPU
against fp64: python -m tools.dot_precision_accuracy

The tensor cores' algorithms, in torch: tf32 rounds each operand to a 10-bit mantissa; tf32x3
splits each into a tf32 head and tail and sums 3 products (head*head, head*tail, tail*head);
bf16x3 and bf16x6 split into 2 or 3 bf16 pieces and sum the 3 or 6 largest cross products; all
accumulate in fp32. Relative RMS error of A [64, 128] x B [128, 64] (standard normal entries and a
badly scaled case), the median over 20 draws."""

from __future__ import annotations

import statistics

import torch


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even at 10 mantissa bits."""
    bits = x.view(torch.int32)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return rounded.view(torch.float32)


def _pieces(x: torch.Tensor, rounder, n: int) -> list[torch.Tensor]:
    out, rest = [], x
    for _ in range(n):
        head = rounder(rest)
        out.append(head)
        rest = rest - head
    return out


def emulate(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    bf16 = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    if precision == "ieee":
        return a @ b
    if precision == "tf32":
        return _tf32(a.clone()) @ _tf32(b.clone())
    if precision == "tf32x3":
        (a0, a1), (b0, b1) = _pieces(a.clone(), lambda t: _tf32(t.clone()), 2), _pieces(b.clone(), lambda t: _tf32(t.clone()), 2)
        return a1 @ b0 + a0 @ b1 + a0 @ b0
    n, terms = {"bf16x3": (2, [(1, 0), (0, 1), (0, 0)]), "bf16x6": (3, [(2, 0), (1, 1), (0, 2), (1, 0), (0, 1),
                                                                        (0, 0)])}[precision]
    pa, pb = _pieces(a, bf16, n), _pieces(b, bf16, n)
    out = torch.zeros(a.shape[0], b.shape[1])
    for i, j in terms:
        out = out + pa[i] @ pb[j]
    return out


def main() -> None:
    g = torch.Generator().manual_seed(0)
    print("| precision | rel. RMS vs fp64, N(0,1) entries | rel. RMS, entries spanning 2^-8..2^8 |")
    print("|---|---|---|")
    for prec in ("ieee", "tf32x3", "bf16x6", "bf16x3", "tf32"):
        errs = {"plain": [], "scaled": []}
        for _ in range(20):
            a, b = torch.randn(64, 128, generator=g), torch.randn(128, 64, generator=g)
            for kind in errs:
                if kind == "scaled":
                    a = a * torch.exp2(torch.randint(-8, 9, a.shape, generator=g).float())
                ref = a.double() @ b.double()
                errs[kind].append(((emulate(a, b, prec).double() - ref).norm() / ref.norm()).item())
        print(f"| {prec} | {statistics.median(errs['plain']):.1e} | {statistics.median(errs['scaled']):.1e} |")


if __name__ == "__main__":
    main()
