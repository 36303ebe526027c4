"""On-paper scaling plan: Llama-3-70B + an EAGLE-3 head on a TPU v5e-256 pod (roofline, no measurement).

Prints a markdown report: memory per chip at a given tp, and a roofline
estimate of decode step time and tokens/s for plain and speculative decoding.
Every input is a constant below (public model configs and the v5e datasheet),
so the arithmetic can be checked; the acceptance lengths are assumptions, not
measurements. Run: ``python benchmarks/scaling_plan.py [--tp 8] [--weight-bytes 2]``.
"""

from __future__ import annotations

import argparse
import dataclasses

GIB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """Cloud TPU v5e datasheet (docs.cloud.google.com/tpu/docs/v5e)."""

    name: str = "TPU v5e"
    hbm_bytes: float = 16 * GIB
    hbm_bytes_per_s: float = 819e9
    bf16_flops: float = 197e12
    chips_per_host: int = 8
    pod_chips: int = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decoder:
    """A Llama-family decoder from its config.json numbers."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False

    @property
    def layer_params(self) -> int:
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        return attn + 3 * self.hidden * self.ffn + 2 * self.hidden

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params + embed + self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of one token, all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim * 2


LLAMA3_70B = Decoder(name="Llama-3-70B", layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672,
                     vocab=128256)


def eagle3_params(target: Decoder, draft_vocab: int = 32000) -> int:
    """EAGLE-3 head: fc fusing 3 target layers (3D -> D), one decoder layer with 2D-wide q/k/v input, own LM head."""
    d = target.hidden
    fc = 3 * d * d
    qkv = 2 * d * (target.heads + 2 * target.kv_heads) * target.head_dim  # input is [embedding, fused hidden]
    o = target.heads * target.head_dim * d
    mlp = 3 * d * target.ffn
    return fc + qkv + o + mlp + draft_vocab * d + 3 * d


def report(tp: int, weight_bytes: float, batch: int, context: int, ks: list[int], taus: list[float]) -> str:
    chip, m = Chip(), LLAMA3_70B
    head = eagle3_params(m)
    weights_chip = (m.params + head) * weight_bytes / tp
    # KV heads split over tp; past the KV head count they are replicated (specjax.parallel.sharding's fallback).
    kv_chip_per_token = m.kv_bytes_per_token / min(tp, m.kv_heads)
    free = chip.hbm_bytes * 0.9 - weights_chip  # ~10% for activations, executables, fragmentation
    max_tokens = max(free, 0) / kv_chip_per_token
    replicas = chip.pod_chips // tp
    lines = [
        f"### {m.name} + EAGLE-3 on a v5e-{chip.pod_chips} pod, tp={tp}, weights at {weight_bytes:g} bytes/param",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| target params | {m.params / 1e9:.1f} B |",
        f"| EAGLE-3 head params (1 layer + fc + 32k LM head) | {head / 1e9:.2f} B |",
        f"| weights per chip (target + head) / tp | {weights_chip / GIB:.2f} GiB of {chip.hbm_bytes / GIB:.0f} GiB |",
        f"| KV cache per token per chip (bf16) | {kv_chip_per_token / 1024:.0f} KiB |",
        f"| KV tokens that fit per chip (90% HBM budget) | {max_tokens:,.0f} |",
        f"| model replicas in the pod (dp) | {replicas}, each on {max(tp // chip.chips_per_host, 1)} host(s) "
        f"of {chip.chips_per_host} chips |",
    ]
    if free <= 0:
        lines += ["", f"**Does not fit**: weights alone need {weights_chip / GIB:.1f} GiB per chip."]
        return "\n".join(lines)
    lines += [
        "",
        f"Roofline per replica, batch {batch} rows at context {context}: a decode step reads all weights once "
        "plus each row's KV, and does 2 FLOPs per parameter per query token. Step time = max(bytes / HBM "
        "bandwidth, FLOPs / peak); collectives, the draft's own steps and host overhead are ignored, so these are "
        "upper bounds.",
        "",
        "| mode | query tokens/step | step time (ms) | bound | tokens/step (assumed tau) | pod tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for k, tau in [(0, 1.0)] + list(zip(ks, taus)):
        q = batch * (k + 1)
        bytes_step = weights_chip + batch * context * kv_chip_per_token
        flops_step = 2 * (m.params / tp) * q
        t_mem, t_flop = bytes_step / chip.hbm_bytes_per_s, flops_step / chip.bf16_flops
        step = max(t_mem, t_flop)
        tokens = batch * tau
        mode = "plain" if k == 0 else f"EAGLE-3 K={k}"
        lines.append(
            f"| {mode} | {q} | {step * 1e3:.2f} | {'HBM' if t_mem >= t_flop else 'MXU'} | {tokens:.0f} (tau={tau}) "
            f"| {tokens / step * replicas:,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--weight-bytes", type=float, default=2.0, help="2 = bf16, 1 = int8 weights")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--taus", type=float, nargs="+", default=[2.5, 3.5],
                    help="assumed mean acceptance lengths for --ks (not measured)")
    args = ap.parse_args()
    print(report(args.tp, args.weight_bytes, args.batch, args.context, args.ks, args.taus))


if __name__ == "__main__":
    main()
