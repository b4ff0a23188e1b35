"""Analytic latency profiles: a roofline over the model's FLOPs and bytes and the accelerator's peaks.

Per stage, from the model shape (no weights needed):
  encode   FLOPs per image = 2·P_vision·S + 4·L·S²·d (+ the projector); floor = vision weights / bandwidth
  prefill  FLOPs per token = 2·P_text (+ attention 4·L·d per token × context token, the quadratic term);
           floor = text weights / bandwidth
  decode   FLOPs per sequence = 2·P_text; floor = text weights / bandwidth; each context token's KV
           (2·L·kv_heads·head_dim·bytes) read once per iteration
  transfer latency + bytes / link bandwidth (NVLink within a node)
Achieved compute = peak · FLOP_EFFICIENCY · x / (x + half_units): small batches do not fill the GPU.
`half_units` is the one thing calibrated, per stage, on H20 to the saturation points TriInfer measured
for LLaVA-1.5-7B (encode ≈ 6 images per batch, prefill ≈ one 1024-token request, decode ≈ 512
sequences); another model's encode saturates at the same number of vision tokens (6 × 577), not images;
other GPUs scale it by their SM count (more SMs need more work to fill — an assumption, not
a measurement). Decode's point is taken for the GEMMs alone (no context): TriInfer does not give the
context of its decode sweep, 512 sequences of more than ~420 tokens each do not fit in an H20's KV
memory, and reading KV is a per-sequence cost that batching does not amortise (the context term).
Calibrated with a 1024-token context instead, a batch-1 decode would take 15.8 ms against a 5.0 ms
weights-read floor; calibrated this way it takes 7.6 ms.
TriInfer's prefill sweep starts at one 1024-token request, so its data bound the prefill's saturation from above
only: 1024 is the latest it can be, which makes small prompt chunks as dear as that data allows (on H20 a 16-token
chunk beside two decodes 32 ms, against 8 ms for the decodes alone). `prefill_saturation` puts it earlier, to ask
how a result depends on it.

Hardware numbers (dense BF16, vendor datasheets): H20 148 TFLOP/s, 4.8 TB/s HBM3e (the 141 GB part
TriInfer ran on; the 96 GB H20 has 4.0 TB/s HBM3), 78 SMs; H100 SXM 989 TFLOP/s, 3.35 TB/s, 132 SMs;
H200 SXM 989 TFLOP/s, 4.8 TB/s, 132 SMs; NVLink 4 at 900 GB/s per GPU for all three.
"""

from __future__ import annotations

import dataclasses

from common.latency.model import LatencyProfile, StageCost, decode_ms, encode_ms, prefill_chunk_ms, saturation

FLOP_EFFICIENCY = 0.7  # large-GEMM fraction of peak reached in practice
MEMORY_EFFICIENCY = 0.8  # streaming-read fraction of peak HBM bandwidth
LINK_EFFICIENCY = 0.5  # what a page pull gets of the NVLink peak
ITERATION_OVERHEAD_MS = 1.5  # launches and host work per iteration (eager mode, no CUDA graphs)
LINK_LATENCY_MS = 0.05
TRIINFER_H20 = {"encode_images": 6, "prefill_tokens": 1024, "decode_sequences": 512, "decode_context": 0}


@dataclasses.dataclass(frozen=True, slots=True)
class Accelerator:
    name: str
    bf16_tflops: float
    hbm_tbps: float
    link_gbps: float
    sms: int


ACCELERATORS = {
    "H20": Accelerator("H20", 148.0, 4.8, 900.0, 78),
    "H100": Accelerator("H100", 989.0, 3.35, 900.0, 132),
    "H200": Accelerator("H200", 989.0, 4.8, 900.0, 132),
}


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    """What the roofline needs of a LLaVA-style model (bf16 weights)."""

    name: str
    vision_params: float
    vision_layers: int
    vision_hidden: int
    vision_tokens: int  # patches + CLS through the tower
    projector_params: float
    image_tokens: int  # placeholder tokens per image in the prompt
    text_params: float
    text_layers: int
    text_hidden: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2

    @property
    def encode_flops(self) -> float:
        tower = (
            2 * self.vision_params * self.vision_tokens
            + 4 * self.vision_layers * self.vision_tokens**2 * self.vision_hidden
        )
        return tower + 2 * self.projector_params * self.image_tokens

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.text_layers * self.kv_heads * self.head_dim * self.bytes_per_param


# LLaVA-1.5-7B: CLIP ViT-L/14 at 336 px (577 tokens, 24 layers of 1024, 303M parameters), a 2-layer
# 1024→4096→4096 projector (21M), Llama-2-7B-shaped decoder (6.74B, 32 layers of 4096, 32 KV heads of 128).
LLAVA_15_7B = ModelShape("llava-1.5-7b", 303e6, 24, 1024, 577, 21e6, 576, 6.74e9, 32, 4096, 32, 128)
# Qwen2-VL-7B's shapes with every image at 1344×1344 px — an encode-heavy model: a ViT of 32 layers of 1280
# (631M) over all 96² = 9,216 patches with full attention, a patch merger (2×2 → one token, 45M) to 2,304 image
# tokens, a Qwen2-7B decoder (7.6B, 28 layers of 3584, 4 KV heads of 128). An image's encode is ~26 TFLOP against
# its tokens' prefill ~35; LLaVA-1.5-7B's is ~1.2 against ~7.8.
QWEN2_VL_7B_1344 = ModelShape("qwen2-vl-7b-1344", 631e6, 32, 1280, 9216, 45e6, 2304, 7.6e9, 28, 3584, 4, 128)
SHAPES = {shape.name: shape for shape in (LLAVA_15_7B, QWEN2_VL_7B_1344)}


def analytic_profile(
    accelerator: str | Accelerator, shape: ModelShape = LLAVA_15_7B, prefill_saturation: int | None = None
) -> LatencyProfile:
    """`prefill_saturation`: the prompt tokens at which prefill reaches 90% of its throughput on H20, instead of
    TriInfer's 1024 (a sensitivity study's variant; the profile's name says so)."""
    hw = ACCELERATORS[accelerator] if isinstance(accelerator, str) else accelerator
    targets = dict(TRIINFER_H20, **({"prefill_tokens": prefill_saturation} if prefill_saturation else {}))
    half = _calibrated_half_units(shape, targets)
    if prefill_saturation:
        reached = saturation_points(_profile(ACCELERATORS["H20"], shape, half))["prefill_tokens"]
        if abs(reached - prefill_saturation) > 0.1 * prefill_saturation:  # (the points lie on a ~6% grid)
            raise ValueError(
                f"prefill cannot saturate at {prefill_saturation} tokens on this roofline (nearest: {reached}); "
                f"its fixed costs alone put the point at {_earliest_prefill_saturation(shape)} tokens or later"
            )
    if shape != LLAVA_15_7B:  # an image is the encode's unit: more vision tokens an image fill the GPU with fewer
        llava = _calibrated_half_units(LLAVA_15_7B, targets)["encode"]
        half["encode"] = llava * LLAVA_15_7B.vision_tokens / shape.vision_tokens
    scale = hw.sms / ACCELERATORS["H20"].sms
    profile = _profile(hw, shape, {stage: h * scale for stage, h in half.items()})
    if not prefill_saturation:
        return profile
    return dataclasses.replace(
        profile,
        name=f"{profile.name}, prefill saturating at {prefill_saturation} tokens",
        notes=f"{profile.notes}; prefill's at {prefill_saturation} tokens on H20 instead of TriInfer's 1024",
    )


def _profile(hw: Accelerator, shape: ModelShape, half: dict[str, float]) -> LatencyProfile:
    flops = hw.bf16_tflops * 1e12 * FLOP_EFFICIENCY / 1e3  # per ms
    bandwidth = hw.hbm_tbps * 1e12 * MEMORY_EFFICIENCY / 1e3  # bytes per ms
    text_weights = shape.text_params * shape.bytes_per_param
    vision_weights = (shape.vision_params + shape.projector_params) * shape.bytes_per_param
    per_token = 2 * shape.text_params / flops
    attention = 4 * shape.text_layers * shape.text_hidden / flops  # per token × context token
    return LatencyProfile(
        name=f"{shape.name} on {hw.name} (analytic roofline)",
        source="analytic",
        hardware=hw.name,
        model=shape.name,
        encode=StageCost(ITERATION_OVERHEAD_MS, vision_weights / bandwidth, shape.encode_flops / flops, half["encode"]),
        prefill=StageCost(ITERATION_OVERHEAD_MS, text_weights / bandwidth, per_token, half["prefill"], attention),
        decode=StageCost(
            ITERATION_OVERHEAD_MS,
            text_weights / bandwidth,
            per_token,
            half["decode"],
            shape.kv_bytes_per_token / bandwidth,
        ),
        transfer_latency_ms=LINK_LATENCY_MS,
        transfer_gbps=hw.link_gbps * LINK_EFFICIENCY,
        image_tokens=shape.image_tokens,
        notes=f"peak {hw.bf16_tflops} TFLOP/s bf16, {hw.hbm_tbps} TB/s, {hw.sms} SMs; efficiencies flop "
        f"{FLOP_EFFICIENCY}, memory {MEMORY_EFFICIENCY}, link {LINK_EFFICIENCY}; half_units calibrated on H20 "
        "to TriInfer's saturation points and scaled by SM count",
    )


def saturation_points(profile: LatencyProfile, decode_context: int = TRIINFER_H20["decode_context"]) -> dict[str, int]:
    """Batch sizes at which each stage reaches 90% of its best throughput."""
    return {
        "encode_images": saturation(lambda n: encode_ms(profile, n), limit=256),
        "prefill_tokens": saturation(lambda t: prefill_chunk_ms(profile, t), limit=1 << 15),
        "decode_sequences": saturation(lambda b: decode_ms(profile, b, b * decode_context), limit=1 << 13),
    }


def _earliest_prefill_saturation(shape: ModelShape) -> int:
    half = _calibrated_half_units(shape)
    return saturation_points(_profile(ACCELERATORS["H20"], shape, {**half, "prefill": 0.0}))["prefill_tokens"]


def _calibrated_half_units(shape: ModelShape, points: dict[str, int] = TRIINFER_H20) -> dict[str, float]:
    """Per stage, the half_units (bisection) that put the H20 profile's saturation at `points` (TriInfer's)."""
    hw = ACCELERATORS["H20"]
    targets = {
        "encode": ("encode_images", points["encode_images"], 64.0),
        "prefill": ("prefill_tokens", points["prefill_tokens"], 8192.0),
        "decode": ("decode_sequences", points["decode_sequences"], 4096.0),
    }
    half = {"encode": 0.0, "prefill": 0.0, "decode": 0.0}
    for stage, (key, target, upper) in targets.items():
        lo, hi = 0.0, upper
        for _ in range(40):
            mid = (lo + hi) / 2
            point = saturation_points(_profile(hw, shape, {**half, stage: mid}))[key]
            lo, hi = (mid, hi) if point < target else (lo, mid)
        half[stage] = (lo + hi) / 2
    return half


def load_profile(spec: str, prefill_saturation: int | None = None) -> LatencyProfile:
    """`H20`, `H100` or `H200`: the analytic profile of LLaVA-1.5-7B on it; `H20:qwen2-vl-7b-1344`: of another
    shape in `SHAPES`; anything else: a profile file. `prefill_saturation`: `analytic_profile`'s (analytic only)."""
    accelerator, _, shape = spec.partition(":")
    if accelerator.upper() in ACCELERATORS:
        if shape and shape not in SHAPES:
            raise ValueError(f"unknown model shape {shape!r} in profile {spec!r}; choose from {', '.join(SHAPES)}")
        return analytic_profile(accelerator.upper(), SHAPES[shape] if shape else LLAVA_15_7B, prefill_saturation)
    if prefill_saturation:
        raise ValueError("a prefill saturation point applies to an analytic profile, not to a profile file")
    return LatencyProfile.load(spec)
