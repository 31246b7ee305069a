"""What the simulator predicts at 8, 32 and 128 GPUs: the best prefill:decode split per size.

Two sets of step costs, both stated, neither measured on a GPU here:
- `gpu_roofline_costs`: a roofline for Llama-3.1-8B in bf16 on one H100 SXM, from its data
  sheet (989 TFLOP/s dense bf16, 3.35 TB/s HBM3) at assumed efficiencies: a step reads the
  weights once (base), each prefill token costs 2 x params FLOPs, each decoding sequence
  reads its KV (mean context x KV bytes per token) and costs 2 x params FLOPs;
- the CPU-calibrated costs of SmolLM2 measured on this machine (`calibrate.py`), where one
  "GPU" is one CPU core running one instance.

For each, a Poisson workload whose rate grows with the cluster (`rate_per_gpu x GPUs`) is
simulated on every colocated and P:D shape (`planner.search_shapes`), TP degrees included.
Shapes are ranked by SLO attainment at that offered rate (`served_per_gpu` = rate per GPU x
attainment), not by the planner's goodput: a window of a few seconds of arrivals, all a
128-GPU simulation can afford, ends with a drain as long as the slowest request, and
good requests / (arrivals + drain) would rank shapes by that tail rather than by the SLOs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from minserve.disagg.costs import StepCosts
from minserve.disagg.planner import PlanPoint, search_shapes
from minserve.disagg.simulator import SLO, SimConfig
from minserve.disagg.workload import poisson_workload


@dataclass(frozen=True)
class Roofline:
    """A model on an accelerator, by the numbers a roofline needs (SI units)."""

    name: str
    params: float  # parameters
    weight_bytes: float
    kv_bytes_per_token: int  # layers x 2 x KV heads x head_dim x dtype bytes
    peak_flops: float  # dense FLOP/s of one GPU at the weights' dtype
    hbm_bytes_s: float  # memory bandwidth of one GPU
    flops_efficiency: float = 0.5  # assumed fraction of peak a prefill reaches
    bandwidth_efficiency: float = 0.8  # assumed fraction of peak bandwidth a decode reaches


# Llama-3.1-8B: 8.03e9 parameters, 32 layers, 8 KV heads of 128, bf16; H100 SXM data sheet.
LLAMA_8B_H100 = Roofline(
    "Llama-3.1-8B bf16 on H100 SXM (roofline)",
    8.03e9,
    2 * 8.03e9,
    32 * 2 * 8 * 128 * 2,
    989e12,
    3.35e12,
)


def gpu_roofline_costs(model: Roofline, mean_context: int) -> StepCosts:
    """Step costs from the roofline: weights read once per step, FLOPs per token, KV reads."""
    flops_s = model.peak_flops * model.flops_efficiency
    bytes_s = model.hbm_bytes_s * model.bandwidth_efficiency
    per_token = 2 * model.params / flops_s
    kv_read = mean_context * model.kv_bytes_per_token / bytes_s
    return StepCosts(
        model.weight_bytes / bytes_s, per_token, kv_read + per_token, model.kv_bytes_per_token
    )


@dataclass(frozen=True)
class PlanSetting:
    """One planning question: costs, workload shape, SLOs, link, cluster sizes, TP degrees."""

    name: str
    costs: StepCosts
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    rate_per_gpu: float  # requests/s offered per GPU
    requests_per_gpu: int
    slo: SLO
    config: SimConfig
    cluster_sizes: tuple[int, ...] = (8, 32, 128)
    tp_degrees: tuple[int, ...] = (1, 2, 4)
    tp_comm_s_per_step: float = 0.0  # added to every step at TP > 1 (an assumption)
    max_splits: int | None = 16  # P:D splits tried per TP degree, evenly spaced in P
    seed: int = 0


def gpu_setting(cluster_sizes: tuple[int, ...] = (8, 32, 128)) -> PlanSetting:
    """Llama-3.1-8B on H100s at 20 req/s per GPU (about 85% of its prefill roofline): chat-like
    lengths, TTFT <= 0.3 s, TPOT <= 15 ms (tight interactive SLOs, so that queueing and decode
    interference both can cost attainment), a 50 GB/s (400 Gb/s) KV link between instances,
    TP all-reduces costing 2 x 32 layers x 8 us per step over NVLink. All assumed."""
    prompt, output = (256, 2048), (32, 256)
    costs = gpu_roofline_costs(LLAMA_8B_H100, mean_context=sum(prompt) // 2 + sum(output) // 4)
    return PlanSetting(
        "gpu-roofline",
        costs,
        prompt,
        output,
        rate_per_gpu=20.0,
        requests_per_gpu=40,
        slo=SLO(ttft_s=0.3, tpot_s=0.015),
        config=SimConfig(transfer_bandwidth_bytes_s=50e9, transfer_latency_s=1e-4),
        cluster_sizes=cluster_sizes,
        tp_comm_s_per_step=2 * 32 * 8e-6,
    )


def cpu_setting(
    costs: StepCosts, bandwidth_bytes_s: float, cluster_sizes: tuple[int, ...] = (8, 32, 128)
) -> PlanSetting:
    """SmolLM2 on CPU cores, with the mixed workload and SLOs of the measured comparison;
    TP degree 1 only (TP on CPU cores is measured in tensor_parallel.md, not modelled)."""
    from minserve.bench.disagg_workload import CPU_MIX

    return PlanSetting(
        "cpu-calibrated",
        costs,
        CPU_MIX.prompt_len,
        CPU_MIX.output_len,
        rate_per_gpu=CPU_MIX.rate_per_instance,
        requests_per_gpu=12,
        slo=CPU_MIX.slo,
        config=SimConfig(transfer_bandwidth_bytes_s=bandwidth_bytes_s),
        cluster_sizes=cluster_sizes,
        tp_degrees=(1,),
    )


def plan(setting: PlanSetting, progress=None) -> dict:
    """Every shape at every cluster size: attainment, goodput, TTFT, TPOT; best first."""
    sizes = {}
    for gpus in setting.cluster_sizes:
        work = poisson_workload(
            setting.rate_per_gpu * gpus,
            setting.requests_per_gpu * gpus,
            setting.prompt_len,
            setting.output_len,
            seed=setting.seed,
        )
        costs_by_tp = {
            tp: setting.costs.tensor_parallel(tp, setting.tp_comm_s_per_step)
            for tp in setting.tp_degrees
        }
        points = search_shapes(
            gpus, work, costs_by_tp, setting.slo, setting.config, setting.max_splits
        )
        rows = [{**_point_row(p), "served_per_gpu": setting.rate_per_gpu * p.attainment}
                for p in points]  # fmt: skip
        sizes[str(gpus)] = sorted(
            rows, key=lambda r: (r["served_per_gpu"], r["goodput"]), reverse=True
        )
        if progress is not None:
            progress.update(1)
    return {"setting": _setting_row(setting), "by_cluster_size": sizes}


def _point_row(point: PlanPoint) -> dict:
    shape, result = point.shape, point.result
    return {
        "label": shape.label,
        "num_prefill": shape.num_prefill,
        "num_decode": shape.num_decode,
        "num_colocated": shape.num_colocated,
        "tp": shape.tp,
        "goodput": point.goodput,
        "goodput_per_gpu": point.goodput_per_gpu,
        "attainment": point.attainment,
        "mean_ttft_s": result.mean_ttft_s,
        "mean_tpot_s": result.mean_tpot_s,
    }


def _setting_row(setting: PlanSetting) -> dict:
    row = asdict(setting)
    row["slo"] = asdict(setting.slo)
    return row
