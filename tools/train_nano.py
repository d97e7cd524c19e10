"""Train `nano`: a Kimi-Linear-family model (KDA + MLA + MoE layers, byte tokenizer, ~7M
parameters) on the Python standard library's sources, with transformers' `kimi_linear` (torch
autograd; flash-linear-attention's KDA kernels when installed, else transformers' torch fallback).

    python -m tools.train_nano --out nano_run --minutes 4          # on a GPU (bf16 autocast)
    python -m tools.train_nano --out nano_run --minutes 1 --device cpu --batch 4 --seq 128   # a smoke run

Data: every `.py` file under the running interpreter's stdlib directory (`sysconfig`'s "stdlib";
Python Software Foundation License), files in sorted order, each followed by the end-of-text
token; a file is held out when the SHA-256 of its relative path is 0 mod 20 (about 5%). The run
writes to --out: the checkpoint (`config.json`, `model.safetensors` under the released tensor
names in bf16, `tokenizer.json`), `train_log.json` (data sizes, settings, the loss every
`--log-every` steps, held-out loss and perplexity at the end) and, when matplotlib is there,
`loss.png`. The checkpoint loads like any Kimi-Linear checkpoint (`kdaserve generate --model DIR`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

from kdaserve.evidence.accuracy import held_out
from kdaserve.models.kimi_linear import random_released_tensors
from kdaserve.models.kimi_linear_config import KimiLinearConfig
from kdaserve.models.tokenizer import ByteTokenizer

EOT = ByteTokenizer().eos_token_id


def nano_config() -> KimiLinearConfig:
    """3 KDA : 1 MLA as released (MLA at layers 3 and 6 here), a dense first layer, then MoE."""
    return KimiLinearConfig(
        hidden_size=256, num_hidden_layers=6, vocab_size=ByteTokenizer().vocab_size,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        linear_num_heads=4, linear_head_dim=64, num_attention_heads=4, kv_lora_rank=128, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, intermediate_size=512, moe_intermediate_size=128,
        num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.446,
        first_k_dense_replace=1, max_position_embeddings=8192, bos_token_id=None, eos_token_id=EOT,
        pad_token_id=None, torch_dtype="bfloat16", model_type="kimi_linear",
    )


def corpus(root: Path) -> tuple[list[int], list[int], dict]:
    train, held = [], []
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    n_train = n_held = 0
    for p in files:
        data = list(p.read_bytes()) + [EOT]
        if held_out(p, root):   # the split `kdaserve accuracy --stdlib-held-out` uses
            held += data
            n_held += 1
        else:
            train += data
            n_train += 1
    info = {"root": str(root), "license": "Python Software Foundation License", "train_files": n_train,
            "held_out_files": n_held, "train_tokens": len(train), "held_out_tokens": len(held)}
    return train, held, info


def batches(tokens: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=gen)
        yield torch.stack([tokens[s : s + seq] for s in starts.tolist()])


@torch.no_grad()
def held_out_loss(model, tokens: torch.Tensor, seq: int, device, max_windows: int, autocast) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, min(len(tokens) - seq - 1, max_windows * seq), seq):
        x = tokens[i : i + seq][None].to(device)
        with autocast():
            loss = model(input_ids=x, labels=x).loss
        total += loss.item()
        count += 1
    model.train()
    return total / max(count, 1)


def save_checkpoint(model, config: KimiLinearConfig, names: list[str], out: Path) -> None:
    """Released tensor names: transformers' save_pretrained undoes its load-time renames, except
    for the dense first layer's MLP, which it names after the MoE layers' module."""
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    state = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for f in Path(tmp).glob("*.safetensors"):
            with safe_open(str(f), "pt") as sf:
                for k in sf.keys():
                    state[k] = sf.get_tensor(k).to(torch.bfloat16).contiguous()
    for k in list(state):
        for a, b in ((".mlp.", ".block_sparse_moe."), (".block_sparse_moe.", ".mlp.")):
            if k not in names and k.replace(a, b) in names:
                state[k.replace(a, b)] = state.pop(k)
                break
    missing = sorted(set(names) - set(state))
    if missing:
        raise RuntimeError(f"trained model lacks released tensors {missing[:5]}")
    out.mkdir(parents=True, exist_ok=True)
    config.save(out / "config.json")
    save_file({k: state[k] for k in names}, str(out / "model.safetensors"))
    (out / "tokenizer.json").write_text(ByteTokenizer().to_tokenizers_json())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--plot", action="store_true", help="only draw --out's loss.png from its train_log.json")
    p.add_argument("--minutes", type=float, default=4.0, help="training time (then the held-out evaluation)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--held-out-windows", type=int, default=256)
    args = p.parse_args()
    if args.plot:
        plot(args.out)
        return 0
    import transformers

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    train, held, info = corpus(Path(sysconfig.get_paths()["stdlib"]))
    print(json.dumps(info), flush=True)
    train_t, held_t = torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long)

    config = nano_config()
    import tempfile

    init_dir = Path(tempfile.mkdtemp(prefix="nano_init_"))   # random released tensors, fp32: not a result
    config.save(init_dir / "config.json")
    from safetensors.torch import save_file

    init = {k: v.to(torch.float32).contiguous() for k, v in random_released_tensors(config, args.seed, dtype=torch.float32)}
    save_file(init, str(init_dir / "model.safetensors"))
    names = sorted(init)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(init_dir), dtype=torch.float32).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters {n_params / 1e6:.2f} M on {device}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else torch.no_grad
    if device.type != "cuda":
        autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_t, args.batch, args.seq, gen)
    log, step, t0, budget = [], 0, time.time(), args.minutes * 60
    while time.time() - t0 < budget:
        x = next(data).to(device, non_blocking=True)
        frac = (time.time() - t0) / budget
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        with autocast():
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % args.log_every == 0 or step == 1:
            elapsed = time.time() - t0
            log.append({"step": step, "tokens": step * args.batch * args.seq, "seconds": round(elapsed, 1),
                        "lr": lr, "loss": loss.item()})
            print(f"step {step} loss {loss.item():.4f} lr {lr:.2e} {step * args.batch * args.seq / elapsed:.0f} tok/s",
                  flush=True)
    held_loss = held_out_loss(model, held_t, args.seq, device, args.held_out_windows, autocast)
    result = {"data": info, "config": config.to_dict(), "parameters": n_params, "steps": step,
              "tokens_seen": step * args.batch * args.seq, "seconds": round(time.time() - t0, 1),
              "settings": {k: str(v) for k, v in vars(args).items()}, "device": torch.cuda.get_device_name() if
              device.type == "cuda" else "cpu", "transformers": transformers.__version__,
              "held_out_loss": held_loss, "held_out_ppl_per_byte": math.exp(held_loss),
              "held_out_bits_per_byte": held_loss / math.log(2), "log": log}
    save_checkpoint(model, config, names, args.out / "checkpoint")
    (args.out / "train_log.json").write_text(json.dumps(result, indent=1))
    print(f"held-out loss {held_loss:.4f} ({held_loss / math.log(2):.3f} bits/byte), {step} steps", flush=True)
    try:
        plot(args.out)
    except ImportError:
        print("matplotlib not installed: no loss.png (`python -m tools.train_nano --plot OUT` draws it later)",
              file=sys.stderr)
    return 0


def plot(out: Path) -> None:
    """loss.png from a run's train_log.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads((out / "train_log.json").read_text())
    log, held = result["log"], result["held_out_loss"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([e["tokens"] / 1e6 for e in log], [e["loss"] for e in log], label="training batch")
    ax.axhline(held, ls="--", c="gray", label=f"held-out {held:.3f}")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("loss (nats/byte)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)


if __name__ == "__main__":
    sys.exit(main())
